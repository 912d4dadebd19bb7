"""The epilogue of the transition op's backward in Python (the Triton launchers' backward and the `unrolled` steps'
sink): the weight and bias gradients of one direction from its pre-activation gradients. C++'s twin, shared by the
CPU and CUDA kernels, is transition_weight_grads in csrc/transition.h."""
from __future__ import annotations

from typing import List, Optional, Sequence

from torch import Tensor

from .layout import acc_dtype


def weight_grads(x: Tensor, states: Tensor, dxp: Tensor, dhp: Tensor, dhpt: Tensor,
                 needs: Sequence[bool] = (True,) * 6) -> List[Optional[Tensor]]:
    """x [N, I] (the inputs) and states [D+1, N, H] (the state entering each sub-cell), both in the GEMMs' dtype,
    dxp [N, n_in*H], dhp [N, n_h*H], dhpt [D, N, 3H] (pre-activation gradients of N = T*B rows) ->
    [dw_ih = dxp^T x, db_ih = dxp's column sums, dw_hh = dhp^T states[0], db_hh, dt_w [D, 3H, H], dt_b [D, 3H]],
    None where `needs` says no; the column sums accumulate in float32 (float64 for float64)."""
    acc, dt = acc_dtype(dxp.dtype), dxp.dtype
    out: List[Optional[Tensor]] = [None] * 6
    if needs[0]:
        out[0] = dxp.t().mm(x)
    if needs[1]:
        out[1] = dxp.sum(0, dtype=acc).to(dt)
    if needs[2]:
        out[2] = dhp.t().mm(states[0])
    if needs[3]:
        out[3] = dhp.sum(0, dtype=acc).to(dt)
    if needs[4]:
        out[4] = dhpt.transpose(1, 2).bmm(states[1:])
    if needs[5]:
        out[5] = dhpt.sum(1, dtype=acc).to(dt)
    return out
