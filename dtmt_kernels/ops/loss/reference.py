"""The label-smoothed cross-entropy in plain PyTorch: the executable spec of torch.ops.dtmt.smoothed_cross_entropy."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .._host_reads import host_reads_allowed


def smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0,
                           ignore_index: int = -100) -> Tuple[Tensor, Tensor]:
    """logits [N, V], target [N] -> (smoothed loss sum, NLL sum) over the rows whose target is not ignore_index,
    with log p = log_softmax(logits) (in float32 at least) and per row (paper 000's label smoothing ε):
        loss = (1 - ε) · (−log p_y) + ε · mean_v(−log p_v)."""
    log_p = torch.log_softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32))
    target = target.long()   # (ignore_index compared in int64: beyond an int32 target's range it wrapped)
    keep = target.ne(ignore_index)
    outside = keep & (target.lt(0) | target.ge(logits.shape[-1]))
    if host_reads_allowed() and bool(outside.any()):   # (the clamp below had scored it as the nearest id: the
        raise RuntimeError(f"smoothed_cross_entropy: target {int(target[outside][0])} is outside "   # C++ op and
                           f"[0, {logits.shape[-1]})")                                               # functional's)
    nll = -log_p.gather(-1, target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    # (without smoothing the NLL alone: a -inf logit, a masked token, makes the mean -inf, and 0 * inf was NaN)
    loss = nll if smoothing == 0 else (1.0 - smoothing) * nll + smoothing * -log_p.mean(-1)
    return torch.where(keep, loss, 0.0).sum(), torch.where(keep, nll, 0.0).sum()
