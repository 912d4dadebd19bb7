"""`transformer`: a torch.nn.Transformer baseline of comparable size, for side-by-side comparisons.

Embeddings scaled by sqrt(d) plus sinusoidal positions (unscaled, as in Vaswani et al.), pre-norm
torch.nn.TransformerEncoder/Decoder layers, output projection tied to the target embedding. Incremental decoding
keeps the target prefix in the state and re-runs the decoder on it (simple and exact; O(T²) per sentence).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..embeddings import sinusoidal_positions
from ..registry import register_model
from ..seq2seq import Projection, Seq2Seq, State, lengths_mask


@register_model("transformer")
class TransformerNMT(Seq2Seq):
    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 1024,
                 heads: int = 4, encoder_layers: int = 3, decoder_layers: int = 3, dropout: float = 0.1,
                 pad_id: int = 0, max_len: int = 1024):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        self.embed_dim = embed_dim
        self.src_embed = nn.Embedding(src_vocab_size, embed_dim, padding_idx=pad_id)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, embed_dim, padding_idx=pad_id)
        for e in (self.src_embed, self.tgt_embed):
            nn.init.normal_(e.weight, std=embed_dim ** -0.5)
            with torch.no_grad():
                e.weight[pad_id].zero_()
        self.register_buffer("pe", sinusoidal_positions(max_len, embed_dim), persistent=False)
        self.dropout = nn.Dropout(dropout)
        # torch.nn.Transformer's own parts, assembled here so the pre-norm encoder can turn nested tensors off
        enc_layer = nn.TransformerEncoderLayer(embed_dim, heads, hidden_size, dropout, batch_first=True,
                                               norm_first=True)
        dec_layer = nn.TransformerDecoderLayer(embed_dim, heads, hidden_size, dropout, batch_first=True,
                                               norm_first=True)
        self.transformer = nn.Module()
        self.transformer.encoder = nn.TransformerEncoder(enc_layer, encoder_layers, nn.LayerNorm(embed_dim),
                                                         enable_nested_tensor=False)
        self.transformer.decoder = nn.TransformerDecoder(dec_layer, decoder_layers, nn.LayerNorm(embed_dim))
        self.readout = Projection(embed_dim, tgt_vocab_size, 0.0, self.tgt_embed.weight)

    def _embed(self, emb: nn.Embedding, tokens: Tensor, offset: int = 0) -> Tensor:
        T = tokens.shape[1]
        if offset + T > self.pe.shape[0]:
            raise ValueError(f"transformer: sequence longer than max_len={self.pe.shape[0]}")
        return self.dropout(emb(tokens) * math.sqrt(self.embed_dim) + self.pe[offset:offset + T])

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        pad = ~lengths_mask(src_lengths, src.shape[1])
        memory = self.transformer.encoder(self._embed(self.src_embed, src), src_key_padding_mask=pad)
        return {"memory": memory, "src_pad": pad, "prefix": src.new_zeros(src.shape[0], 0)}

    def _decode(self, state: State, prefix: Tensor) -> Tensor:
        T = prefix.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=prefix.device), 1)
        return self.transformer.decoder(self._embed(self.tgt_embed, prefix), state["memory"], tgt_mask=causal,
                                        memory_key_padding_mask=state["src_pad"])

    def decoder_step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        prefix = torch.cat([state["prefix"], prev_tokens.unsqueeze(1)], 1)
        out = self._decode(state, prefix)[:, -1]
        return out, {**state, "prefix": prefix}

    def forward(self, src: Tensor, src_lengths: Tensor, prev_tokens: Tensor) -> Tensor:
        self.check_batch(src, src_lengths, prev_tokens)
        state = self.encode(src, src_lengths)
        return self.readout(self._decode(state, prev_tokens))
