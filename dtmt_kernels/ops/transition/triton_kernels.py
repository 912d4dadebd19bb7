"""Triton kernels of the deep transition block and ATR: one fused row pass per sub-cell and step.

Imported lazily by `ops.py` (never by `import dtmt_kernels`), and re-imported by `ops._kernels()` when
TRITON_INTERPRET changes, because `triton.jit` decides between compiling and interpreting when a kernel is
decorated, i.e. when this module is executed.

Each kernel is launched with one program per batch row; the program owns all H features of that row
(BLOCK = next_power_of_2(H), lanes >= H masked), so the layer-norm statistics are a register reduction.
Pointer arguments are whole buffers (always aligned) plus slab indices (which [B, ...] block of rows: step,
sub-cell) from which the kernel computes int64 row offsets; the indices are not specialised on, so one
compiled variant serves every step, and the host-side launch creates no tensor views.

Numerics: every value is loaded and converted to the accumulation type, which is the element type of the
state buffers (HIN): float32 for float32 / bfloat16 / float16 inputs, float64 for float64 inputs.
Gate rows, candidate and linear-path layouts are those of reference.py / csrc/cell_math.h:

    kind   xp rows (W x + b_ih)   hp rows (U h, bias added here)   normalised gates
    0 gru  r z c                  r z c                            r z
    1 lgru r z l c lin            r z l c                          r z l
    2 lau  r z g c lin            r z g c                          r z g
    3 atr  p                      q                                p q (separately)
    4 tgru -                      r z c                            r z
"""
from __future__ import annotations

import triton
import triton.language as tl

KIND_GRU, KIND_LGRU, KIND_LAU, KIND_ATR, KIND_TGRU = 0, 1, 2, 3, 4


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# Device helpers are @triton.jit functions when compiling. Under the interpreter they are plain Python
# functions (a jit call there re-patches triton.language on every call), called by the interpreted kernels with
# the same arguments and the same semantics (their constexpr flags are plain Python values either way).
_device_fn = (lambda fn: fn) if _interpreting() else triton.jit

# Row sums go through tl.reduce with a combine function of this module rather than tl.sum: tl.sum and its
# combine function are @jit functions of triton itself, decorated once for the whole process when triton is
# first imported (compiled or interpreted, whichever TRITON_INTERPRET said then), while this module follows
# the current setting. Under the interpreter the combine function is triton's own _sum_combine, which the
# interpreter recognises and reduces with numpy.
if _interpreting():
    @triton.jit
    def _add_combine_interpreted(a, b):
        return a + b

    _SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or _add_combine_interpreted

    def _row_sum(x):
        return tl.reduce(x, 0, _SUM_COMBINE)
else:
    @triton.jit
    def _add_combine(a, b):
        return a + b

    @triton.jit
    def _row_sum(x):
        return tl.reduce(x, 0, _add_combine)


@_device_fn
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@_device_fn
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1: one exp, saturates to -1 / 1 without overflow trouble.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@_device_fn
def _ln_normalise(a, m, H, eps):
    """(a - mean) / sqrt(var + eps) over the H valid lanes (biased variance, as F.layer_norm); masked
    lanes come back 0. Returns (n, rstd)."""
    mean = _row_sum(tl.where(m, a, 0.0)) / H
    d = tl.where(m, a - mean, 0.0)
    var = _row_sum(d * d) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    return d * rstd, rstd


@_device_fn
def _ln_backward(dn, n, rstd, m, H):
    """d(loss)/d(a) from d(loss)/d(n): rstd * (dn - mean(dn) - n * mean(dn * n))."""
    dn = tl.where(m, dn, 0.0)
    s1 = _row_sum(dn) / H
    s2 = _row_sum(dn * n) / H
    return tl.where(m, rstd * (dn - s1 - n * s2), 0.0)


@_device_fn
def _load(ptr, offs, m, acc_like):
    return tl.load(ptr + offs, mask=m, other=0.0).to(acc_like.dtype)


@_device_fn
def _gate_pre(xrow, hrow, BH, k, offs, m, H, acc_like, HAS_X: tl.constexpr):
    """Pre-activation of gate k: x_k + (U h)_k + b_hh,k (x_k already holds b_ih,k)."""
    a = _load(hrow + k * H, offs, m, acc_like) + _load(BH + k * H, offs, m, acc_like)
    if HAS_X:
        a += _load(xrow + k * H, offs, m, acc_like)
    return a


@_device_fn
def _gate_forward(a, LNW, LNB, k, offs, m, H, eps, LN: tl.constexpr):
    """sigmoid(LN(a) * w_k + b_k) (or sigmoid(a)); returns (gate, normalised a, rstd)."""
    if LN:
        n, rstd = _ln_normalise(a, m, H, eps)
        w = _load(LNW + k * H, offs, m, a)
        b = _load(LNB + k * H, offs, m, a)
        g = _sigmoid(n * w + b)
    else:
        n = a
        rstd = 1.0
        g = _sigmoid(a)
    return g, n, rstd


@_device_fn
def _gate_backward(d, n, rstd, LNW, DLNW, DLNB, k, offs, m, H, LN: tl.constexpr):
    """From d(loss)/d(pre-sigmoid) of gate k to d(loss)/d(a); accumulates this row's gain / offset
    gradients into its own slice of the per-row accumulators (one program per row: no atomics)."""
    if LN:
        dw_ptr = DLNW + k * H + offs
        db_ptr = DLNB + k * H + offs
        tl.store(dw_ptr, tl.load(dw_ptr, mask=m, other=0.0) + d * n, mask=m)
        tl.store(db_ptr, tl.load(db_ptr, mask=m, other=0.0) + d, mask=m)
        d = _ln_backward(d * _load(LNW + k * H, offs, m, d), n, rstd, m, H)
    return d


# Slab indices (step, sub-cell, buffer slab) change from launch to launch: not specialised, so one
# compiled variant serves the whole loop; B and H are, which lets the compiler see aligned rows.
@triton.jit(do_not_specialize=["t", "hp_slab", "in_slab", "out_slab", "k"])
def step_forward_kernel(
    XP, HP, BH, HIN, LNW, LNB, DROP, MASK, HBLK, HOUT, HLP, OUT,
    t, hp_slab, in_slab, out_slab, k, B, H, eps,
    KIND: tl.constexpr, NIN: tl.constexpr, NH: tl.constexpr, NG: tl.constexpr, LN: tl.constexpr,
    HAS_DROP: tl.constexpr, LAST: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_LP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One sub-cell of one step for one batch row: bias + (per-gate) layer norm + gates + candidate
    (+ dropout) + state update; the block's last sub-cell (LAST) also applies the padding mask, writes the
    step's output (input dtype) and the state carried to the next step.

    Buffers and their row of this program (slabs are [B, ...] blocks of rows, int64 offsets):
    XP [T, B, NIN*H] at step t; HP [slabs, B, NH*H] at hp_slab; HIN (accumulation dtype) the sub-cell's
    input state, slab in_slab of [slabs, B, H]; DROP [S, B, H] at sub-cell k; MASK [T, B]; HBLK the block's
    input state (slab t of HIN's buffer; masking); HOUT / HLP the new state (accumulation dtype) and its
    copy in the GEMM dtype (WRITE_LP), slab out_slab; OUT [T, B, H] at step t (LAST)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    t_row = t.to(tl.int64) * B + row  # row of [T*B] buffers
    h = tl.load(HIN + (in_slab.to(tl.int64) * B + row) * H + offs, mask=m, other=0.0)
    xrow = XP + t_row * (NIN * H)
    hrow = HP + (hp_slab.to(tl.int64) * B + row) * (NH * H)
    if KIND == 3:  # ATR: p = W x, q = U h + b; h' = σ(p+q) p + σ(p−q) h
        p = _load(xrow, offs, m, h)
        q = _load(hrow, offs, m, h) + _load(BH, offs, m, h)
        if LN:
            n_p, rs_p = _ln_normalise(p, m, H, eps)
            n_q, rs_q = _ln_normalise(q, m, H, eps)
            p = n_p * _load(LNW, offs, m, h) + _load(LNB, offs, m, h)
            q = n_q * _load(LNW + H, offs, m, h) + _load(LNB + H, offs, m, h)
        hn = _sigmoid(p + q) * p + _sigmoid(p - q) * h
    else:
        HAS_X: tl.constexpr = KIND != 4
        r, n_r, rs_r = _gate_forward(_gate_pre(xrow, hrow, BH, 0, offs, m, H, h, HAS_X), LNW, LNB, 0, offs, m, H,
                                     eps, LN)
        z, n_z, rs_z = _gate_forward(_gate_pre(xrow, hrow, BH, 1, offs, m, H, h, HAS_X), LNW, LNB, 1, offs, m, H,
                                     eps, LN)
        hc = _load(hrow + NG * H, offs, m, h) + _load(BH + NG * H, offs, m, h)
        if KIND == 0:
            c = _tanh(_load(xrow + 2 * H, offs, m, h) + r * hc)
        elif KIND == 4:
            c = _tanh(r * hc)
        else:
            g3, n_3, rs_3 = _gate_forward(_gate_pre(xrow, hrow, BH, 2, offs, m, H, h, HAS_X), LNW, LNB, 2, offs, m,
                                          H, eps, LN)
            xc = _load(xrow + 3 * H, offs, m, h)
            lin = _load(xrow + 4 * H, offs, m, h)
            if KIND == 1:
                c = _tanh(xc + r * hc) + g3 * lin
            else:
                c = _tanh((1.0 - r) * xc + r * hc)
        if HAS_DROP:
            c = c * _load(DROP + (k.to(tl.int64) * B + row) * H, offs, m, h)
        hn = h + z * (c - h)
        if KIND == 2:
            hn = hn + g3 * (lin - hn)
    state = hn
    if LAST:
        o = hn
        if HAS_MASK:
            valid = tl.load(MASK + t_row).to(tl.float32) > 0.5
            h_blk = tl.load(HBLK + t_row * H + offs, mask=m, other=0.0)
            state = tl.where(valid, hn, h_blk)
            o = tl.where(valid, hn, 0.0)
        tl.store(OUT + t_row * H + offs, o.to(OUT.dtype.element_ty), mask=m)
    out_row = (out_slab.to(tl.int64) * B + row) * H
    tl.store(HOUT + out_row + offs, state, mask=m)
    if WRITE_LP:
        tl.store(HLP + out_row + offs, state.to(HLP.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["t", "hp_slab", "in_slab", "k", "dln_slab"])
def step_backward_kernel(
    XP, HP, BH, HIN, LNW, LNB, DROP, DIN, GIN, CD, CG, GO, MASK, DXP, DHP, DH, DLNW, DLNB,
    t, hp_slab, in_slab, k, dln_slab, B, H, eps,
    KIND: tl.constexpr, NIN: tl.constexpr, NH: tl.constexpr, NG: tl.constexpr, LN: tl.constexpr,
    HAS_DROP: tl.constexpr, TOP: tl.constexpr, BASE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_CG: tl.constexpr, BLOCK: tl.constexpr,
):
    """Backward of one sub-cell of one step for one batch row. Recomputes the forward from the saved
    pre-activations (XP, HP) and input state (HIN), then writes d(pre-activations) (DXP rows of the input
    projection, DHP rows of the recurrent one) and the direct gradient to the input state (DH); the path
    through U is added by the caller's GEMM (dHP @ U), which the next kernel reads as GIN / CG.

    Incoming gradient of the sub-cell's output:
      TOP (last sub-cell of the block):  valid ? CD + CG + GO[t] : 0, where CD (+ CG, its GEMM part) is the
                                         gradient carried from the later step and GO the output gradient;
      otherwise:                         DIN + GIN (direct part + U-path of the sub-cell above).
    BASE (first sub-cell): a padded row passes the carried gradient through unchanged: DH = CD + CG.
    DIN, GIN, CD, CG, DH are [B, H]; DXP / DHP have the layouts of XP / HP (slabs t / hp_slab); DLNW / DLNB
    are per-row accumulators [slabs, B, NG*H] at dln_slab; the rest as in step_forward_kernel."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    t_row = t.to(tl.int64) * B + row
    h = tl.load(HIN + (in_slab.to(tl.int64) * B + row) * H + offs, mask=m, other=0.0)
    if HAS_MASK:
        valid = tl.load(MASK + t_row).to(tl.float32) > 0.5
    if TOP or BASE:
        carry = _load(CD + row * H, offs, m, h)
        if HAS_CG:
            carry += _load(CG + row * H, offs, m, h)
    if TOP:
        dout = carry + _load(GO + t_row * H, offs, m, h)
        if HAS_MASK:
            dout = tl.where(valid, dout, 0.0)
    else:
        dout = _load(DIN + row * H, offs, m, h) + _load(GIN + row * H, offs, m, h)
    hp_row = hp_slab.to(tl.int64) * B + row
    xrow = XP + t_row * (NIN * H)
    hrow = HP + hp_row * (NH * H)
    dxrow = DXP + t_row * (NIN * H)
    dhrow = DHP + hp_row * (NH * H)
    dln_row = (dln_slab.to(tl.int64) * B + row) * (NG * H)
    dlw = DLNW + dln_row
    dlb = DLNB + dln_row
    if KIND == 3:
        p = _load(xrow, offs, m, h)
        q = _load(hrow, offs, m, h) + _load(BH, offs, m, h)
        if LN:
            n_p, rs_p = _ln_normalise(p, m, H, eps)
            n_q, rs_q = _ln_normalise(q, m, H, eps)
            w_p = _load(LNW, offs, m, h)
            w_q = _load(LNW + H, offs, m, h)
            p = n_p * w_p + _load(LNB, offs, m, h)
            q = n_q * w_q + _load(LNB + H, offs, m, h)
        i = _sigmoid(p + q)
        f = _sigmoid(p - q)
        da = dout * p * i * (1.0 - i)
        db = dout * h * f * (1.0 - f)
        dp = dout * i + da + db
        dq = da - db
        dh = dout * f
        if LN:
            dp = _gate_backward(dp, n_p, rs_p, LNW, dlw, dlb, 0, offs, m, H, LN)
            dq = _gate_backward(dq, n_q, rs_q, LNW, dlw, dlb, 1, offs, m, H, LN)
        tl.store(dxrow + offs, dp.to(DXP.dtype.element_ty), mask=m)
        tl.store(dhrow + offs, dq.to(DHP.dtype.element_ty), mask=m)
    else:
        HAS_X: tl.constexpr = KIND != 4
        r, n_r, rs_r = _gate_forward(_gate_pre(xrow, hrow, BH, 0, offs, m, H, h, HAS_X), LNW, LNB, 0, offs, m, H,
                                     eps, LN)
        z, n_z, rs_z = _gate_forward(_gate_pre(xrow, hrow, BH, 1, offs, m, H, h, HAS_X), LNW, LNB, 1, offs, m, H,
                                     eps, LN)
        hc = _load(hrow + NG * H, offs, m, h) + _load(BH + NG * H, offs, m, h)
        if HAS_DROP:
            md = _load(DROP + (k.to(tl.int64) * B + row) * H, offs, m, h)
        else:
            md = 1.0
        if KIND == 0 or KIND == 4:
            if KIND == 0:
                xc = _load(xrow + 2 * H, offs, m, h)
            else:
                xc = 0.0
            tc = _tanh(xc + r * hc)
            c = md * tc
            du = dout * z * md * (1.0 - tc * tc)
            dxc = du
            dhc = du * r
            dr = du * hc * r * (1.0 - r)
            dz = dout * (c - h) * z * (1.0 - z)
            dh = dout * (1.0 - z)
        else:
            g3, n_3, rs_3 = _gate_forward(_gate_pre(xrow, hrow, BH, 2, offs, m, H, h, HAS_X), LNW, LNB, 2, offs, m,
                                          H, eps, LN)
            xc = _load(xrow + 3 * H, offs, m, h)
            lin = _load(xrow + 4 * H, offs, m, h)
            if KIND == 1:  # L-GRU: c = md (tanh(xc + r hc) + l lin)
                tc = _tanh(xc + r * hc)
                c = md * (tc + g3 * lin)
                dc = dout * z * md
                du = dc * (1.0 - tc * tc)
                dxc = du
                dhc = du * r
                dlin = dc * g3
                d3 = dc * lin * g3 * (1.0 - g3)
                dr = du * hc * r * (1.0 - r)
                dz = dout * (c - h) * z * (1.0 - z)
                dh = dout * (1.0 - z)
            else:  # LAU: c = md tanh((1-r) xc + r hc); s = (1-z) h + z c; h' = s (1-g) + g lin
                tc = _tanh((1.0 - r) * xc + r * hc)
                c = md * tc
                s = h + z * (c - h)
                ds = dout * (1.0 - g3)
                d3 = dout * (lin - s) * g3 * (1.0 - g3)
                dlin = dout * g3
                du = ds * z * md * (1.0 - tc * tc)
                dxc = du * (1.0 - r)
                dhc = du * r
                dr = du * (hc - xc) * r * (1.0 - r)
                dz = ds * (c - h) * z * (1.0 - z)
                dh = ds * (1.0 - z)
            d3 = _gate_backward(d3, n_3, rs_3, LNW, dlw, dlb, 2, offs, m, H, LN)
            tl.store(dhrow + 2 * H + offs, d3.to(DHP.dtype.element_ty), mask=m)
            tl.store(dxrow + 2 * H + offs, d3.to(DXP.dtype.element_ty), mask=m)
            tl.store(dxrow + 3 * H + offs, dxc.to(DXP.dtype.element_ty), mask=m)
            tl.store(dxrow + 4 * H + offs, dlin.to(DXP.dtype.element_ty), mask=m)
        dr = _gate_backward(dr, n_r, rs_r, LNW, dlw, dlb, 0, offs, m, H, LN)
        dz = _gate_backward(dz, n_z, rs_z, LNW, dlw, dlb, 1, offs, m, H, LN)
        tl.store(dhrow + offs, dr.to(DHP.dtype.element_ty), mask=m)
        tl.store(dhrow + H + offs, dz.to(DHP.dtype.element_ty), mask=m)
        tl.store(dhrow + NG * H + offs, dhc.to(DHP.dtype.element_ty), mask=m)
        if KIND == 0:
            tl.store(dxrow + offs, dr.to(DXP.dtype.element_ty), mask=m)
            tl.store(dxrow + H + offs, dz.to(DXP.dtype.element_ty), mask=m)
            tl.store(dxrow + 2 * H + offs, dxc.to(DXP.dtype.element_ty), mask=m)
        elif KIND != 4:
            tl.store(dxrow + offs, dr.to(DXP.dtype.element_ty), mask=m)
            tl.store(dxrow + H + offs, dz.to(DXP.dtype.element_ty), mask=m)
    if BASE:
        if HAS_MASK:
            dh = tl.where(valid, dh, carry)
    tl.store(DH + row * H + offs, dh, mask=m)
