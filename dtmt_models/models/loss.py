"""Label-smoothed cross entropy with padding ignored.

`label_smoothed_nll` takes log-probabilities (what a model returns); `smoothed_cross_entropy` takes the logits
and computes the same three numbers with log-softmax and loss fused, which is what training uses
(`model(src, src_lengths, prev_tokens, target=target, smoothing=ε)`).
"""
from __future__ import annotations

import numbers
from typing import Tuple

import torch
from torch import Tensor

import dtmt_kernels as dk


def float_log_softmax(logits: Tensor) -> Tensor:
    """log_softmax over the last dimension, in float32 for half / bfloat16 logits (their own dtype otherwise)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))


def _check_smoothing(smoothing: float) -> None:
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")


def _check_target(scores: Tensor, target: Tensor, scored: str) -> None:
    """ValueError unless `target` holds integer ids of the shape of `scores` without its last dimension ([B, T],
    prev_tokens' shape, in a model's loss): a target of another layout with as many ids (time-major [T, B]) was
    flattened and read against other positions' scores, a silently wrong loss."""
    if not isinstance(target, Tensor) or target.dtype != torch.long or target.shape != scores.shape[:-1]:
        raise ValueError(f"target must be a LongTensor {list(scores.shape[:-1])} (the {scored}' shape without the "
                         f"vocabulary: [B, T], as prev_tokens, in a model's loss), got "
                         f"{getattr(target, 'dtype', type(target).__name__)} {list(getattr(target, 'shape', []))}")


def _check_pad_id(pad_id: int) -> None:
    """ValueError unless `pad_id` is an integer id: 1.5 matched no target (every padding position was scored) and
    True was read as id 1."""
    if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
        raise ValueError(f"pad_id must be an integer token id, got {pad_id!r}")


def label_smoothed_nll(log_probs: Tensor, target: Tensor, smoothing: float = 0.0,
                       pad_id: int = 0) -> Tuple[Tensor, Tensor, int]:
    """log_probs [B, T, V], target [B, T] -> (smoothed loss summed over real tokens, plain NLL summed,
    number of real tokens). Smoothing spreads `smoothing` uniformly over the vocabulary:
    loss = (1 - ε) · (−log p_y) + ε · mean_v(−log p_v)."""
    _check_smoothing(smoothing)
    _check_target(log_probs, target, "log-probabilities")
    _check_pad_id(pad_id)
    keep = target.ne(pad_id)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(-1)
    loss = (nll if smoothing == 0 else (1.0 - smoothing) * nll + smoothing * smooth).masked_fill(~keep, 0.0).sum()
    return loss, nll.masked_fill(~keep, 0.0).sum(), int(keep.sum())


def smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0,
                           pad_id: int = 0) -> Tuple[Tensor, Tensor, int]:
    """logits [..., V], target [...] -> the three numbers of `label_smoothed_nll(log_softmax(logits), ...)`
    (smoothed loss sum, NLL sum, number of real tokens: an int, a 0-dim tensor where host reads are not allowed,
    dk.functional.host_reads_allowed: under torch.compile or a CUDA graph's capture), with log-softmax and loss fused (dtmt_kernels.functional.smoothed_cross_entropy: on
    the CPU one C++ pass over each row of logits, which forms the gradient too; it checks `smoothing`)."""
    _check_target(logits, target, "logits")
    _check_pad_id(pad_id)
    V = logits.shape[-1]
    loss, nll = dk.functional.smoothed_cross_entropy(logits.reshape(-1, V), target.reshape(-1), smoothing, pad_id)
    n = target.ne(pad_id).sum()
    return loss, nll, (int(n) if dk.functional.host_reads_allowed() else n)
