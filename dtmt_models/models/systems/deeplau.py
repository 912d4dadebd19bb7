"""`deeplau`: DEEPLAU of paper 001 (Wang et al. 2017), built on LAU layers (contract §2 LAU cell).

Encoder: `encoder_layers` stacked LAU layers whose directions alternate, d = (-1)^ℓ (eq. 9): layer 1 reads
left→right, layer 2 reads the layer-1 outputs right→left, and so on; the annotations are the top layer.
Attention (eq. 10-11): e_{t,j} = v_aᵀ tanh(W_a s¹_{t-1} + U_a h_j + W_y y_{t-1}), i.e. additive attention
queried by [s¹_{t-1}; y_{t-1}] — the first decoder layer's previous state and the previous target word.
Decoder: `decoder_layers` stacked left→right LAUs; layer 1 reads [c_t; y_{t-1}], layer ℓ > 1 reads the
output of layer ℓ-1. Output (eq. 12): softmax(W_o s^{L_dec}_t), dropout (paper: 0.5) on that layer only.
Where the paper is silent: every decoder layer starts from tanh(W_ℓ · mean annotation); no residual
connections; the LAU is contract §2's (GRU-style reset inside the candidate), layer norm optional (off).
`cell` swaps the unit ("gru" gives the paper's DEEPGRU baseline; also "lgru", "atr").
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
from dtmt_models.models.rnmt import recurrent_cell, recurrent_layer, start_state
from dtmt_models.models.seq2seq import Projection, Seq2Seq, State


@register_model("deeplau")
class DeepLAU(Seq2Seq):
    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256,
                 encoder_layers: int = 4, decoder_layers: int = 4, cell: str = "lau", layer_norm: bool = False,
                 dropout: float = 0.5, pad_id: int = 0, backend: str = "auto"):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        if encoder_layers < 1 or decoder_layers < 1:
            raise ValueError(f"deeplau: needs at least one encoder and one decoder layer, got {encoder_layers}, "
                             f"{decoder_layers}")
        E, H = embed_dim, hidden_size
        opts = dict(layer_norm=layer_norm, backend=backend)
        self.src_embed = TokenEmbedding(src_vocab_size, E, pad_id)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, E, pad_id)
        self.encoder = nn.ModuleList(recurrent_layer(cell, E if l == 0 else H, H, batch_first=True,
                                                     reverse=bool(l % 2), **opts)
                                     for l in range(encoder_layers))
        self.init_state = dk.nn.Linear(H, decoder_layers * H)
        self.attention = AdditiveAttention(H + E, H, H, backend=backend)
        self.decoder = nn.ModuleList(recurrent_cell(cell, H + E if l == 0 else H, H, **opts)
                                     for l in range(decoder_layers))
        self.readout = Projection(H, tgt_vocab_size, dropout)

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        h = self.src_embed(src)
        for layer in self.encoder:
            h = layer(h, lengths=src_lengths)[0]
        return start_state(self.attention, self.init_state, h, src_lengths, layers=len(self.decoder))

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        prev = state["s"]
        c, alpha = self.attention(torch.cat([prev[:, 0], y], -1), state["keys"], state["annotations"],
                                  state["src_mask"])
        x = torch.cat([c, y], -1)
        states = []
        for l, cell in enumerate(self.decoder):
            x = cell(x, prev[:, l])
            states.append(x)
        return (x,), step_state(state, alpha, keep_attention, s=torch.stack(states, 1))

    def features(self, y: Tensor, top: Tensor) -> Tensor:
        """The top decoder layer's output goes straight to the output projection."""
        return top
