"""torch.ops.dtmt.small_rows_linear(x [M, K], weight [N, K], bias [N] or None) -> x weight^T + bias [M, N]: the
weight-streaming kernel for at most _C.SMALL_ROWS_MAX float32 rows (decoding at batch 1), ATen's GEMM otherwise.
Inference only: it has no autograd (the layers call it only when nothing needs a gradient). `float64_products`:
the tables decoding reads in place of products with fixed rows (embeddings, positions)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._extension import _C, built
from .quantize import ROW_TAIL
from .. import _autocast
from .._register import check_fake_dtypes, check_fake_sizes, register_fake, transformed


def _fake(x, weight, bias):   # (the kernel's checks: a K or bias of other sizes gave a result without a word)
    check_fake_sizes("small_rows_linear", x=(x, [None, None]), weight=(weight, [None, None]))
    N, K = weight.shape[0], weight.shape[1] - (ROW_TAIL if weight.dtype == torch.int8 else 0)
    check_fake_sizes("small_rows_linear", x=(x, [None, K]))
    if bias is not None and bias.numel():
        check_fake_sizes("small_rows_linear", bias=(bias, [N]))
    int8 = weight.dtype == torch.int8
    floats = (torch.float32,) if int8 else (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    check_fake_dtypes("small_rows_linear", floats, x=x, **({} if int8 else {"weight": weight}),
                      **({"bias": bias} if bias is not None and bias.numel() else {}))
    return x.new_empty(x.shape[0], N)


def float64_products(rows: Tensor, matrices) -> Tensor:
    """rows [n, K] times the matrices [N_i, K] stacked, transposed: [n, sum N_i], each product summed in float64 and
    rounded once to the rows' dtype (1,024 rows at a time: no float64 copy of the whole table). The tables of
    products with fixed rows that decoding reads instead of multiplying (the inference engine's token_products,
    FrozenTransitionLayer.input_products)."""
    w = torch.cat(list(matrices)).detach().double().t()
    table = rows.new_empty(rows.shape[0], w.shape[1])
    with torch.no_grad():
        for i in range(0, rows.shape[0], 1024):
            table[i:i + 1024] = rows[i:i + 1024].detach().double() @ w
    return table


def small_rows_applicable(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether `small_rows_linear` runs the weight-streaming kernel for F.linear(x, weight, bias): the extension
    built, CPU float32 tensors, at most _C.SMALL_ROWS_MAX rows (leading dims flattened) and nothing that needs a
    gradient (the kernel has no backward: it is for decoding), nor a forward-mode tangent or a torch.func transform
    (F.linear then: the kernel passed a tangent through as a constant's, a silent zero)."""
    if _C is None or x.dim() == 0 or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (weight.shape[0],)):
        return False   # (a bias F.linear broadcasts, [1] or [M, 1], or refuses, [0]: F.linear's own; the kernel
        #                takes [N] or none)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 1 <= rows <= _C.SMALL_ROWS_MAX and x.shape[-1] == weight.shape[1] and transformed(x, weight, bias) is None


def small_rows_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """F.linear(x, weight, bias) by the small-row kernel; `small_rows_applicable` must hold. x [..., K] with at most
    SMALL_ROWS_MAX rows -> [..., N]."""
    K = x.shape[-1]
    out = torch.ops.dtmt.small_rows_linear(x.reshape(-1, K), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


if built():
    register_fake("dtmt::small_rows_linear", _fake)
    _autocast.register("dtmt::small_rows_linear", _autocast.float32_rule)
