"""Training presets per system: model options plus the training settings of its paper.

`small` (the default) is sized for a 2-core CPU on the embedded Bible corpus: a run of tens of minutes
learns visibly. `paper` follows the paper's sizes and settings (meant for a GPU). Anything here can be
overridden on the command line (`--opt key=value` for model options, the flags for training settings).
"""
from __future__ import annotations

import copy
from typing import Dict

# Training settings shared by every preset unless a preset overrides them.
# max_epochs bounds a run started without --max-epochs / --max-steps / --max-time (None: until early stopping).
TRAIN_DEFAULTS = dict(lr=1e-3, schedule="rnmt", warmup=200, decay_start=1500, decay_end=6000,
                      smoothing=0.1, clip=1.0, max_tokens=2000, vocab_size=4000, max_len=100, max_epochs=6)

_SMALL = dict(embed_dim=128, hidden_size=256)

PRESETS: Dict[str, Dict[str, dict]] = {
    # paper 000: d = 1024; dropouts 0.3 / 0.3 / 0.1 on embeddings / output / candidates; label smoothing 0.1;
    # Adam with the RNMT+ schedule (eq. 17), beam 4.
    "dtmt": {
        # lr 2e-3 (the shared default is 1e-3): at equal updates on the Bible, dev loss 3.63 against 4.01 and
        # greedy dev BLEU 8.6 against 5.6 at update 800 (benchmarks/NOTES.md, log item 15)
        "small": dict(model=dict(_SMALL, depth=1, cell="lgru", heads=4, dropout=0.2, candidate_dropout=0.1),
                      train=dict(lr=2e-3)),
        # DTMT#4 (paper 000 Table 3, its best row): 4 T-GRUs in each of the encoder, query and decoder transitions
        "paper": dict(model=dict(embed_dim=1024, hidden_size=1024, encoder_depth=4, query_depth=4,
                                 decoder_depth=4, heads=16, dropout=0.3, candidate_dropout=0.1),
                      train=dict(lr=1e-4, warmup=50, decay_start=200000, decay_end=1200000, max_tokens=8000,
                                 vocab_size=32000)),
    },
    "shallow-rnmt": {
        "small": dict(model=dict(_SMALL, heads=4, dropout=0.2, candidate_dropout=0.1), train=dict()),
        "paper": dict(model=dict(embed_dim=1024, hidden_size=1024, heads=16, dropout=0.3, candidate_dropout=0.1),
                      train=dict(lr=1e-4, warmup=50, decay_start=200000, decay_end=1200000, max_tokens=8000,
                                 vocab_size=32000)),
    },
    # paper 001: 512-d embeddings and states (1000 in the paper's largest runs), 4+4 layers; SGD in the paper,
    # Adam here.
    "deeplau": {
        "small": dict(model=dict(_SMALL, encoder_layers=2, decoder_layers=2, dropout=0.3), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=512, encoder_layers=4, decoder_layers=4, dropout=0.5),
                      train=dict(lr=5e-4, schedule="constant", clip=1.0, max_tokens=6000, vocab_size=30000)),
    },
    # paper 002: BiDeep GRU (encoder 2 × transition 2, decoder 2 with base transition 4, high 2), LN, tied.
    "nematus": {
        "small": dict(model=dict(_SMALL, encoder="deep-transition", decoder="deep-transition", enc_transition_depth=2,
                                 dec_base_transition_depth=2, dropout=0.2), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=1024, encoder="bideep", decoder="bideep", dropout=0.1),
                      train=dict(lr=1e-4, schedule="constant", clip=1.0, max_tokens=8000, vocab_size=90000)),
    },
    # paper 003: 512-d embeddings and states, inverse-sqrt schedule (eq. 26-27) with β = 6000.
    "mce": {
        "small": dict(model=dict(_SMALL, annotation="ntm-rnn-emb", dropout=0.3), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=512, annotation="ntm-rnn-emb", dropout=0.5),
                      train=dict(lr=1.0, schedule="inverse-sqrt", warmup=6000, max_tokens=6000, vocab_size=30000)),
    },
    # paper 004 §4.2: embeddings 620, hidden 1000, BPE vocabularies of 40K, Adam lr 5e-4, clipping 5.0, dropout
    # 0.2 on the output layer, tied target embeddings; GNMT+ATR: 8 + 8 layers of 512 (the issue-26 reading of
    # §4.2, whose sentence on GNMT's dimensionality is cut in our copy).
    "rnnsearch-atr": {
        "small": dict(model=dict(_SMALL, dropout=0.2), train=dict()),
        "paper": dict(model=dict(embed_dim=620, hidden_size=1000, dropout=0.2),
                      train=dict(lr=5e-4, schedule="constant", clip=5.0, max_tokens=4000, vocab_size=40000)),
    },
    "gnmt-atr": {
        "small": dict(model=dict(_SMALL, encoder_layers=2, decoder_layers=2, dropout=0.2), train=dict()),
        "paper": dict(model=dict(embed_dim=512, hidden_size=512, encoder_layers=8, decoder_layers=8, dropout=0.2),
                      train=dict(lr=5e-4, schedule="constant", clip=5.0, max_tokens=8000, vocab_size=40000)),
    },
    # the baseline of issue 6, sized like the small dtmt (5.1 M against 5.2 M parameters at vocabularies 4,000).
    "transformer": {
        "small": dict(model=dict(embed_dim=192, hidden_size=768, heads=4, encoder_layers=4, decoder_layers=3,
                                 dropout=0.1),
                      train=dict(lr=1.0, schedule="inverse-sqrt", warmup=1000)),
        "paper": dict(model=dict(embed_dim=512, hidden_size=2048, heads=8, encoder_layers=6, decoder_layers=6,
                                 dropout=0.1),
                      train=dict(lr=2.0, schedule="inverse-sqrt", warmup=4000, max_tokens=8000, vocab_size=32000)),
    },
}


def get_preset(model: str, preset: str = "small") -> dict:
    """{"model": options for build_model, "train": training settings} for a system and a preset name."""
    from .registry import list_models

    if model not in list_models():
        raise ValueError(f"unknown model {model!r}; choose one of {list_models()}")
    if model not in PRESETS:
        return {"model": {}, "train": dict(TRAIN_DEFAULTS)}
    if preset not in PRESETS[model]:
        raise ValueError(f"model {model!r} has presets {sorted(PRESETS[model])}, not {preset!r}")
    p = copy.deepcopy(PRESETS[model][preset])
    train = {**TRAIN_DEFAULTS, **({"max_epochs": None} if preset == "paper" else {}), **p["train"]}
    return {"model": p["model"], "train": train}
