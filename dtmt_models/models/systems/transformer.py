"""`transformer`: a torch.nn.Transformer baseline of comparable size, for side-by-side comparisons.

Embeddings scaled by sqrt(d) plus sinusoidal positions (unscaled, as in Vaswani et al.), pre-norm
torch.nn.TransformerEncoder/Decoder layers, output projection tied to the target embedding. Teacher forcing runs
torch's decoder over the whole target; incremental decoding (beam search) runs the same layers one position at a
time with a key/value cache: per layer the self-attention keys and values of the positions so far, and the
cross-attention keys and values of the source, projected once at `encode`. So a step costs O(t), not a re-run of
the prefix, and the speed comparisons against the recurrent systems are fair. For the same reason its linear
layers run `dtmt_kernels.functional.linear` in a step, as the recurrent systems' do (dtmt_kernels.nn.Linear): at
batch 1 both use the package's small-row kernel.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from dtmt_kernels.functional import host_list, host_reads_allowed, linear
from dtmt_models.models.embeddings import sinusoidal_positions
from dtmt_models.models.registered import register_model
from dtmt_models.models.seq2seq import Projection, Seq2Seq, State, checked_batch, lengths_mask


@functools.lru_cache(maxsize=8)
def _pe_table(length: int, dim: int) -> Tensor:
    """The PE table [length, dim] in float64 on the CPU, made once a size (its copies are rounded from it)."""
    return sinusoidal_positions(length, dim, device="cpu", dtype=torch.float64)


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

    def _apply(self, fn, recurse=True):
        before = self.pe
        super()._apply(fn, recurse)
        # the PE table is a function of the sizes, not state: made again wherever a conversion puts it (a model
        # built on the meta device never computed it, and to_empty left it uninitialised: NaN outputs); a call that
        # left it in place (.to() of its own device and dtype) keeps it
        if self.pe is not before and self.pe.device.type != "meta":
            self.pe = self._fresh_pe(self.pe.device, self.pe.dtype)
        return self

    def _fresh_pe(self, device, dtype) -> Tensor:
        return _pe_table(self.pe.shape[0], self.embed_dim).to(device, dtype, copy=True)

    @property
    def max_target_steps(self) -> int:
        """The most target positions (BOS included) it has encodings for: beam search stops there."""
        return self.pe.shape[0]

    @property
    def max_source_steps(self) -> int:
        """The most source positions it has encodings for: translate cuts longer sources there, with its warning."""
        return self.pe.shape[0]

    def _embed(self, emb: nn.Embedding, tokens: Tensor, offset: int = 0) -> Tensor:
        T = tokens.shape[1]
        if self.pe.is_meta:   # (load_state_dict(assign=True) into a model built there: a buffer not saved stays)
            self.pe = self._fresh_pe(emb.weight.device, emb.weight.dtype)
        if offset + T > self.pe.shape[0]:
            raise ValueError(f"transformer: sequence longer than max_len={self.pe.shape[0]}")
        return self.dropout(emb(tokens) * math.sqrt(self.embed_dim) + self.pe[offset:offset + T])

    def _encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        if src.shape[1] > self.pe.shape[0] and host_reads_allowed():
            # padded past the positions, but no sentence is as long: the padding is cut (it is masked anyway); it
            # was refused as a sequence longer than max_len
            longest = max(host_list(src_lengths))
            if longest <= self.pe.shape[0]:
                src = src[:, :longest]
        pad = ~lengths_mask(src_lengths, src.shape[1])
        memory = self.transformer.encoder(self._embed(self.src_embed, src), src_key_padding_mask=pad)
        return {"memory": memory, "src_pad": pad, "prefix": src.new_zeros(src.shape[0], 0)}

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        """The encoder's state plus the empty key/value cache of incremental decoding."""
        state = self._encode(src, src_lengths)
        E = self.embed_dim
        for i, layer in enumerate(self.transformer.decoder.layers):
            att = layer.multihead_attn
            w, b = att.in_proj_weight, att.in_proj_bias
            state[f"mem_k{i}"] = self._heads(F.linear(state["memory"], w[E:2 * E], b[E:2 * E]), att.num_heads)
            state[f"mem_v{i}"] = self._heads(F.linear(state["memory"], w[2 * E:], b[2 * E:]), att.num_heads)
            empty = state[f"mem_k{i}"][:, :, :0]
            state[f"self_k{i}"], state[f"self_v{i}"] = empty, empty
        return state

    @staticmethod
    def _heads(x: Tensor, heads: int) -> Tensor:
        """[B, T, E] -> [B, heads, T, E/heads]."""
        B, T, E = x.shape
        return x.view(B, T, heads, E // heads).transpose(1, 2)

    @staticmethod
    def _merge(x: Tensor) -> Tensor:
        """[B, heads, T, d] -> [B, T, heads*d]."""
        B, h, T, d = x.shape
        return x.transpose(1, 2).reshape(B, T, h * d)

    def _decode(self, state: State, prefix: Tensor) -> Tensor:
        T = prefix.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=prefix.device), 1)
        # tgt_is_causal: the mask is causal by construction (else torch compares it with one on the host: on a GPU a
        # synchronisation, which a CUDA graph's capture refuses)
        return self.transformer.decoder(self._embed(self.tgt_embed, prefix), state["memory"], tgt_mask=causal,
                                        tgt_is_causal=True, memory_key_padding_mask=state["src_pad"])

    def decoder_step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        """One position through every pre-norm decoder layer, as torch.nn.TransformerDecoderLayer computes it
        (norm_first=True), with the keys and values of the earlier positions and of the source from the cache."""
        t = state["prefix"].shape[1]
        x = self._embed(self.tgt_embed, prev_tokens.unsqueeze(1), offset=t)  # [B, 1, E]
        new = {**state, "prefix": torch.cat([state["prefix"], prev_tokens.unsqueeze(1)], 1)}
        src_visible = ~state["src_pad"][:, None, None, :]                    # [B, 1, 1, S]
        E = self.embed_dim
        for i, layer in enumerate(self.transformer.decoder.layers):
            sa, ca = layer.self_attn, layer.multihead_attn
            q, k, v = (self._heads(z, sa.num_heads)
                       for z in linear(layer.norm1(x), sa.in_proj_weight, sa.in_proj_bias).chunk(3, -1))
            k = new[f"self_k{i}"] = torch.cat([state[f"self_k{i}"], k], 2)
            v = new[f"self_v{i}"] = torch.cat([state[f"self_v{i}"], v], 2)
            p = sa.dropout if self.training else 0.0
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=p)            # every earlier position visible
            x = x + layer.dropout1(linear(self._merge(a), sa.out_proj.weight, sa.out_proj.bias))
            q = self._heads(linear(layer.norm2(x), ca.in_proj_weight[:E], ca.in_proj_bias[:E]), ca.num_heads)
            p = ca.dropout if self.training else 0.0
            a = F.scaled_dot_product_attention(q, state[f"mem_k{i}"], state[f"mem_v{i}"], attn_mask=src_visible,
                                               dropout_p=p)
            x = x + layer.dropout2(linear(self._merge(a), ca.out_proj.weight, ca.out_proj.bias))
            h = layer.activation(linear(layer.norm3(x), layer.linear1.weight, layer.linear1.bias))
            x = x + layer.dropout3(linear(layer.dropout(h), layer.linear2.weight, layer.linear2.bias))
        return self.transformer.decoder.norm(x)[:, 0], new

    def forward(self, src: Tensor, src_lengths: Tensor, prev_tokens: Tensor, target: Optional[Tensor] = None,
                smoothing: float = 0.0):
        with checked_batch(self, src, src_lengths, prev_tokens):   # (_encode's check: done)
            state = self._encode(src, src_lengths)
        return self.output(self._decode(state, prev_tokens), target, smoothing)
