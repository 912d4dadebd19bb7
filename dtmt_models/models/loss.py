"""Label-smoothed cross entropy with padding ignored.

`label_smoothed_nll` takes log-probabilities (what a model returns); `smoothed_cross_entropy` takes the logits
and computes the same three numbers with log-softmax and loss fused, which is what training uses
(`model(src, src_lengths, prev_tokens, target=target, smoothing=ε)`).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def float_log_softmax(logits: Tensor) -> Tensor:
    """log_softmax over the last dimension, in float32 for half / bfloat16 logits (their own dtype otherwise)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))


def _check_smoothing(smoothing: float) -> None:
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")


def label_smoothed_nll(log_probs: Tensor, target: Tensor, smoothing: float = 0.0,
                       pad_id: int = 0) -> Tuple[Tensor, Tensor, int]:
    """log_probs [B, T, V], target [B, T] -> (smoothed loss summed over real tokens, plain NLL summed,
    number of real tokens). Smoothing spreads `smoothing` uniformly over the vocabulary:
    loss = (1 - ε) · (−log p_y) + ε · mean_v(−log p_v)."""
    _check_smoothing(smoothing)
    keep = target.ne(pad_id)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(-1)
    loss = ((1.0 - smoothing) * nll + smoothing * smooth).masked_fill(~keep, 0.0).sum()
    return loss, nll.masked_fill(~keep, 0.0).sum(), int(keep.sum())


class _SmoothedCrossEntropy(torch.autograd.Function):
    """(loss sum, NLL sum) of log_softmax(logits) against target, rows at padding left out.

    Forward keeps only the log-probabilities; backward writes the logits' gradient in one dense tensor:
    d loss / d z = w · (softmax(z) − (1 − ε) onehot(y) − ε / V), with w the incoming gradient on the real rows
    and 0 on padding (the NLL output is a statistic: no gradient flows through it)."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, keep: Tensor, smoothing: float):
        log_probs = float_log_softmax(logits)
        nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        smooth = -log_probs.mean(-1)
        loss = torch.where(keep, (1.0 - smoothing) * nll + smoothing * smooth, 0.0).sum()
        ctx.save_for_backward(log_probs, target, keep)
        ctx.smoothing, ctx.logits_dtype = smoothing, logits.dtype
        ctx.mark_non_differentiable(nll)
        return loss, torch.where(keep, nll, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        log_probs, target, keep = ctx.saved_tensors
        eps = ctx.smoothing
        grad = log_probs.exp()                                      # softmax, one pass
        grad.sub_(eps / log_probs.shape[-1])
        grad.scatter_add_(-1, target.unsqueeze(-1),
                          torch.full_like(target, -(1.0 - eps), dtype=grad.dtype).unsqueeze(-1))
        grad.mul_((keep.to(grad.dtype) * grad_loss).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0,
                           pad_id: int = 0) -> Tuple[Tensor, Tensor, int]:
    """logits [..., V], target [...] -> the three numbers of `label_smoothed_nll(log_softmax(logits), ...)`
    (smoothed loss sum, NLL sum, number of real tokens: an int, a 0-dim tensor under torch.compile, where an int
    would end the graph), with log-softmax and loss fused into one autograd node (about half the passes over the
    [tokens, V] tensor of the two apart)."""
    _check_smoothing(smoothing)
    keep = target.ne(pad_id)
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, keep, float(smoothing))
    n = keep.sum()
    return loss, nll, (n if torch.compiler.is_compiling() else int(n))
