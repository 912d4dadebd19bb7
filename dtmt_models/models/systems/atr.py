"""Paper 004's ATR systems.

`rnnsearch-atr`: RNNSearch with every recurrent unit an ATR. Encoder: bidirectional ATR (`encoder="bi"`,
annotations [→h_j; ←h_j], 2H wide) or the context-aware encoder (`encoder="ca"`, Zhang et al. 2017b as paper
004 uses it; laid out as the authors' released code does, which paper 004 Table 4's counts fit: RNNSearch+ATR+CA
4.7 M smaller than RNNSearch+ATR): a forward ATR →h_j over x, then right to left a two-level ATR
    s̃_j = ATR_lo(x_j, ←h_{j+1}),    ←h_j = ATR_hi(→h_j, s̃_j)
whose states ←h_j (H wide) are the annotations. The attention space is the annotation width (2H for "bi",
H for "ca"), as RNNSearch's. Output layer tied to the target embedding by default (the paper's parameter
counts imply it). Decoder: the two-level hierarchical decoder of paper 004 §4.1 (as Nematus' cGRU):
s̃_t = ATR(y_{t-1}, s_{t-1}), c_t = additive attention(s̃_t), s_t = ATR(c_t, s̃_t); readout
tanh(W y + W s + W c) with dropout 0.2 on the output layer (§4.2).

`gnmt-atr`: the GNMT architecture (Wu et al. 2016) with ATR units, paper 004 §4.2. Encoder: a bidirectional
bottom layer, then unidirectional layers, residual connections from the third layer up. Decoder: `layers`
stacked ATRs; the bottom layer reads y_{t-1}, its output queries the attention, every higher layer reads
[x^{l-1}_t; c_t] where x^l = s^l + x^{l-1} from the third layer up (x^l = s^l below): the residual sum is the
next layer's input, never a layer's own recurrent state (GNMT, Wu et al. 2016 §3.1; as this encoder); the
readout sees the top x and c_t. GNMT queries
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
from dtmt_models.engine.decoder import step_state
from dtmt_models.models.attention import AdditiveAttention
from dtmt_models.models.embeddings import TokenEmbedding
from dtmt_models.models.registered import register_model
from dtmt_models.models.rnmt import (
    AttentionalRNMT,
    recurrent_cell,
    recurrent_layer,
    start_state,
)
from dtmt_models.models.seq2seq import Readout, Seq2Seq, State, lengths_mask


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
            self.encoder = ContextAwareEncoder(cell, E, H, **opts)
        C = 2 * H if encoder == "bi" else H    # the annotation width, also the attention space
        self.init_state = dk.nn.Linear(C, H)
        self.query_cell = recurrent_cell(cell, E, H, **opts)
        self.attention = AdditiveAttention(H, C, C, backend=backend)
        self.decoder_cell = recurrent_cell(cell, C, H, **opts)
        self.readout = Readout(E, H, C, E, tgt_vocab_size, dropout,
                               self.tgt_embed.weight if tie_embeddings else None)


class ContextAwareEncoder(nn.Module):
    """The CA encoder (module docstring): x [B, S, E], lengths [B] -> (annotations ←h [B, S, H], zeros at
    padding; None). The backward pass starts at each sentence's own last token. Its two-level cell runs one
    time step per Python iteration (the forward layer is a fused sequence kernel)."""

    def __init__(self, cell: str, input_size: int, hidden_size: int, **opts):
        super().__init__()
        self.forward_layer = recurrent_layer(cell, input_size, hidden_size, batch_first=True, **opts)
        self.lower = recurrent_cell(cell, input_size, hidden_size, **opts)
        self.higher = recurrent_cell(cell, hidden_size, hidden_size, **opts)

    def forward(self, x: Tensor, lengths: Tensor) -> Tuple[Tensor, None]:
        forward, _ = self.forward_layer(x, lengths=lengths)
        B, S, _ = x.shape
        mask = lengths_mask(lengths, S).unsqueeze(-1)
        h = zeros = forward.new_zeros(B, forward.shape[-1])
        xs, fs, out = x.unbind(1), forward.unbind(1), [None] * S
        for t in range(S - 1, -1, -1):
            new = self.higher(fs[t], self.lower(xs[t], h))
            h = torch.where(mask[:, t], new, h)
            out[t] = torch.where(mask[:, t], new, zeros)
        return torch.stack(out, 1), None


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
        x = s[0]                               # the input of the layer above
        for l in range(1, len(self.decoder)):
            out = self.decoder[l](torch.cat([x, c], -1), prev[:, l])
            s.append(out)                      # a layer's own state is its output ...
            x = out + x if l >= 2 else out     # ... the residual sum only feeds the next layer (and the readout)
        return (x, c), step_state(state, alpha, keep_attention, s=torch.stack(s, 1))
