"""Training presets per system (model options plus training settings), and the papers' table rows.

`small` (the default) is sized for CPU training on the embedded Bible corpus. `paper` follows the paper's sizes and settings (meant for a GPU). Every row of the papers'
tables that one of our systems can build is a preset too, named paper-table-row (`PAPER_ROWS`, listed by
`dtmt models`): `dtmt train --preset 002-T4-bideep-4x2` builds that row at the paper's sizes with the training
settings of that experiment. Anything here can be overridden on the command line (`--opt key=value` for
model options, the flags for training settings).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from dtmt_models.errors import did_you_mean

# Training settings shared by every preset unless a preset overrides them.
# max_epochs bounds a run started without --max-epochs / --max-steps / --max-time (None: until early stopping).
TRAIN_DEFAULTS = dict(lr=1e-3, schedule="rnmt", warmup=200, decay_start=1500, decay_end=6000,
                      smoothing=0.1, clip=1.0, adam_beta2=0.998, adam_eps=1e-9, max_tokens=2000, vocab_size=4000,
                      max_len=100, max_epochs=6)
# Adam as each paper states it (β1 0.9 in all): paper 000 l.194 β2 0.999, ε 1e-6; paper 003 l.227 (after Vaswani et
# al.) 0.98, 1e-9; paper 004 §4.2 0.999, ε not stated (Kingma and Ba's 1e-8); paper 002 defers to Nematus, whose
# Adam is Kingma and Ba's (0.999, 1e-8). The small presets keep 0.998 / 1e-9.
_ADAM_000 = dict(adam_beta2=0.999, adam_eps=1e-6)
_ADAM_KINGMA_BA = dict(adam_beta2=0.999, adam_eps=1e-8)
_ADAM_VASWANI = dict(adam_beta2=0.98, adam_eps=1e-9)
_BATCH_004 = dict(max_sentences=80, max_tokens=80 * 101)

_SMALL = dict(embed_dim=128, hidden_size=256)

PRESETS: Dict[str, Dict[str, dict]] = {
    # paper 000: d = 1024; dropouts 0.3 / 0.3 / 0.1 on embeddings / output / candidates; label smoothing 0.1;
    # Adam with the RNMT+ schedule (eq. 17), beam 4.
    "dtmt": {
        # lr 2e-3 (the shared default is 1e-3; why: docs/design/training.md, "Learning rate")
        "small": dict(model=dict(_SMALL, depth=1, cell="lgru", heads=4, dropout=0.2, candidate_dropout=0.1),
                      train=dict(lr=2e-3)),
        # DTMT#4 (paper 000 Table 3, its best row): 4 T-GRUs in each of the encoder, query and decoder transitions
        "paper": dict(model=dict(embed_dim=1024, hidden_size=1024, encoder_depth=4, query_depth=4,
                                 decoder_depth=4, heads=16, dropout=0.3, candidate_dropout=0.1),
                      train=dict(lr=1e-4, warmup=50, decay_start=200000, decay_end=1200000, max_tokens=8000,
                                 vocab_size=32000, init_uniform=0.08, **_ADAM_000)),
    },
    "shallow-rnmt": {
        "small": dict(model=dict(_SMALL, heads=4, dropout=0.2, candidate_dropout=0.1), train=dict()),
        "paper": dict(model=dict(embed_dim=1024, hidden_size=1024, heads=16, dropout=0.3, candidate_dropout=0.1),
                      train=dict(lr=1e-4, warmup=50, decay_start=200000, decay_end=1200000, max_tokens=8000,
                                 vocab_size=32000, init_uniform=0.08, **_ADAM_000)),
    },
    # paper 001: 512-d embeddings and states (1000 in the paper's largest runs), 4+4 layers; weights from N(0, 0.04²)
    # (l.157); Adadelta with ε 1e-6 and ρ 0.95 (l.160-177; at rate 1: Zeiler's has none), clipping at τ = 1.0;
    # batches of 128 sentences up to 80 words (l.177; 80 subwords here).
    "deeplau": {
        "small": dict(model=dict(_SMALL, encoder_layers=2, decoder_layers=2, dropout=0.3), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=512, encoder_layers=4, decoder_layers=4, dropout=0.5),
                      train=dict(lr=1.0, schedule="constant", clip=1.0, optimizer="adadelta", adadelta_rho=0.95,
                                 adadelta_eps=1e-6, init_normal=0.04, max_sentences=128, max_tokens=128 * 81,
                                 max_len=80, vocab_size=30000)),
    },
    # paper 002: BiDeep GRU (encoder 2 × transition 2, decoder 2 with base transition 4, high 2), LN, tied.
    "nematus": {
        "small": dict(model=dict(_SMALL, encoder="deep-transition", decoder="deep-transition", enc_transition_depth=2,
                                 dec_base_transition_depth=2, dropout=0.2), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=1024, encoder="bideep", decoder="bideep", dropout=0.1),
                      train=dict(lr=1e-4, schedule="constant", clip=1.0, max_tokens=8000, vocab_size=90000,
                                 **_ADAM_KINGMA_BA)),
    },
    # paper 003: 512-d embeddings and states, inverse-sqrt schedule (eq. 26-27) with β = 6000.
    "mce": {
        "small": dict(model=dict(_SMALL, annotation="ntm-rnn-emb", dropout=0.3), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=512, annotation="ntm-rnn-emb", dropout=0.5),
                      train=dict(lr=1.0, schedule="inverse-sqrt", warmup=6000, max_tokens=6000, vocab_size=30000,
                                 **_ADAM_VASWANI)),
    },
    # paper 004 §4.2: embeddings 620, hidden 1000, BPE vocabularies of 40K, Adam (0.9, 0.999) lr 5e-4 halved after
    # each epoch, clipping 5.0, dropout 0.2 on the output layer, no label smoothing named, tied target embeddings;
    # GNMT+ATR: 8 + 8 layers of 512 (our reading of §4.2, whose sentence on GNMT's dimensionality is cut in our copy).
    # Batches of 80 sentences, with a token budget every 80 pairs of up to 100 subwords fit (the sentences bind);
    # weights from U(-0.08, 0.08).
    "rnnsearch-atr": {
        "small": dict(model=dict(_SMALL, dropout=0.2), train=dict()),
        "paper": dict(model=dict(embed_dim=620, hidden_size=1000, dropout=0.2),
                      train=dict(lr=5e-4, schedule="epoch-halving", clip=5.0, smoothing=0.0, **_BATCH_004,
                                 vocab_size=40000, init_uniform=0.08, **_ADAM_KINGMA_BA)),
    },
    "gnmt-atr": {
        "small": dict(model=dict(_SMALL, encoder_layers=2, decoder_layers=2, dropout=0.2), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=512, encoder_layers=8, decoder_layers=8, dropout=0.2),
                      train=dict(lr=5e-4, schedule="epoch-halving", clip=5.0, smoothing=0.0, **_BATCH_004,
                                 vocab_size=40000, init_uniform=0.08, **_ADAM_KINGMA_BA)),
    },
    # our transformer baseline, sized like the small dtmt (5.1 M against 5.2 M parameters at vocabularies 4,000).
    "transformer": {
        "small": dict(model=dict(embed_dim=192, hidden_size=768, heads=4, encoder_layers=4, decoder_layers=3,
                                 dropout=0.1),
                      train=dict(lr=1.0, schedule="inverse-sqrt", warmup=1000)),
        "paper": dict(model=dict(embed_dim=512, hidden_size=2048, heads=8, encoder_layers=6, decoder_layers=6,
                                 dropout=0.1),
                      train=dict(lr=2.0, schedule="inverse-sqrt", warmup=4000, max_tokens=8000, vocab_size=32000,
                                 **_ADAM_VASWANI)),
    },
}


# What a paper's presets are known not to follow of its stated training, per paper (docs/usage.md lists them;
# why the presets follow the rest: docs/design/training.md, "The papers' training settings").
PAPER_DEVIATIONS: Dict[str, List[str]] = {
    "001": ["gradient clipping at 1.0 throughout, not halved until the dev BLEU settles (l.177)"],
}


# ------------------------------------------------------------------------------------ the papers' rows
@dataclass(frozen=True)
class PaperTable:
    """One table of a paper: where it is, the vocabulary size per side at which `dtmt models --count` and the
    tests count its rows (differences between rows do not depend on it), and the training settings of its
    experiments (over the system's `paper` preset)."""
    key: str                  # "000-T3": paper file prefix and table number
    title: str
    vocab: int
    train: Dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class PaperRow:
    """A row of a paper's table as a preset: `name` (the preset), the system and its options at the paper's
    sizes, the row as the paper prints it (with the line of the paper file), the parameter count the table
    reports (None: BLEU only; exact integers in paper 003, millions rounded to 0.1 elsewhere), and, when our
    count cannot follow the paper's, why (`unmatched`). (A paper whose implementation lays the same model out in
    more parameters is counted in its layout: catalog.layout_parameters.)"""
    name: str
    model: str
    label: str
    options: Dict[str, object]
    params: Optional[float] = None
    unmatched: str = ""

    @property
    def table(self) -> str:
        return self.name[:6]


TABLES = {t.key: t for t in (
    # paper 000, NIST Zh⇒En (l.199-203): eq. 17 with lr0 1e-3, p 500, s 8000, e 64000 on 2 GPUs (--replicas 2
    # on fewer processes to follow the paper's n), 4096 tokens per GPU, sentences up to 128 subwords,
    # 30K BPE merges per side (l.192); dropout 0.5 / 0.5 / 0.3 (model options of the rows).
    PaperTable("000-T3", "DTMT (000) Table 3: NIST Zh⇒En, # Para.", 30000,
               dict(lr=1e-3, warmup=500, decay_start=8000, decay_end=64000, max_tokens=4096, max_len=128,
                    vocab_size=30000)),
    PaperTable("000-T4", "DTMT (000) Table 4: transition modules replaced by the shallow RNMT's", 30000,
               dict(lr=1e-3, warmup=500, decay_start=8000, decay_end=64000, max_tokens=4096, max_len=128,
                    vocab_size=30000)),
    PaperTable("000-T6", "DTMT (000) Table 6: with and without positional encoding", 30000,
               dict(lr=1e-3, warmup=500, decay_start=8000, decay_end=64000, max_tokens=4096, max_len=128,
                    vocab_size=30000)),
    # paper 002, WMT17 En→De; sizes from the authors' configurations (the paper defers to Sennrich et al.
    # 2017a): 512 / 1024, tied decoder embeddings, layer norm, no dropout, sentences up to 50 words. 60,000 subwords
    # a side, at which the counts come within 3 M of the paper's (98.0 M for the baseline; the nematus paper
    # preset's 90,000, which the rows had trained with, gives 126 M)
    PaperTable("002-T1", "Deep architectures (002) Table 1: layer normalisation", 60000,
               dict(max_len=50, vocab_size=60000)),
    PaperTable("002-T2", "Deep architectures (002) Table 2: deep encoders", 60000, dict(max_len=50, vocab_size=60000)),
    PaperTable("002-T3", "Deep architectures (002) Table 3: deep decoders", 60000, dict(max_len=50, vocab_size=60000)),
    PaperTable("002-T4", "Deep architectures (002) Table 4: deep encoders and decoders, BiDeep", 60000,
               dict(max_len=50, vocab_size=60000)),
    # paper 003, NIST Zh→En: 30K words per side, sentences up to 50 (l.187); eq. 26-27 on 8 GPUs (l.235).
    PaperTable("003-T1", "Multi-channel encoder (003) Table 1: channels", 30000, dict(max_len=50)),
    # paper 004, WMT14 En→De: 40K BPE per side, sentences up to 80 (l.150).
    PaperTable("004-T2", "ATR (004) Table 2: WMT14 En→De BLEU", 40000, dict(max_len=80)),
    PaperTable("004-T4", "ATR (004) Table 4: #PMs", 40000, dict(max_len=80)),
)}

_D000 = dict(embed_dim=1024, hidden_size=1024, heads=16, dropout=0.5, candidate_dropout=0.3)
_N002 = dict(embed_dim=512, hidden_size=1024, tie_embeddings=True, dropout=0.0)
_M003 = dict(embed_dim=512, hidden_size=512, dropout=0.5)
_A004 = dict(embed_dim=620, hidden_size=1000, dropout=0.2)
_EMB = ("the paper's EMB count is NTM − 1.5·1024² exactly: it still counts memory-encoder variables that an "
        "embeddings-only annotation never reads; ours builds no encoder for it")

PAPER_ROWS: List[PaperRow] = [
    # ---- paper 000, Table 3 (l.237-248)
    PaperRow("000-T3-shallow-gru", "shallow-rnmt", "SHALLOWRNMT, GRU (l.238)", dict(_D000, cell="gru"), 143.2),
    PaperRow("000-T3-shallow-lau", "shallow-rnmt", "SHALLOWRNMT, LAU (l.239)", dict(_D000, cell="lau"), 157.9),
    PaperRow("000-T3-shallow-lgru", "shallow-rnmt", "SHALLOWRNMT, L-GRU (l.240)", dict(_D000, cell="lgru"), 157.9),
    PaperRow("000-T3-dtmt1-gru", "dtmt", "DTMT#1, GRU+T-GRU (l.241)", dict(_D000, depth=1, cell="gru"), 155.8),
    PaperRow("000-T3-dtmt1-lau", "dtmt", "DTMT#1, LAU+T-GRU (l.242)", dict(_D000, depth=1, cell="lau"), 170.5),
    PaperRow("000-T3-dtmt1", "dtmt", "DTMT#1, L-GRU+T-GRU (l.243)", dict(_D000, depth=1), 170.5),
    PaperRow("000-T3-dtmt4-gru", "dtmt", "DTMT#4, GRU+T-GRUs (l.244)", dict(_D000, depth=4, cell="gru"), 193.7),
    PaperRow("000-T3-dtmt4-lau", "dtmt", "DTMT#4, LAU+T-GRUs (l.245)", dict(_D000, depth=4, cell="lau"), 208.4),
    PaperRow("000-T3-dtmt4", "dtmt", "DTMT#4, L-GRU+T-GRUs (l.246)", dict(_D000, depth=4), 208.4),
    # ---- paper 000, Table 4 (l.260-266): DTMT#4, one transition module replaced by a shallow GRU (l.266)
    PaperRow("000-T4-full", "dtmt", "encoder √ query √ decoder √ (l.261)", dict(_D000, depth=4)),
    PaperRow("000-T4-no-enc", "dtmt", "encoder × (l.262)", dict(_D000, depth=4, deep_encoder=False)),
    PaperRow("000-T4-no-query", "dtmt", "query × (l.263)", dict(_D000, depth=4, deep_query=False)),
    PaperRow("000-T4-no-dec", "dtmt", "decoder × (l.264)", dict(_D000, depth=4, deep_decoder=False)),
    # ---- paper 002, Table 1 (l.205-213)
    PaperRow("002-T1-baseline", "nematus", "baseline (l.208)", dict(_N002, layer_norm=False), 98.0),
    PaperRow("002-T1-baseline-ln", "nematus", "+layer normalization (l.209)", dict(_N002), 98.1),
    PaperRow("002-T1-alternating4", "nematus", "alternating, depth 4 (l.210)",
             dict(_N002, encoder="alternating", enc_depth=4, layer_norm=False), 135.8),
    PaperRow("002-T1-alternating4-ln", "nematus", "+layer normalization (l.211)",
             dict(_N002, encoder="alternating", enc_depth=4), 135.9),
    # ---- paper 002, Table 2 (l.215-223)
    PaperRow("002-T2-shallow", "nematus", "shallow, 1/-/1 (l.218)", dict(_N002), 98.1),
    PaperRow("002-T2-alternating4", "nematus", "alternating, 4/-/1 (l.219)",
             dict(_N002, encoder="alternating", enc_depth=4), 135.9),
    PaperRow("002-T2-biunidirectional4", "nematus", "biunidirectional, 1/3/1 (l.220)",
             dict(_N002, encoder="biunidirectional", enc_depth=4), 173.7),
    PaperRow("002-T2-deep-transition4", "nematus", "deep transition, 1/-/4 (l.221)",
             dict(_N002, encoder="deep-transition", enc_transition_depth=4), 117.0),
    # ---- paper 002, Table 3 (l.249-260)
    PaperRow("002-T3-shallow", "nematus", "shallow (l.252)", dict(_N002), 98.1),
    PaperRow("002-T3-stacked-gru4", "nematus", "stacked, GRU, 4 (l.253)", dict(_N002, decoder="gru", dec_depth=4),
             117.0),
    PaperRow("002-T3-stacked-rgru4", "nematus", "stacked, rGRU, 4 (l.254)", dict(_N002, decoder="rgru", dec_depth=4),
             135.9),
    PaperRow("002-T3-stacked-cgru4", "nematus", "stacked, cGRU, 4 (l.255)", dict(_N002, decoder="cgru", dec_depth=4),
             164.3),
    PaperRow("002-T3-stacked-crgru4", "nematus", "stacked, crGRU, 4 (l.256)",
             dict(_N002, decoder="crgru", dec_depth=4), 145.4),
    PaperRow("002-T3-deep-transition8", "nematus", "deep transition, 8 (l.257)",
             dict(_N002, decoder="deep-transition", dec_base_transition_depth=8), 117.0),
    PaperRow("002-T3-deep-output4", "nematus", "deep output, 4 (l.258)", dict(_N002, output_depth=4), 98.9),
    # ---- paper 002, Table 4 (l.262-278)
    PaperRow("002-T4-shallow", "nematus", "shallow / shallow (l.265)", dict(_N002), 98.1),
    PaperRow("002-T4-dt4-shallow", "nematus", "deep transition 4 / shallow (l.266)",
             dict(_N002, encoder="deep-transition", enc_transition_depth=4), 117.0),
    PaperRow("002-T4-alternating4-gru4", "nematus", "alternating 4 / stacked GRU 4, Zhou et al. (l.267)",
             dict(_N002, encoder="alternating", enc_depth=4, decoder="gru", dec_depth=4), 154.9),
    PaperRow("002-T4-biunidir4-rgru4", "nematus", "biunidirectional 1+3 / stacked rGRU 4, Wu et al. (l.269)",
             dict(_N002, encoder="biunidirectional", enc_depth=4, decoder="rgru", dec_depth=4), 211.5),
    PaperRow("002-T4-alternating4-rgru4", "nematus", "alternating 4 / stacked rGRU 4 (l.271)",
             dict(_N002, encoder="alternating", enc_depth=4, decoder="rgru", dec_depth=4), 173.7),
    PaperRow("002-T4-alternating4-cgru4", "nematus", "alternating 4 / stacked cGRU 4 (l.272)",
             dict(_N002, encoder="alternating", enc_depth=4, decoder="cgru", dec_depth=4), 202.1),
    PaperRow("002-T4-dt4-dt8", "nematus", "deep transition 4 / deep transition 8 (l.273)",
             dict(_N002, encoder="deep-transition", enc_transition_depth=4, decoder="deep-transition",
                  dec_base_transition_depth=8), 136.0),
    PaperRow("002-T4-bideep-2x2", "nematus", "BiDeep 2×2 / BiDeep rGRU 2, 4/2 (l.274)",
             dict(_N002, encoder="bideep", enc_depth=2, enc_transition_depth=2, decoder="bideep", dec_depth=2,
                  dec_base_transition_depth=4, dec_high_transition_depth=2, dec_high_cell="rgru"), 145.4),
    PaperRow("002-T4-bideep-4x2", "nematus", "BiDeep 4×2 / BiDeep rGRU 4, 4/2 (l.275)",
             dict(_N002, encoder="bideep", enc_depth=4, enc_transition_depth=2, decoder="bideep", dec_depth=4,
                  dec_base_transition_depth=4, dec_high_transition_depth=2, dec_high_cell="rgru"), 214.7),
    PaperRow("002-T4-alternating8-rgru8", "nematus", "alternating 8 / stacked rGRU 8 (l.276)",
             dict(_N002, encoder="alternating", enc_depth=8, decoder="rgru", dec_depth=8), 274.6),
    # ---- paper 003, Table 1 (l.243-255): exact counts
    PaperRow("003-T1-rnn", "mce", "RNN (l.245)", dict(_M003, annotation="rnn"), 56_314_881),
    PaperRow("003-T1-ntm", "mce", "NTM (l.246)", dict(_M003, annotation="ntm"), 59_988_995),
    PaperRow("003-T1-emb", "mce", "EMB (l.247)", dict(_M003, annotation="emb"), 58_416_131, _EMB),
    PaperRow("003-T1-ntm-emb", "mce", "NTM-EMB (l.248)", dict(_M003, annotation="ntm-emb"), 63_135_747),
    PaperRow("003-T1-ntm-rnn", "mce", "NTM-RNN (l.249)", dict(_M003, annotation="ntm-rnn"), 64_184_323),
    PaperRow("003-T1-rnn-emb", "mce", "RNN-EMB (l.250)", dict(_M003, annotation="rnn-emb"), 59_461_633),
    PaperRow("003-T1-ntm-rnn-emb", "mce", "NTM-RNN-EMB (l.251)", dict(_M003, annotation="ntm-rnn-emb"), 67_331_075),
    # ---- paper 004, Table 2 (l.156-182; the LSTM and RAN rows need cells we do not have)
    PaperRow("004-T2-rnnsearch-gru", "rnnsearch-atr", "RNNSearch + GRU + BPE (l.174)", dict(_A004, cell="gru")),
    PaperRow("004-T2-rnnsearch-atr", "rnnsearch-atr", "RNNSearch + ATR + BPE (l.177)", dict(_A004)),
    PaperRow("004-T2-rnnsearch-atr-ca", "rnnsearch-atr", "RNNSearch + ATR + CA + BPE (l.178)",
             dict(_A004, encoder="ca")),
    PaperRow("004-T2-gnmt-atr", "gnmt-atr", "GNMT + ATR + BPE (l.179)",
             dict(embed_dim=512, hidden_size=512, encoder_layers=8, decoder_layers=8, dropout=0.2)),
    # ---- paper 004, Table 4 (l.253-262)
    PaperRow("004-T4-rnnsearch-gru", "rnnsearch-atr", "RNNSearch+GRU (l.254)", dict(_A004, cell="gru"), 83.5),
    PaperRow("004-T4-rnnsearch-atr", "rnnsearch-atr", "RNNSearch+ATR (l.259)", dict(_A004), 67.8),
    PaperRow("004-T4-rnnsearch-atr-ca", "rnnsearch-atr", "RNNSearch+ATR+CA (l.260)", dict(_A004, encoder="ca"),
             63.1),
]
# Table 6 of paper 000 (l.285-293): each row with positional encoding (its PE column repeats Table 3) and
# without ("-nope"); PE has no parameters.
for _name, _model, _label, _opts in (
        ("shallow", "shallow-rnmt", "1 SHALLOWRNMT (l.286)", dict(cell="gru")),
        ("lgru", "shallow-rnmt", "2 + L-GRU (l.287)", dict(cell="lgru")),
        *((f"dtmt{d}", "dtmt", f"{d + 2} DTMT#{d} (l.{287 + d})", dict(depth=d)) for d in (1, 2, 3, 4))):
    PAPER_ROWS.append(PaperRow(f"000-T6-{_name}", _model, f"{_label}, PE", dict(_D000, **_opts)))
    PAPER_ROWS.append(PaperRow(f"000-T6-{_name}-nope", _model, f"{_label}, Non-PE",
                               dict(_D000, positional_encoding=False, **_opts)))
PAPER_ROWS_BY_NAME: Dict[str, PaperRow] = {r.name: r for r in PAPER_ROWS}


def presets_of(model: str) -> List[str]:
    """Every preset name `model` takes: small, paper, then its papers' rows."""
    return sorted(PRESETS.get(model, {"paper": None, "small": None})) + [r.name for r in PAPER_ROWS if r.model == model]


def get_preset(model: str, preset: str = "small") -> dict:
    """{"model": options for build_model, "train": training settings} for a system and a preset name (small,
    paper, or one of its papers' rows, PAPER_ROWS)."""
    from dtmt_models.models.registry import list_models

    if model not in list_models():
        raise ValueError(f"unknown model {model!r}{did_you_mean(model, list_models())}; choose one of "
                         f"{list_models()}")
    row = PAPER_ROWS_BY_NAME.get(preset)
    if row is None and isinstance(preset, str) and re.match(r"\d{3}-", preset):   # (a row's name, mistyped: it
        # had said that the default model, dtmt, has no such preset, naming its 20 others)
        raise ValueError(f"no paper table row {preset!r}{did_you_mean(preset, PAPER_ROWS_BY_NAME)} (`dtmt models` "
                         f"lists them)")
    if row is not None:
        if row.model != model:
            raise ValueError(f"preset {preset!r} is a {row.model} configuration, not {model}'s "
                             f"(use --model {row.model})")
        base = get_preset(model, "paper")
        return {"model": copy.deepcopy(row.options), "train": {**base["train"], **TABLES[row.table].train}}
    if model not in PRESETS:   # (a system registered by its user: its own defaults under the two names; any other
        # name had been taken without a word)
        if preset not in presets_of(model):
            raise ValueError(f"model {model!r} has no presets of its own: 'small' and 'paper' both give its own "
                             f"defaults and dtmt train's; not {preset!r}")
        return {"model": {}, "train": dict(TRAIN_DEFAULTS)}
    if preset not in PRESETS[model]:
        raise ValueError(f"model {model!r} has presets {', '.join(presets_of(model))}; not {preset!r}"
                         f"{did_you_mean(preset, presets_of(model))}")
    p = copy.deepcopy(PRESETS[model][preset])
    train = {**TRAIN_DEFAULTS, **({"max_epochs": None} if preset == "paper" else {}), **p["train"]}
    return {"model": p["model"], "train": train}
