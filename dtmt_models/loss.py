"""Label-smoothed cross entropy with padding ignored."""
from __future__ import annotations

from typing import Tuple

from torch import Tensor


def label_smoothed_nll(log_probs: Tensor, target: Tensor, smoothing: float = 0.0,
                       pad_id: int = 0) -> Tuple[Tensor, Tensor, int]:
    """log_probs [B, T, V], target [B, T] -> (smoothed loss summed over real tokens, plain NLL summed,
    number of real tokens). Smoothing spreads `smoothing` uniformly over the vocabulary:
    loss = (1 - ε) · (−log p_y) + ε · mean_v(−log p_v)."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    keep = target.ne(pad_id)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(-1)
    loss = ((1.0 - smoothing) * nll + smoothing * smooth).masked_fill(~keep, 0.0).sum()
    return loss, nll.masked_fill(~keep, 0.0).sum(), int(keep.sum())
