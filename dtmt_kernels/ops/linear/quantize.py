"""Row-wise int8 weights and int8 products: the reference (the executable spec) of int8 decoding (issue 25,
item 2).

A weight matrix W [N, K] (out x in) is stored as int8 rows with one float scale per output row:

    scale[n] = max_k |W[n, k]| / 127        (1 for an all-zero row)
    q[n, k]  = round_half_even(W[n, k] / scale[n]), in [-127, 127]
    W[n, k] ~ scale[n] * q[n, k]            (|error| <= scale[n] / 2)

`linear_int8_weights` is y = x Wᵀ + b with the weights read as scale * q and the activations kept in float
("weight-only" int8; benchmarks/bench_int8.py's simulation of rounded weights).

`linear_int8` is what the int8 decoder computes (torch.ops.dtmt.small_rows_linear with packed int8 rows): each row
of x is quantized the same way, with its own scale (`quantize_activations`, computed in float32), the products of
the int8 values summed exactly as integers, and the sum multiplied by both scales:

    y[m, n] = b[n] + (x_scale[m] * scale[n]) * sum_k xq[m, k] q[n, k]

so both sides of every multiply-add are int8 (the CPU's int8 dot-product instructions), with one rounding of each
activation (|error| <= x_scale[m] / 2) besides the weights'.

The C++ ops take an int8 weight as one tensor, `pack_int8_rows`: int8 [N, K + 4], row n = q[n, :] followed by the
four bytes of scale[n] (this machine's byte order), so that it travels wherever a float weight does (csrc/
small_gemm.h).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def quantize_rows(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """(q int8 [N, K], scale float32 [N]) for a floating-point weight [N, K]; see the module docstring."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_rows: a floating-point [N, K] weight, got {weight.dtype} {list(weight.shape)}")
    if not torch.isfinite(weight).all():   # (a weight made of others, a fold of two, can overflow: not a bad argument)
        raise FloatingPointError("quantize_rows: the weight has non-finite entries (NaN or infinite)")
    w = weight.detach().to(torch.float64)
    peak = w.abs().amax(dim=1)
    # the scale as stored (float32) is the one the weights are rounded with, so |error| <= scale / 2 holds for
    # what dequantize_rows computes
    scale = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak)).to(torch.float32)
    # a float64 weight's row beyond float32 had an infinite scale (its entries dequantized to NaN); one of only
    # subnormal entries a zero scale (w / 0): the least float32 scale above zero rounds it within scale / 2
    if not torch.isfinite(scale).all():
        row = int((~torch.isfinite(scale)).nonzero()[0])
        raise FloatingPointError(f"quantize_rows: row {row}'s largest entry ({float(peak[row]):.3g}) is beyond what a "
                                 f"float32 scale holds")
    scale = scale.clamp_min(torch.finfo(torch.float32).smallest_normal * 2.0 ** -23)
    q = torch.round(w / scale.to(torch.float64)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """scale[n] * q[n, k] as `dtype` [N, K]."""
    return (q.to(torch.float64) * scale.to(torch.float64)[:, None]).to(dtype)


def quantize_activations(x: Tensor) -> Tuple[Tensor, Tensor]:
    """(xq int8 [M, K], x_scale float32 [M]) for activations x [M, K]: per row, x_scale = max |x| / 127 (1 for an
    all-zero row) and xq = round_half_even(x / x_scale) in [-127, 127], in float32 arithmetic (as the kernel). A row
    with NaN or an infinity gets x_scale NaN (and xq 0), so its products are NaN, as the kernel's are: it had scale
    1 and xq 0, and finite products where the kernel gives NaN."""
    x32 = x.detach().to(torch.float32)
    peak = x32.abs().amax(dim=1)   # (NaN where the row has one)
    finite = peak.isfinite()
    x_scale = torch.where(finite & (peak > 0), peak / 127.0, torch.ones_like(peak))
    xq = torch.round(torch.where(finite[:, None], x32, 0.0) / x_scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return xq, torch.where(finite, x_scale, torch.full_like(x_scale, float("nan")))


def linear_int8(x: Tensor, q: Tensor, scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [M, K] -> float32 [M, N]: the int8 product of the module docstring, the integer sums exact (int64), the
    scaling in float64."""
    xq, x_scale = quantize_activations(x)
    dots = xq.to(torch.int64) @ q.to(torch.int64).T
    y = dots.to(torch.float64) * (x_scale.to(torch.float64)[:, None] * scale.to(torch.float64)[None, :])
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


def linear_int8_weights(x: Tensor, q: Tensor, scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [..., K] -> [..., N]: x (scale * q)ᵀ + bias, in x's dtype."""
    return torch.nn.functional.linear(x, dequantize_rows(q, scale, x.dtype), bias)


ROW_TAIL = 4   # the bytes of a packed row's float32 scale


def pack_int8_rows(weight: Tensor) -> Tensor:
    """A float weight [..., N, K] quantized row by row (`quantize_rows`) and packed for the C++ ops: int8
    [..., N, K + 4], each row its K values then its float32 scale's bytes. Leading dims (a T-GRU stack
    [D, 3H, H]) are rows like any other."""
    if weight.dim() < 2:
        raise ValueError(f"pack_int8_rows: a weight [..., N, K], got {list(weight.shape)}")
    K = weight.shape[-1]
    q, scale = quantize_rows(weight.reshape(-1, K))
    packed = torch.cat([q, scale.contiguous().view(torch.int8).view(-1, ROW_TAIL)], 1)
    return packed.view(*weight.shape[:-1], K + ROW_TAIL).contiguous()


def unpack_int8_rows(packed: Tensor) -> Tuple[Tensor, Tensor]:
    """(q int8 [..., N, K], scale float32 [..., N]) of a `pack_int8_rows` tensor."""
    if packed.dtype != torch.int8 or packed.dim() < 2 or packed.shape[-1] <= ROW_TAIL:
        raise ValueError(f"unpack_int8_rows: an int8 [..., N, K + {ROW_TAIL}] tensor, got {packed.dtype} "
                         f"{list(packed.shape)}")
    q = packed[..., :-ROW_TAIL]
    tail = packed[..., -ROW_TAIL:]
    scale = torch.empty(tail.shape, dtype=torch.int8).copy_(tail).view(torch.float32).squeeze(-1)  # aligned copy
    return q, scale


def is_int8_rows(weight: Optional[Tensor]) -> bool:
    """Whether `weight` is a packed int8 weight (pack_int8_rows)."""
    return weight is not None and weight.dtype == torch.int8
