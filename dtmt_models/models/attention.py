"""Attention over the source annotations.

- `AdditiveAttention` (Bahdanau; Nematus with `layer_norm=True`): e_j = vᵀ tanh(W_q s + W_k h_j + b),
  with layer norm on each projection when asked (Nematus applies it to both before the sum).
- `MultiHeadAdditiveAttention` (DTMT, contract §4): q = W_q s and k_j = W_k h_j are split into heads;
  e_{h,j} = v_hᵀ tanh(q_h + k_{h,j}); the values are the annotations split into heads; the per-head
  contexts are concatenated and projected.

Keys depend only on the source, so `precompute(annotations)` runs once per batch and its result is kept
in the decoder state; `forward(query, keys, annotations, src_mask)` is one decoder step.

The scores v·tanh(q + k_j) and the context Σ_j α_j h_j are `dtmt_kernels.functional.additive_scores` and
`attention_context`, run on the module's `backend` (switched with the model's recurrent layers by
`Seq2Seq.set_backend`): the C++ kernels for CPU tensors under "auto"/"cpp", PyTorch ops under "reference"
(and on the GPU). For decoding, `inference_module()` gives an `AttentionStep`: the whole step as one call,
`dtmt_models.engine.ops.attention_step` (the query's layer norm included), its weights gathered once.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
from torch import Tensor

import dtmt_kernels as dk
from dtmt_kernels.backends import BackendSwitch
from dtmt_models.engine import ops
from dtmt_models.engine.forms import AttentionStep, plain_linear, runs_fused_inference


def masked_softmax(scores: Tensor, src_mask: Tensor) -> Tensor:
    """softmax over the last dim, padded source positions (src_mask 0) get exactly zero weight."""
    return torch.softmax(scores.masked_fill(~src_mask, float("-inf")), dim=-1)


class AdditiveAttention(dk.nn.Unrollable, BackendSwitch, nn.Module):
    def __init__(self, query_dim: int, key_dim: int, attn_dim: int, layer_norm: bool = False,
                 backend: str = "auto"):
        super().__init__()
        self.backend = backend
        self.query = dk.nn.Linear(query_dim, attn_dim, bias=False)
        self.key = dk.nn.Linear(key_dim, attn_dim, bias=True)
        self.v = dk.nn.Linear(attn_dim, 1, bias=False)
        self.ln_q = nn.LayerNorm(attn_dim) if layer_norm else nn.Identity()
        self.ln_k = nn.LayerNorm(attn_dim) if layer_norm else nn.Identity()

    def precompute(self, annotations: Tensor) -> Tensor:
        return self.ln_k(self.key(annotations))  # [B, S, A]

    def inference_module(self) -> nn.Module:
        """This module's form for decoding: an AttentionStep where the fused op can take it (the cpp backend, a
        plain query projection, no query norm or an affine nn.LayerNorm over the attention width), else itself."""
        ln, query = self.ln_q, self.query
        if not (runs_fused_inference(self, query) and plain_linear(query) and plain_linear(self.v)):
            return self
        if type(ln) is nn.Identity:
            return AttentionStep(self, ops.AttentionWeights(query.weight, self.v.weight), single_head=True)
        if (type(ln) is nn.LayerNorm and tuple(ln.normalized_shape) == (query.out_features,)
                and ln.weight is not None and ln.bias is not None):
            return AttentionStep(self, ops.AttentionWeights(query.weight, self.v.weight, ln_w=ln.weight,
                                                            ln_b=ln.bias, ln_eps=ln.eps), single_head=True)
        return self

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"

    def forward(self, query: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor) -> Tuple[Tensor, Tensor]:
        """query [B, Q], keys [B, S, A], annotations [B, S, C], src_mask [B, S] bool ->
        (context [B, C], weights [B, S])."""
        q = self.ln_q(self.query(query)).unsqueeze(1)                           # [B, 1, A]: one head
        scores = dk.functional.additive_scores(keys.unsqueeze(2), q, self.v.weight, self.backend).squeeze(1)
        alpha = masked_softmax(scores, src_mask)
        return dk.nn.step_context(self, alpha.unsqueeze(1), annotations, self.backend), alpha


class MultiHeadAdditiveAttention(dk.nn.Unrollable, BackendSwitch, nn.Module):
    def __init__(self, query_dim: int, key_dim: int, attn_dim: int, heads: int = 4, backend: str = "auto"):
        super().__init__()
        self.backend = backend
        if attn_dim % heads or key_dim % heads:
            raise ValueError(f"MultiHeadAdditiveAttention: attn_dim={attn_dim} and key_dim={key_dim} must be "
                             f"divisible by heads={heads}")
        self.heads = heads
        self.query = dk.nn.Linear(query_dim, attn_dim, bias=False)
        self.key = dk.nn.Linear(key_dim, attn_dim, bias=True)
        self.v = nn.Parameter(torch.empty(heads, attn_dim // heads))
        nn.init.normal_(self.v, std=(attn_dim // heads) ** -0.5)
        self.out = dk.nn.Linear(key_dim, key_dim)

    def precompute(self, annotations: Tensor) -> Tensor:
        B, S, _ = annotations.shape
        return self.key(annotations).view(B, S, self.heads, -1)  # [B, S, heads, A/heads]

    def extra_repr(self) -> str:
        return f"heads={self.heads}, backend={self.backend!r}"

    def inference_module(self) -> nn.Module:
        """This module's form for decoding: an AttentionStep on the cpp backend with plain projections, else
        itself."""
        if not (runs_fused_inference(self, self.query, self.out) and plain_linear(self.query)
                and plain_linear(self.out)):
            return self
        return AttentionStep(self, ops.AttentionWeights(self.query.weight, self.v, self.out.weight, self.out.bias),
                             single_head=False)

    def forward(self, query: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor) -> Tuple[Tensor, Tensor]:
        """Returns (context [B, C], weights [B, heads, S])."""
        q = self.query(query).view(query.shape[0], self.heads, -1)
        scores = dk.functional.additive_scores(keys, q, self.v, self.backend)  # [B, heads, S]
        alpha = masked_softmax(scores, src_mask.unsqueeze(1))
        context = dk.nn.step_context(self, alpha, annotations, self.backend)  # head h: its own C/heads
        return self.out(context), alpha
