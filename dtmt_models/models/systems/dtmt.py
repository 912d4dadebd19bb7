"""`dtmt` and `shallow-rnmt` (paper 000, contract §4).

Encoder: bidirectional deep transition (base cell + L_s T-GRUs), annotations h_j = [→h_j, ←h_j].
Decoder, per target step t:
    query transition    s_{t,0..Lq}   = base(y_{t-1}, s_{t-1}) then L_q T-GRUs          (eq. before 18)
    attention           c_t           = MultiHeadAdditiveAttention(C, s_{t,Lq})
    decoder transition  s_t           = base(c_t, s_{t,Lq}) then L_d T-GRUs
    readout             p(y_t)        = softmax(W_o dropout(tanh(W_1 y_{t-1} + W_2 s_t + W_3 c_t)))   (eq. 1)
Initial state s_0 = tanh(W · mean_j h_j) over the real source tokens (contract §4).
Dropout (paper 000 "Advanced techniques"): on the embeddings, on the readout before the prediction, and on
the candidate activations of every (L-/T-)GRU (`candidate_dropout`, one mask per sequence, fixed over time).
Per-gate layer norm in every cell; positional encoding x + PE/√d at the bottom of encoder and decoder.
With layer norm on, the readout normalises each of its three projections too (`readout_layer_norm`, default:
follow `layer_norm`): tanh(LN(W_1 y) + LN(W_2 s) + LN(W_3 c)). The paper is silent on the readout; without the
norms the model does not leave the unigram distribution here (why: docs/design/training.md, "Readout").
`readout_layer_norm=False` gives the plain readout of contract §4.

`shallow-rnmt` is the paper's SHALLOWRNMT baseline: the same system with transition depth 0 everywhere and
GRU cells (Table 3 also runs it with LAU / L-GRU: pass `cell`). The ablation of Table 4 ("replace a
transition module by the shallow RNMT's") is `deep_encoder/deep_query/deep_decoder=False`: that module becomes
a single `shallow_cell` (default "gru", the conventional shallow RNMT's cell) with depth 0.
Choices where the paper is silent, following the authors' code where it speaks: heads default 4 here (the
code uses 16 at d=1024; scale with the model), the multi-head context is projected back to 2H (contract §4:
"projected"), one v per head.
"""
from __future__ import annotations

from typing import Dict, Optional

import dtmt_kernels as dk
from dtmt_kernels.ops.transition import DEEP_TRANSITION_CELLS
from dtmt_models.models.attention import MultiHeadAdditiveAttention
from dtmt_models.models.embeddings import TokenEmbedding
from dtmt_models.models.registered import register_model
from dtmt_models.models.rnmt import AttentionalRNMT
from dtmt_models.models.seq2seq import Readout


@register_model("dtmt")
class DTMT(AttentionalRNMT):
    @staticmethod
    def unused_options(o: dict) -> Dict[str, str]:
        """The options that the deep_* switches `o` gives leave unused, with why (registry.unused_options)."""
        unused = {}
        modules = (("encoder", "deep_encoder"), ("query", "deep_query"), ("decoder", "deep_decoder"))
        for module, switch in modules:
            if not o[switch]:
                unused[f"{module}_depth"] = f"{switch}=False: the {module} is one shallow_cell"
        if all(not o[switch] or o[f"{module}_depth"] is not None for module, switch in modules):
            unused["depth"] = "every deep module has its own depth, or none is deep"
        if not any(o[switch] for _, switch in modules):
            unused["cell"] = "no module is deep: deep_encoder, deep_query and deep_decoder are False"
        if all(o[switch] for _, switch in modules):
            unused["shallow_cell"] = "every module is deep"
        return unused

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256,
                 depth: int = 1, cell: str = "lgru", encoder_depth: Optional[int] = None,
                 query_depth: Optional[int] = None, decoder_depth: Optional[int] = None,
                 deep_encoder: bool = True, deep_query: bool = True, deep_decoder: bool = True,
                 shallow_cell: str = "gru", heads: int = 4, attention_dim: Optional[int] = None, layer_norm: bool = True,
                 positional_encoding: bool = True, dropout: float = 0.1, candidate_dropout: float = 0.1,
                 tie_embeddings: bool = False, readout_layer_norm: Optional[bool] = None, pad_id: int = 0,
                 backend: str = "auto"):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        # each one checked even where the deep_* switches leave it unused (cell='zzz' or depth=-5 with every module
        # shallow built without a word)
        for arg, value in (("cell", cell), ("shallow_cell", shallow_cell)):
            if value not in DEEP_TRANSITION_CELLS:
                kinds = ", ".join(map(repr, DEEP_TRANSITION_CELLS[:-1])) + f" or {DEEP_TRANSITION_CELLS[-1]!r}"
                raise ValueError(f"{self.model_name}: {arg} must be {kinds}, got {value!r}")
        for arg, value in (("depth", depth), ("encoder_depth", encoder_depth), ("query_depth", query_depth),
                           ("decoder_depth", decoder_depth)):
            if value is not None and (not isinstance(value, int) or not 0 <= value <= dk.nn.MAX_DEPTH):
                raise ValueError(f"{self.model_name}: {arg} must be an int from 0 to {dk.nn.MAX_DEPTH}, got {value!r}")
        H = hidden_size
        depths = [depth if d is None else d for d in (encoder_depth, query_depth, decoder_depth)]
        deep = (deep_encoder, deep_query, deep_decoder)
        depths = [d if is_deep else 0 for d, is_deep in zip(depths, deep)]
        cells = [cell if is_deep else shallow_cell for is_deep in deep]
        self.depths, self.cells = tuple(depths), tuple(cells)
        common = dict(layer_norm=layer_norm, candidate_dropout=candidate_dropout, backend=backend)
        self.src_embed = TokenEmbedding(src_vocab_size, embed_dim, pad_id, positional_encoding, dropout)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, embed_dim, pad_id, positional_encoding, dropout)
        self.encoder = dk.nn.DeepTransitionGRU(embed_dim, H, depth=depths[0], cell=cells[0], bidirectional=True,
                                               batch_first=True, **common)
        self.init_state = dk.nn.Linear(2 * H, H)
        self.query_cell = dk.nn.DeepTransitionGRUCell(embed_dim, H, depth=depths[1], cell=cells[1], **common)
        self.attention = MultiHeadAdditiveAttention(H, 2 * H, attention_dim or H, heads, backend)
        self.decoder_cell = dk.nn.DeepTransitionGRUCell(2 * H, H, depth=depths[2], cell=cells[2], **common)
        if readout_layer_norm is None:
            readout_layer_norm = layer_norm
        self.readout = Readout(embed_dim, H, 2 * H, embed_dim, tgt_vocab_size, dropout,
                               self.tgt_embed.weight if tie_embeddings else None, layer_norm=readout_layer_norm)


@register_model("shallow-rnmt")
class ShallowRNMT(DTMT):
    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, cell: str = "gru", depth: int = 0, **options):
        super().__init__(src_vocab_size, tgt_vocab_size, cell=cell, depth=depth, **options)
