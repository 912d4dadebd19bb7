"""The attention ops' reference: the additive-attention scores and context of one decoder step in pure PyTorch, the
executable form of contract §4's multi-head additive attention (dtmt_kernels.reference gathers it with the transition
op's). Every backend's attention is tested against these."""
from __future__ import annotations

import torch
from torch import Tensor


def additive_scores(keys: Tensor, query: Tensor, v: Tensor) -> Tensor:
    """Additive-attention scores (Bahdanau; DTMT's multi-head form, contract §4), one decoder step:
    scores[b, h, s] = v[h] · tanh(keys[b, s, h] + query[b, h]).

    keys [B, S, NH, D] (the projected annotations, once per batch), query [B, NH, D] (the projected decoder
    state), v [NH, D] -> scores [B, NH, S]. A single-head attention is NH = 1."""
    return (torch.tanh(keys + query.unsqueeze(1)) * v).sum(-1).transpose(1, 2)


def attention_context(alpha: Tensor, values: Tensor) -> Tensor:
    """The attention context of one decoder step: head h weights its own C/NH columns of the values,
    context[b, h·Dc + d] = Σ_s alpha[b, h, s] · values[b, s, h·Dc + d] (Dc = C / NH).

    alpha [B, NH, S], values [B, S, C] (the annotations) -> [B, C]. A single head (NH = 1) reads all of C.
    Computed as one batched GEMM of every head's alpha against all of C, keeping the diagonal blocks (no
    copy of the values into heads; NH times the multiply-adds)."""
    B, NH, _ = alpha.shape
    C = values.shape[-1]
    if NH == 1:
        return torch.bmm(alpha, values).squeeze(1)
    every = torch.bmm(alpha, values).view(B, NH, NH, C // NH)  # [B, heads (alpha), heads (columns), Dc]
    return every.diagonal(dim1=1, dim2=2).transpose(1, 2).reshape(B, C)
