"""Paper 004's ATR systems.

`rnnsearch-atr`: RNNSearch with every recurrent unit an ATR. Encoder: bidirectional ATR (`encoder="bi"`) or
the context-aware encoder (`encoder="ca"`, Zhang et al. 2017b as used in paper 004: a backward ATR reads
the sentence first, then a forward ATR reads [x_j; ←h_j], and the annotation is [→h_j; ←h_j] — our reading:
the appendix with its equations is not in the paper text we have; the authors' later code instead runs a
two-level backward cell over the forward states, which needs a per-step Python loop here). Output layer tied
to the target embedding by default (the paper's parameter counts imply it). Decoder: the two-level hierarchical
decoder of paper 004 §4.1 (as Nematus' cGRU): s̃_t = ATR(y_{t-1}, s_{t-1}), c_t = additive attention(s̃_t),
s_t = ATR(c_t, s̃_t); readout tanh(W y + W s + W c) with dropout 0.2 on the output layer (§4.2).

`gnmt-atr`: the GNMT architecture (Wu et al. 2016) with ATR units, paper 004 §4.2. Encoder: a bidirectional
bottom layer, then unidirectional layers, residual connections from the third layer up. Decoder: `layers`
stacked ATRs; the bottom layer reads y_{t-1}, its output queries the attention, every higher layer reads
[s^{l-1}_t; c_t], residual from the third layer up; the readout sees the top state and c_t. GNMT queries
the attention with the bottom layer's *previous* output to parallelise; we use the current one (as
RNNSearch), which the sequential CPU decoder does not mind. Each decoder layer starts from
tanh(W_l · mean annotation).

Both take `cell` ("atr" default; "gru", "lgru", "lau"): paper 004 Table 2 compares the same skeleton with
other units.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
from torch import Tensor

import dtmt_kernels as dk

from ..attention import AdditiveAttention
from ..embeddings import TokenEmbedding
from ..registry import register_model
from ..rnmt import AttentionalRNMT, recurrent_cell, recurrent_layer, start_state
from ..seq2seq import Readout, Seq2Seq, State, step_state


@register_model("rnnsearch-atr")
class RNNSearchATR(AttentionalRNMT):
    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256,
                 encoder: str = "bi", cell: str = "atr", layer_norm: bool = False, dropout: float = 0.2,
                 tie_embeddings: bool = True, pad_id: int = 0, backend: str = "auto"):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        if encoder not in ("bi", "ca"):
            raise ValueError(f"rnnsearch-atr: encoder must be 'bi' or 'ca', got {encoder!r}")
        E, H = embed_dim, hidden_size
        self.encoder_kind = encoder
        opts = dict(layer_norm=layer_norm, backend=backend)
        self.src_embed = TokenEmbedding(src_vocab_size, E, pad_id)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, E, pad_id)
        if encoder == "bi":
            self.encoder = recurrent_layer(cell, E, H, bidirectional=True, batch_first=True, **opts)
        else:
            self.encoder_backward = recurrent_layer(cell, E, H, batch_first=True, reverse=True, **opts)
            self.encoder_forward = recurrent_layer(cell, E + H, H, batch_first=True, **opts)
        self.init_state = dk.nn.Linear(2 * H, H)
        self.query_cell = recurrent_cell(cell, E, H, **opts)
        self.attention = AdditiveAttention(H, 2 * H, H, backend=backend)
        self.decoder_cell = recurrent_cell(cell, 2 * H, H, **opts)
        self.readout = Readout(E, H, 2 * H, E, tgt_vocab_size, dropout,
                               self.tgt_embed.weight if tie_embeddings else None)

    def encode_source(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        x = self.src_embed(src)
        if self.encoder_kind == "bi":
            return self.encoder(x, lengths=src_lengths)[0]
        backward, _ = self.encoder_backward(x, lengths=src_lengths)
        forward, _ = self.encoder_forward(torch.cat([x, backward], -1), lengths=src_lengths)
        return torch.cat([forward, backward], -1)


@register_model("gnmt-atr")
class GNMTATR(Seq2Seq):
    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256,
                 encoder_layers: int = 4, decoder_layers: int = 4, cell: str = "atr", layer_norm: bool = False,
                 dropout: float = 0.2, tie_embeddings: bool = False, pad_id: int = 0, backend: str = "auto"):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        if encoder_layers < 2 or decoder_layers < 1:
            raise ValueError("gnmt-atr: needs encoder_layers >= 2 (bidirectional bottom + one more) and "
                             f"decoder_layers >= 1, got {encoder_layers}, {decoder_layers}")
        E, H = embed_dim, hidden_size
        opts = dict(layer_norm=layer_norm, backend=backend)
        self.src_embed = TokenEmbedding(src_vocab_size, E, pad_id)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, E, pad_id)
        self.encoder = nn.ModuleList([recurrent_layer(cell, E, H, bidirectional=True, batch_first=True, **opts),
                                      recurrent_layer(cell, 2 * H, H, batch_first=True, **opts)])
        self.encoder.extend(recurrent_layer(cell, H, H, batch_first=True, **opts) for _ in range(encoder_layers - 2))
        self.init_state = dk.nn.Linear(H, decoder_layers * H)
        self.attention = AdditiveAttention(H, H, H, backend=backend)
        self.decoder = nn.ModuleList([recurrent_cell(cell, E, H, **opts)])
        self.decoder.extend(recurrent_cell(cell, 2 * H, H, **opts) for _ in range(decoder_layers - 1))
        self.readout = Readout(E, H, H, E, tgt_vocab_size, dropout,
                               self.tgt_embed.weight if tie_embeddings else None)

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        h = self.src_embed(src)
        for l, layer in enumerate(self.encoder):
            out, _ = layer(h, lengths=src_lengths)
            h = out + h if l >= 2 else out       # residual connections from the third layer on
        return start_state(self.attention, self.init_state, h, src_lengths, layers=len(self.decoder))

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        prev = state["s"]
        s = [self.decoder[0](y, prev[:, 0])]
        c, alpha = self.attention(s[0], state["keys"], state["annotations"], state["src_mask"])
        for l in range(1, len(self.decoder)):
            out = self.decoder[l](torch.cat([s[-1], c], -1), prev[:, l])
            s.append(out + s[-1] if l >= 2 else out)
        return (s[-1], c), step_state(state, alpha, keep_attention, s=torch.stack(s, 1))
