"""The Triton launchers of the transition op: its forward / backward drivers, registered as the custom ops
`dtmt::transition_forward_triton` / `dtmt::transition_backward_triton` (same schemas, fakes and autograd as the
C++ `dtmt::transition_forward` / `_backward`: op.py), and the Triton kernels' launches (triton_kernels.py).

Algorithm (mirrors csrc/transition_cpu.cpp; see reference.py for the layouts):

forward, one direction, T steps (walked backwards when `reverse`):
    xp = x W_ih^T + b_ih                                one GEMM over T*B rows, before the loop
    per step t, per sub-cell k = 0..D (base cell, then D T-GRUs):
        hp_k = h_k U_k^T                                 one GEMM (torch.mm: cuBLAS on a GPU)
        step_forward_kernel                              one fused Triton launch: bias, per-gate LN,
                                                         gates, candidate, dropout, state update; the last
                                                         sub-cell also masks and writes out[t] and the state
                                                         of step t+1, straight into the saved-state buffer
backward, steps in the opposite order, per sub-cell k = D..0:
        step_backward_kernel                             recomputes gates / LN statistics from xp, hp and the
                                                         saved input state; writes d(xp), d(hp), the direct
                                                         gradient to the input state, and accumulates this
                                                         row's LN gain / offset gradients (row-owned: no atomics)
        G = d(hp_k) U_k                                  one GEMM; the next launch adds it to the direct part
    then weight gradients as GEMMs over all T*B rows, bias gradients as column sums and LN gradients as sums
    of the per-row accumulators: deterministic.

Precision: inputs may be float32, bfloat16 or float16 (float64 too: exact enough for tight tests). GEMMs run
in the input dtype (tensor cores on a GPU, float32 accumulation inside cuBLAS); every kernel computes in
float32 (float64 for float64 inputs), layer-norm statistics included, and the recurrent state is kept in
float32: the kernels write a float32 state for the next sub-cell / step plus, for 16-bit inputs, a copy in
the input dtype that feeds the next GEMM. There is no host synchronisation inside the time loop.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._register import check_one_device
from .._triton_mode import triton_interpreting
from .grads import weight_grads
from .layout import KIND_TGRU, ROWS, acc_dtype, check_sequence, present

_KERNELS = None


def _kernels():
    """The kernels module, (re)imported so that its `triton.jit` decorations match the current
    TRITON_INTERPRET setting (triton decides between compiling and interpreting at decoration time)."""
    global _KERNELS
    mode = triton_interpreting()
    if _KERNELS is None or _KERNELS[0] != mode:
        name = __package__ + ".triton_kernels"
        module = sys.modules.get(name)
        module = importlib.import_module(name) if module is None else importlib.reload(module)
        _KERNELS = (mode, module)
    return _KERNELS[1]


def _block(H: int) -> int:
    return max(16, 1 << (int(H) - 1).bit_length())


def _num_warps(block: int) -> int:
    # From BLOCK 4096 (H > 2048) the backward kernel spills registers: correct, possibly slower (the ptxas
    # register counts: docs/design/gpu.md, "Triton: warps and registers").
    return 1 if block <= 64 else 2 if block <= 256 else 4 if block <= 1024 else 8 if block <= 2048 else 16


def _on_device(x: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _triton_forward(x, h0, mask, drop, kind, reverse, eps, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w,
                    t_ln_b):
    """Returns out [T,B,H] (input dtype), h_n [B,H] (h0's dtype) and the tensors saved for backward:
    xp [T,B,n_in*H], hs [S,T,B,H] (accumulation dtype: the state entering each sub-cell at each step),
    hs_lp (hs in the GEMM dtype; hs itself for float32/float64), hp [T,B,n_h*H], hpt [D,T,B,3H]."""
    K = _kernels()
    T, B, I = x.shape
    n_in, n_h, n_g = ROWS[kind]
    H = w_hh.shape[0] // n_h
    D = t_w.shape[0] if present(t_w) else 0
    S = D + 1
    dtype, acc = x.dtype, acc_dtype(x.dtype)
    lp = acc != dtype
    dev = x.device
    xp = torch.addmm(b_ih, x.reshape(T * B, I), w_ih.t()).view(T, B, n_in * H)
    hs = torch.empty(S, T, B, H, dtype=acc, device=dev)
    hs_lp = torch.empty(S, T, B, H, dtype=dtype, device=dev) if lp else hs
    hp = torch.empty(T, B, n_h * H, dtype=dtype, device=dev)
    hpt = torch.empty(D, T, B, 3 * H, dtype=dtype, device=dev)
    out = torch.empty(T, B, H, dtype=dtype, device=dev)
    h_last = torch.empty(B, H, dtype=acc, device=dev)
    lp_scratch = torch.empty(B, H, dtype=dtype, device=dev) if lp else h_last
    order = list(range(T - 1, -1, -1)) if reverse else list(range(T))
    if T == 0:   # (no step: h_n is h0)
        h_last.copy_(h0)
    else:
        hs[0, order[0]].copy_(h0)
        if lp:
            hs_lp[0, order[0]].copy_(h0)

    ln, tln = present(ln_w), present(t_ln_w)
    has_mask, has_drop = present(mask), present(drop)
    dummy = x
    BLOCK = _block(H)
    warps = _num_warps(BLOCK)
    w_hh_t = w_hh.t()
    t_w_t = [t_w[k].t() for k in range(D)]
    fwd = K.step_forward_kernel
    for step, t in enumerate(order):
        t_next = order[step + 1] if step + 1 < T else None
        for k in range(S):
            if k == 0:
                torch.mm(hs_lp[0, t], w_hh_t, out=hp[t])
                kk, hp_buf, hp_slab, bias = kind, hp, t, b_hh
                lnw, lnb = (ln_w, ln_b) if ln else (dummy, dummy)
                k_ln = ln
            else:
                torch.mm(hs_lp[k, t], t_w_t[k - 1], out=hpt[k - 1, t])
                kk, hp_buf, hp_slab, bias = KIND_TGRU, hpt, (k - 1) * T + t, t_b[k - 1]
                lnw, lnb = (t_ln_w[k - 1], t_ln_b[k - 1]) if tln else (dummy, dummy)
                k_ln = tln
            last = k == D
            if not last:      # the next sub-cell's input state
                hout, hlp, out_slab, write_lp = hs, hs_lp, (k + 1) * T + t, lp
            elif t_next is not None:  # the next step's block input state
                hout, hlp, out_slab, write_lp = hs, hs_lp, t_next, lp
            else:             # the final state (its low-precision copy goes to a scratch row: one variant)
                hout, hlp, out_slab, write_lp = h_last, lp_scratch, 0, lp
            kin, khh, kg = ROWS[kk]
            fwd[(B,)](
                xp, hp_buf, bias, hs, lnw, lnb, drop if has_drop else dummy, mask if has_mask else dummy, hs,
                hout, hlp, out, t, hp_slab, k * T + t, out_slab, k, B, H, eps,
                KIND=kk, NIN=max(kin, 1), NH=khh, NG=kg, LN=k_ln, HAS_DROP=has_drop and kk != 3, LAST=last,
                HAS_MASK=has_mask, WRITE_LP=write_lp, BLOCK=BLOCK, num_warps=warps)
    return out, h_last.to(h0.dtype), xp, hs, hs_lp if lp else hs.new_empty(0), hp, hpt


def _triton_backward(grad_out, grad_hn, x, mask, drop, kind, reverse, eps, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w,
                     t_b, t_ln_w, t_ln_b, xp, hs, hs_lp, hp, hpt, needs):
    if not present(hs_lp):   # float32 / float64: the states feed the GEMMs as they are
        hs_lp = hs
    K = _kernels()
    T, B, I = x.shape
    n_in, n_h, n_g = ROWS[kind]
    H = w_hh.shape[0] // n_h
    D = t_w.shape[0] if present(t_w) else 0
    dtype, acc = x.dtype, hs.dtype
    dev = x.device
    ln, tln = present(ln_w), present(t_ln_w)
    has_mask, has_drop = present(mask), present(drop)
    dummy = x
    BLOCK = _block(H)
    warps = _num_warps(BLOCK)

    dxp = torch.empty_like(xp)
    dhp = torch.empty_like(hp)
    dhpt = torch.empty_like(hpt)
    dln_rows = torch.zeros(B, n_g * H, dtype=acc, device=dev) if ln else None
    dlnb_rows = torch.zeros(B, n_g * H, dtype=acc, device=dev) if ln else None
    dtln_rows = torch.zeros(D, B, 2 * H, dtype=acc, device=dev) if tln else None
    dtlnb_rows = torch.zeros(D, B, 2 * H, dtype=acc, device=dev) if tln else None
    go = grad_out.contiguous()
    carry = [grad_hn.to(dtype=acc, copy=True).contiguous(),    # direct part, ping-pong (never the caller's)
             torch.empty(B, H, dtype=acc, device=dev)]
    carry_g = torch.empty(B, H, dtype=dtype, device=dev)                               # U-path part
    inner = [torch.empty(B, H, dtype=acc, device=dev), torch.empty(B, H, dtype=acc, device=dev)]
    inner_g = torch.empty(B, H, dtype=dtype, device=dev)
    c, has_cg = 0, False
    bwd = K.step_backward_kernel
    order = list(range(T - 1, -1, -1)) if reverse else list(range(T))
    for t in reversed(order):
        i = 0
        for k in range(D, -1, -1):
            top, base = k == D, k == 0
            if base:
                kk, hp_buf, hp_slab, dhp_buf, bias = kind, hp, t, dhp, b_hh
                lnw, lnb = (ln_w, ln_b) if ln else (dummy, dummy)
                dlw, dlb, k_ln = (dln_rows, dlnb_rows, True) if ln else (dummy, dummy, False)
                dst = carry[1 - c]
            else:
                kk, hp_buf, hp_slab, dhp_buf, bias = KIND_TGRU, hpt, (k - 1) * T + t, dhpt, t_b[k - 1]
                lnw, lnb = (t_ln_w[k - 1], t_ln_b[k - 1]) if tln else (dummy, dummy)
                dlw, dlb, k_ln = (dtln_rows, dtlnb_rows, True) if tln else (dummy, dummy, False)
                dst = inner[1 - i]
            kin, khh, kg = ROWS[kk]
            bwd[(B,)](
                xp, hp_buf, bias, hs, lnw, lnb, drop if has_drop else dummy, inner[i], inner_g, carry[c], carry_g,
                go, mask if has_mask else dummy, dxp, dhp_buf, dst, dlw, dlb,
                t, hp_slab, k * T + t, k, max(k - 1, 0), B, H, eps,
                KIND=kk, NIN=max(kin, 1), NH=khh, NG=kg, LN=k_ln, HAS_DROP=has_drop and kk != 3, TOP=top,
                BASE=base, HAS_MASK=has_mask, HAS_CG=has_cg, BLOCK=BLOCK, num_warps=warps)
            if base:
                torch.mm(dhp[t], w_hh, out=carry_g)
                c, has_cg = 1 - c, True
            else:
                torch.mm(dhpt[k - 1, t], t_w[k - 1], out=inner_g)
                i = 1 - i
    carried = carry[c] + carry_g.to(acc) if has_cg else carry[c]   # (carry_g holds a product after a step only)
    dh0 = carried.to(grad_hn.dtype) if needs[1] else None

    N = T * B
    dxp2 = dxp.view(N, n_in * H)
    dx = dxp2.mm(w_ih).view(T, B, I) if needs[0] else None
    dw_ih, db_ih, dw_hh, db_hh, dt_w, dt_b = weight_grads(
        x.reshape(N, I), hs_lp.view(D + 1, N, H), dxp2, dhp.view(N, n_h * H), dhpt.view(D, N, 3 * H),
        (needs[2], needs[3], needs[4], needs[5], bool(D) and needs[8], bool(D) and needs[9]))
    dln_w = dln_rows.sum(0).to(dtype) if ln and needs[6] else None
    dln_b = dlnb_rows.sum(0).to(dtype) if ln and needs[7] else None
    dt_ln_w = dtln_rows.sum(1).to(dtype) if tln and needs[10] else None
    dt_ln_b = dtlnb_rows.sum(1).to(dtype) if tln and needs[11] else None
    return dx, dh0, dw_ih, db_ih, dw_hh, db_hh, dln_w, dln_b, dt_w, dt_b, dt_ln_w, dt_ln_b


@torch.library.custom_op("dtmt::transition_forward_triton", mutates_args=())
def transition_forward_triton(x: Tensor, h0: Tensor, mask: Optional[Tensor], drop: Optional[Tensor], kind: int,
                              w_ih: Tensor, b_ih: Tensor, w_hh: Tensor, b_hh: Tensor, ln_w: Optional[Tensor],
                              ln_b: Optional[Tensor], t_w: Optional[Tensor], t_b: Optional[Tensor],
                              t_ln_w: Optional[Tensor], t_ln_b: Optional[Tensor], reverse: bool, eps: float
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dtmt::transition_forward by the Triton kernels (CUDA tensors; CPU ones under TRITON_INTERPRET=1)."""
    # (as the op's fake and the C++ op: a mask on another device had reached the launch, refused there in Triton's
    # words, or under the interpreter a copy's)
    check_one_device("transition_forward_triton", (x, h0, mask, drop, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b,
                                                   t_ln_w, t_ln_b))
    params = [None if t is None else t.contiguous() for t in (w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w,
                                                               t_ln_b)]
    x, h0 = x.contiguous(), h0.contiguous()
    mask, drop = (None if t is None else t.contiguous() for t in (mask, drop))
    check_sequence("transition_forward_triton", x, h0, mask, drop, kind, eps, *params)
    with _on_device(x):
        return _triton_forward(x, h0, mask, drop, kind, reverse, eps, *params)


@torch.library.custom_op("dtmt::transition_backward_triton", mutates_args=())
def transition_backward_triton(grad_out: Tensor, grad_hn: Tensor, x: Tensor, mask: Optional[Tensor],
                               drop: Optional[Tensor], kind: int, w_ih: Tensor, b_ih: Tensor, w_hh: Tensor,
                               b_hh: Tensor, ln_w: Optional[Tensor], ln_b: Optional[Tensor], t_w: Optional[Tensor],
                               t_b: Optional[Tensor], t_ln_w: Optional[Tensor], t_ln_b: Optional[Tensor], xp: Tensor,
                               hs: Tensor, hs_lp: Tensor, hp: Tensor, hpt: Tensor, reverse: bool, eps: float,
                               weight_grads: bool = True) -> List[Tensor]:
    """dtmt::transition_backward by the Triton kernels: the twelve gradients, those of absent inputs empty."""
    if not weight_grads:
        raise NotImplementedError("dtmt::transition_backward_triton: weight_grads=False is implemented on the CPU "
                                  "only")
    check_one_device("transition_backward_triton", (grad_out, grad_hn, x, mask, drop, w_ih, b_ih, w_hh, b_hh, ln_w,
                                                    ln_b, t_w, t_b, t_ln_w, t_ln_b, xp, hs, hs_lp, hp, hpt))
    # the kernels index every tensor as a contiguous one, as the forward op's (autograd hands this op the forward's
    # inputs as the caller gave them: a transposed mask or dropout mask gave wrong gradients without a word)
    params = [None if t is None else t.contiguous() for t in (w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w,
                                                               t_ln_b)]
    grad_hn, x, xp, hs, hs_lp, hp, hpt = (t.contiguous() for t in (grad_hn, x, xp, hs, hs_lp, hp, hpt))
    mask, drop = (None if t is None else t.contiguous() for t in (mask, drop))
    op = "transition_backward_triton"
    T, B, _, H, D = check_sequence(op, x, grad_hn, mask, drop, kind, eps, *params, h_name="grad_hn")
    n_in, n_h, _ = ROWS[kind]
    acc = acc_dtype(x.dtype)
    for name, t, shape, dtype in (("grad_out", grad_out, [T, B, H], x.dtype), ("xp", xp, [T, B, n_in * H], x.dtype),
                                  ("hs", hs, [D + 1, T, B, H], acc), ("hs_lp", hs_lp, [D + 1, T, B, H], x.dtype),
                                  ("hp", hp, [T, B, n_h * H], x.dtype), ("hpt", hpt, [D, T, B, 3 * H], x.dtype)):
        if name == "hs_lp" and not present(t) and acc == x.dtype:
            continue   # (the states' copy in the input dtype: 16-bit inputs only)
        if list(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"dtmt::{op}: {name} must be {shape} of {dtype} (the forward's), got "
                               f"{list(t.shape)} of {t.dtype}")
    with _on_device(x):
        grads = _triton_backward(grad_out, grad_hn, x, mask, drop, kind, reverse, eps, *params, xp, hs, hs_lp, hp,
                                 hpt, (True,) * 2 + tuple(present(p) for p in params))
    return [x.new_empty(0) if g is None else g for g in grads]
