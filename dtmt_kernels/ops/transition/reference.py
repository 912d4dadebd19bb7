"""The transition op's reference: pure-PyTorch cells, the executable form of contract §2 (docs/contract.md;
dtmt_kernels.reference gathers it with the attention op's).

Short and readable on purpose, never optimised: every fused backend is tested against these functions.
Shapes: x [B, I], h [B, H]; a sequence is time-major, x [T, B, I].

Parameter layout (shared by every backend, see `TransitionWeights`): the input projection `xp = W x + b_ih`
and the recurrent projection `hp = U h + b_hh` are stacked by rows in this order

    cell   W (input) rows        U (recurrent) rows   normalised gates
    gru    r z c                 r z c                r z
    lgru   r z l c lin           r z l c              r z l
    lau    r z g c lin           r z g c              r z g
    tgru   (no input)            r z c                r z
    atr    p                     q                    p q (separately)

The candidate bias of U sits inside the reset product, `c = tanh(xc + r * (U_c h + b_hc))`, as in
PyTorch/cuDNN (and `torch.nn.GRU`'s input bias b_ic is the candidate row of b_ih). With layer norm, gate k
is `sigmoid(LN(x_k + h_k) * w_k + b_k)`: the LN offset replaces the gate bias, so the gate rows of b_ih and
b_hh are zero. Candidate-dropout masks multiply the candidate c.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

from torch import Tensor

@dataclass
class TransitionWeights:
    """One direction's parameters: the base cell and its stack of T-GRUs (full-width biases)."""

    cell: str
    w_ih: Tensor
    b_ih: Tensor
    w_hh: Tensor
    b_hh: Tensor
    ln_w: Optional[Tensor] = None
    ln_b: Optional[Tensor] = None
    t_w: List[Tensor] = field(default_factory=list)
    t_b: List[Tensor] = field(default_factory=list)
    t_ln_w: List[Optional[Tensor]] = field(default_factory=list)
    t_ln_b: List[Optional[Tensor]] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return len(self.t_w)


def gate(a: Tensor, k: int, ln_w: Optional[Tensor], ln_b: Optional[Tensor], eps: float) -> Tensor:
    """sigmoid of gate k's pre-activation, through its own layer norm when ln_w is given."""
    if ln_w is not None:
        H = a.shape[-1]
        a = F.layer_norm(a, (H,), ln_w[k * H:(k + 1) * H], ln_b[k * H:(k + 1) * H], eps)
    return torch.sigmoid(a)


def gru_cell(xp, h, w_hh, b_hh, ln_w=None, ln_b=None, drop=None, eps=1e-5):
    """GRU: r, z gates; c = tanh(xc + r*(U_c h + b_c)); h' = (1-z) h + z c."""
    xr, xz, xc = xp.chunk(3, -1)
    hr, hz, hc = F.linear(h, w_hh, b_hh).chunk(3, -1)
    r = gate(xr + hr, 0, ln_w, ln_b, eps)
    z = gate(xz + hz, 1, ln_w, ln_b, eps)
    c = torch.tanh(xc + r * hc)
    if drop is not None:
        c = c * drop
    return (1 - z) * h + z * c


def tgru_cell(h, w_hh, b_hh, ln_w=None, ln_b=None, drop=None, eps=1e-5):
    """T-GRU: a GRU whose only input is the state: r = σ(U_r h), z = σ(U_z h), c = tanh(r (U_c h + b_c))."""
    hr, hz, hc = F.linear(h, w_hh, b_hh).chunk(3, -1)
    r = gate(hr, 0, ln_w, ln_b, eps)
    z = gate(hz, 1, ln_w, ln_b, eps)
    c = torch.tanh(r * hc)
    if drop is not None:
        c = c * drop
    return (1 - z) * h + z * c


def lgru_cell(xp, h, w_hh, b_hh, ln_w=None, ln_b=None, drop=None, eps=1e-5):
    """L-GRU: GRU plus a linear path l * (H x) inside the candidate."""
    xr, xz, xl, xc, lin = xp.chunk(5, -1)
    hr, hz, hl, hc = F.linear(h, w_hh, b_hh).chunk(4, -1)
    r = gate(xr + hr, 0, ln_w, ln_b, eps)
    z = gate(xz + hz, 1, ln_w, ln_b, eps)
    l = gate(xl + hl, 2, ln_w, ln_b, eps)
    c = torch.tanh(xc + r * hc) + l * lin
    if drop is not None:
        c = c * drop
    return (1 - z) * h + z * c


def lau_cell(xp, h, w_hh, b_hh, ln_w=None, ln_b=None, drop=None, eps=1e-5):
    """LAU: c = tanh((1-r) W_c x + r (U_c h + b_c)); h' = ((1-z) h + z c)(1-g) + g (H x)."""
    xr, xz, xg, xc, lin = xp.chunk(5, -1)
    hr, hz, hg, hc = F.linear(h, w_hh, b_hh).chunk(4, -1)
    r = gate(xr + hr, 0, ln_w, ln_b, eps)
    z = gate(xz + hz, 1, ln_w, ln_b, eps)
    g = gate(xg + hg, 2, ln_w, ln_b, eps)
    c = torch.tanh((1 - r) * xc + r * hc)
    if drop is not None:
        c = c * drop
    return ((1 - z) * h + z * c) * (1 - g) + g * lin


def atr_cell(xp, h, w_hh, b_hh, ln_w=None, ln_b=None, drop=None, eps=1e-5):
    """ATR: p = W x, q = U h + b; i = σ(p+q), f = σ(p−q); h' = i p + f h (p, q each layer-normed if on).

    The paper writes f = σ(q − p); the authors' code (and contract §2) use σ(p − q)."""
    p = xp
    q = F.linear(h, w_hh, b_hh)
    if ln_w is not None:
        H = h.shape[-1]
        p = F.layer_norm(p, (H,), ln_w[:H], ln_b[:H], eps)
        q = F.layer_norm(q, (H,), ln_w[H:], ln_b[H:], eps)
    i = torch.sigmoid(p + q)
    f = torch.sigmoid(p - q)
    return i * p + f * h


BASE_CELLS = {"gru": gru_cell, "lgru": lgru_cell, "lau": lau_cell, "atr": atr_cell}


def transition_step(xp: Tensor, h: Tensor, w: TransitionWeights, drop: Optional[Tensor] = None,
                    eps: float = 1e-5) -> Tensor:
    """One step of the deep transition block: base cell then `depth` T-GRUs (drop: [depth+1, B, H])."""
    h = BASE_CELLS[w.cell](xp, h, w.w_hh, w.b_hh, w.ln_w, w.ln_b, None if drop is None else drop[0], eps)
    for k in range(w.depth):
        h = tgru_cell(h, w.t_w[k], w.t_b[k], w.t_ln_w[k], w.t_ln_b[k],
                      None if drop is None else drop[k + 1], eps)
    return h


def transition_sequence(x: Tensor, h0: Tensor, w: TransitionWeights, mask: Optional[Tensor] = None,
                        drop: Optional[Tensor] = None, reverse: bool = False, eps: float = 1e-5):
    """Runs the block over x [T, B, I] from h0 [B, H]; mask [T, B] (1 valid, 0 padded).

    A padded step keeps the state and outputs zero, so with padding at the end a reversed direction starts
    at each sequence's own last token. Returns (out [T, B, H], h_n [B, H])."""
    xp = F.linear(x, w.w_ih, w.b_ih)  # the whole sequence's input projection in one GEMM
    h = h0
    out = [None] * x.shape[0]
    steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    for t in steps:
        h_new = transition_step(xp[t], h, w, drop, eps)
        if mask is None:
            h = out[t] = h_new
        else:
            valid = mask[t].unsqueeze(-1) > 0.5
            out[t] = torch.where(valid, h_new, torch.zeros_like(h_new))
            h = torch.where(valid, h_new, h)
    if not out:   # (T = 0: no step, the state as it came; torch.stack had refused the empty list)
        return x.new_zeros(0, *h0.shape[-2:]), h0
    return torch.stack(out), h
