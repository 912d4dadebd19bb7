"""The row-panel layout of a weight, for products with one row (csrc/small_gemm.h, CpuKernels::row_panels).

An encoder at batch 1 multiplies one state row by its recurrent matrices at every position. Row-major, each output
is a dot product: the loop loads a chunk of x beside every chunk of weights and sums each output across vector
lanes at the end. In panels of PANEL_WIDTH output columns laid out k by k, a panel is one sequential stream whose
rows are multiplied by the broadcast x[k] into one accumulator per column: one load a multiply-add and no sums
across lanes (why: docs/design/cpu_kernels.md, "Row panels"). `row_panels` makes the layout once (per decoder);
the products are summed in another order than F.linear's, so they agree up to rounding."""
from __future__ import annotations

from torch import Tensor

from .._extension import _C

# csrc/cpu_kernels.h's kPanelWidth, as the extension was built with it (None without the extension: nothing reads
# panels then)
PANEL_WIDTH = _C.PANEL_WIDTH if _C is not None else None


def row_panels(weight: Tensor) -> Tensor:
    """W [N, K] -> panels [ceil(N / PANEL_WIDTH), K, PANEL_WIDTH] with panels[p, k, j] = W[p * PANEL_WIDTH + j, k]
    and zeros past N; a stack of matrices [..., N, K] -> [..., ceil(N / PANEL_WIDTH), K, PANEL_WIDTH]. The same
    values, contiguous, in the weight's dtype and device."""
    if PANEL_WIDTH is None:
        raise RuntimeError("row_panels: the layout is the C++ extension's, which is not built here")
    if weight.dim() < 2:
        raise ValueError(f"row_panels: a weight [N, K] (or a stack of them) expected, got {list(weight.shape)}")
    *lead, N, K = weight.shape
    P = -(-N // PANEL_WIDTH)
    padded = weight.new_zeros(*lead, P * PANEL_WIDTH, K)
    padded[..., :N, :] = weight.detach()
    return padded.view(*lead, P, PANEL_WIDTH, K).transpose(-1, -2).contiguous()
