"""The conventions every backend of the transition op shares. First the one table of the recurrent cells' row
layout, which every backend reads (nn.py's parameters, the Triton launches, the op fakes) or is tested against
(csrc/cell_math.h's cell_input_rows / cell_hidden_rows / cell_ln_groups, through _C.CELL_ROWS). reference.py's
module docstring draws the same layout with the rows' names.

A cell's input projection W x and recurrent projection U h are stacked by rows, H each; the gates come first and
are the rows layer norm normalises (per gate). An absent optional tensor (mask, dropout, layer norm, T-GRUs) is None
or empty (`present`); kernels compute and keep states in `acc_dtype` of the input dtype."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

# The cells, one row each: the one table of the row layout. Python and Triton read it here; the C++ and CUDA kernels
# read csrc/cell_layout.inc, which setup.py writes from it before every build (cell_layout_header; the file is
# committed, and tests/test_custom_ops.py checks that it is current and that the extension's compiled values,
# _C.CELL_ROWS, equal the table).
#   name: (the kernels' `kind` number, input rows, recurrent rows, layer-normalised gates (in units of H), whether it
#          may head a deep transition (T-GRUs after it))
CELLS: Dict[str, Tuple[int, int, int, int, bool]] = {
    "gru": (0, 3, 3, 2, True),      # W: r z c          U: r z c
    "lgru": (1, 5, 4, 3, True),     # W: r z l c lin    U: r z l c
    "lau": (2, 5, 4, 3, True),      # W: r z g c lin    U: r z g c
    "atr": (3, 1, 1, 2, False),     # W: p              U: q          (LN on p and q separately)
    "tgru": (4, 0, 3, 2, False),    # no input          U: r z c      (a deep transition's inner cells only)
}
KINDS: Dict[str, int] = {name: row[0] for name, row in CELLS.items()}   # the kernels' `kind` numbers
KIND_TGRU = KINDS["tgru"]
CELL_KINDS = tuple(name for name in CELLS if name != "tgru")          # the base cells a layer may have
DEEP_TRANSITION_CELLS = tuple(name for name, row in CELLS.items() if row[4])   # DeepTransitionGRU's `cell`

# kind -> (input rows, recurrent rows, layer-normalised gates), in units of H
ROWS: Dict[int, Tuple[int, int, int]] = {row[0]: row[1:4] for row in CELLS.values()}
CELL_ROWS: Dict[str, Tuple[int, int, int]] = {name: ROWS[k] for name, k in KINDS.items()}


def cell_layout_header() -> str:
    """csrc/cell_layout.inc, the table above as C++: the CellKind enum and the constexpr row counts that
    csrc/cell_math.h includes inside its namespace (each instruction set's copy has its own)."""
    def chain(column: int) -> str:   # (an unknown kind: 0 rows)
        return "".join(f"kind == k{name.upper()} ? {row[column]} : " for name, row in CELLS.items()) + "0"

    kinds = ", ".join(f"k{name.upper()} = {row[0]}" for name, row in CELLS.items())
    every = " ".join(f"X(k{name.upper()})" for name in CELLS)
    base = " ".join(f"X(k{name.upper()})" for name in CELL_KINDS)
    names = ", ".join(f"{KINDS[name]} {name}" for name in CELL_KINDS)
    return (
        "// Generated from dtmt_kernels/ops/transition/layout.py (CELLS) by setup.py before every build: do not edit.\n"
        "// Included by cell_math.h inside its namespace; tests/test_custom_ops.py checks that it is current.\n"
        f"enum CellKind : int {{ {kinds} }};\n"
        "\n"
        "// Rows of the input projection (W x), of the recurrent projection (U h), in units of H, and the number of\n"
        "// layer-normalised gates (constexpr: transition_cuda_kernels.cuh's Rows<KIND> reads them at compile time).\n"
        + "".join(f"DTMT_HD constexpr int {fn}(int kind) {{\n  return {chain(column)};\n}}\n"
                  for fn, column in (("cell_input_rows", 1), ("cell_hidden_rows", 2), ("cell_ln_groups", 3)))
        + "\n// The base cells, those a layer may have (all but the T-GRU, a deep transition's inner cell), and their\n"
        "// names for messages.\n"
        f"DTMT_HD constexpr bool base_cell(long long kind) {{\n  return {' || '.join(f'kind == k{n.upper()}' for n in CELL_KINDS)};\n}}\n"
        f'constexpr const char* kBaseCellNames = "{names}";\n'
        "\n// X(kind) for every kind, and for the base cells' only: the kernels' dispatch from a kind number to code\n"
        "// compiled for it (a switch of `case` lines), so that a new cell adds no case by hand.\n"
        f"#define DTMT_FOR_EACH_CELL_KIND(X) {every}\n"
        f"#define DTMT_FOR_EACH_BASE_CELL_KIND(X) {base}\n")


def present(t: Optional[Tensor]) -> bool:
    """Whether an optional tensor of the op is given: absent ones are None or empty."""
    return t is not None and t.numel() > 0


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in and keep the states in (hs) for inputs of `dtype`: float64 for float64,
    float32 otherwise (16-bit inputs then also keep hs_lp, the states in their own dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_kind(op: str, kind, name: str = "") -> None:
    """RuntimeError unless `kind` is a cell kind of ROWS, naming the op and the argument (`name`), as the kernels'
    checks do: the fake implementations' check (a fake is all a meta call or a torch.compile / export trace runs)."""
    if not isinstance(kind, int) or kind not in ROWS:
        raise RuntimeError(f"dtmt::{op}: unknown cell kind {kind!r}{f' for {name}' if name else ''} "
                           f"({', '.join(f'{k} {n}' for n, k in KINDS.items())})")


def check_shapes(op: str, x: Tensor, h0: Tensor, kind, w_ih: Tensor, w_hh: Tensor, t_w: Optional[Tensor],
                h0_lead: tuple = (), tokens: bool = False, h_name: str = "h0") -> int:
    """What the shapes of a forward's outputs rest on, checked as the kernels check it (csrc/op_checks.cpp's
    check_cell and the states' sizes) for the fake implementations, through which torch.compile and torch.export trace
    and which are all a meta call runs: the cell kind, x [T, B, I], w_hh [n_h H, H], w_ih [n_in H, I], t_w [D, 3H, H],
    h0 [*h0_lead, B, H] (named `h_name`; `tokens`: x is token ids [T, B], w_ih's columns not read); every tensor on
    one device is what every fake checks first (_register.register_fake). RuntimeError naming the argument; returns H.
    (Without it a wrong kind was a KeyError and wrong sizes made outputs of wrong shapes, found only when the kernel
    ran.) The Triton ops check their arguments with it too."""
    from ..linear.quantize import ROW_TAIL   # here: setup.py loads this file alone, outside the package

    def fail(what):
        raise RuntimeError(f"dtmt::{op}: {what}")

    def cols(w):   # a weight's input features: float [N, K], or int8 rows [N, K + ROW_TAIL] (quantize.py)
        return w.shape[-1] - (ROW_TAIL if w.dtype == torch.int8 else 0)

    check_kind(op, kind)
    n_in, n_h, _ = ROWS[kind]
    if x.dim() != (2 if tokens else 3):
        fail(f"{'tokens must be [T, B]' if tokens else 'x must be [T, B, I]'}, got {list(x.shape)}")
    B, I = x.shape[1], None if tokens else x.shape[2]
    if w_hh.dim() != 2 or w_hh.shape[0] == 0 or w_hh.shape[0] % n_h or cols(w_hh) != w_hh.shape[0] // n_h:
        fail(f"w_hh must be [{n_h} * H, H] for this cell, got {list(w_hh.shape)}")
    H = w_hh.shape[0] // n_h
    if w_ih.dim() != 2 or w_ih.shape[0] != n_in * H or (I is not None and cols(w_ih) != I):
        fail(f"w_ih must be [{n_in * H}, {'I' if I is None else I}] (H = {H}), got {list(w_ih.shape)}")
    if present(t_w) and (t_w.dim() != 3 or t_w.shape[1] != 3 * H or cols(t_w) != H):
        fail(f"t_w must be [D, {3 * H}, {H}], got {list(t_w.shape)}")
    if tuple(h0.shape) != (*h0_lead, B, H):
        fail(f"{h_name} must be {list((*h0_lead, B, H))}, got {list(h0.shape)}")
    return H


def check_mask(op: str, mask: Optional[Tensor]) -> None:
    """RuntimeError naming `op` unless a step mask (1 a real step, 0 padding), where given, is bool or real floating
    point (csrc/op_checks.cpp's check_mask): a complex one had been read as its real part (every step padding for
    1j), or failed inside Triton."""
    if present(mask) and not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise RuntimeError(f"dtmt::{op}: mask must be bool or floating point (1 a real step, 0 padding), got "
                           f"{mask.dtype}")


def check_sequence(op: str, x, h0, mask, drop, kind, eps, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w,
                   t_ln_b, h_name: str = "h0", cpp: bool = False) -> Tuple[int, int, int, int, int]:
    """The transition op's argument checks (csrc/registration.cpp's check_sequence, csrc/op_checks.cpp's check_cell
    and check_eps), made by the Triton ops before any launch and by the forward ops' fakes (a fake is all a meta call or
    a torch.compile / export trace runs: they had taken a short mask, a float32 weight beside a float64 x, an int64 x
    or a NaN eps that the kernels refuse): every weight slot against the cell, h0, mask and drop against x and the
    weights, eps finite and >= 0 (a NaN gave NaN states without a word), the mask bool or real floating point (a
    complex one had been read as its real part, or failed inside Triton), every floating tensor in x's dtype (h0
    float32 beside a 16-bit x, autocast's state). `cpp`: the C++ op's forms too, int8 rows for the matrices (the CPU's
    form) and empty biases (zero); the Triton kernels read the biases. RuntimeError naming the op and the argument
    (the kernels index them by the sizes x and w_hh give: a short mask, dropout mask, bias or layer-norm gain was read
    past its end, a short h0 broadcast, without a word). Returns (T, B, I, H, D)."""
    def fail(what):
        raise RuntimeError(f"dtmt::{op}: {what}")

    def sizes(t):
        return list(t.shape) if isinstance(t, Tensor) else None

    matrices = ("w_ih", "w_hh", "t_w")
    check_kind(op, kind)
    if not 0.0 <= eps < float("inf"):   # (NaN fails this too)
        fail(f"eps must be a finite number >= 0, got {eps!r}")
    if kind == KIND_TGRU:   # (a deep transition's inner cell, never a layer's: csrc's base_cell)
        fail(f"kind {kind} (tgru) is not a base cell")
    for name, t in (("x", x), (h_name, h0), ("w_ih", w_ih), ("b_ih", b_ih), ("w_hh", w_hh), ("b_hh", b_hh),
                    ("ln_w", ln_w), ("ln_b", ln_b), ("t_w", t_w), ("t_b", t_b), ("t_ln_w", t_ln_w),
                    ("t_ln_b", t_ln_b), ("drop", drop)):
        if present(t) and not t.is_floating_point() and not (cpp and name in matrices and t.dtype == torch.int8):
            fail(f"{name} must be a floating-point tensor, got {t.dtype}")
    check_mask(op, mask)
    for name, t in (("w_ih", w_ih), ("b_ih", b_ih), ("w_hh", w_hh), ("b_hh", b_hh), ("t_w", t_w), ("t_b", t_b),
                    ("ln_w", ln_w), ("ln_b", ln_b), ("t_ln_w", t_ln_w), ("t_ln_b", t_ln_b), ("drop", drop)):
        if present(t) and t.dtype != x.dtype and not (cpp and name in matrices and t.dtype == torch.int8):
            fail(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    # (the state: x's dtype, or float32 beside a 16-bit x, autocast's)
    if present(h0) and h0.dtype != x.dtype and not (x.dtype in (torch.float16, torch.bfloat16)
                                                    and h0.dtype == torch.float32):
        fail(f"{h_name} must have x's dtype {x.dtype}, got {h0.dtype}")
    # the shapes the outputs rest on, as the fakes check them: x, w_hh, w_ih, t_w and h0
    H = check_shapes(op, x, h0, kind, w_ih, w_hh, t_w, h_name=h_name)
    T, B, I = x.shape
    n_in, n_h, n_g = ROWS[kind]
    D = t_w.shape[0] if present(t_w) else 0
    want = [(name, t, shape) for name, t, shape in (("b_ih", b_ih, [n_in * H]), ("b_hh", b_hh, [n_h * H]))
            if not (cpp and t is not None and t.numel() == 0)]
    if present(ln_w) or present(ln_b):
        want += [("ln_w", ln_w, [n_g * H]), ("ln_b", ln_b, [n_g * H])]
    if present(t_w) or present(t_b):
        want += [("t_w", t_w, [D, 3 * H, H]), ("t_b", t_b, [D, 3 * H])]   # (t_w absent, t_b given: refused)
    if present(t_ln_w) or present(t_ln_b):
        want += [("t_ln_w", t_ln_w, [D, 2 * H]), ("t_ln_b", t_ln_b, [D, 2 * H])]
    if present(mask):
        want.append(("mask", mask, [T, B]))
    if present(drop):
        if kind == KINDS["atr"]:   # (taken and unused, where the layers refuse it)
            fail("drop must be None for ATR, which has no candidate to drop (contract §2)")
        want.append(("drop", drop, [D + 1, B, H]))
    for name, t, shape in want:   # (Triton's kernels read the biases: empty ones, which the C++ op takes, are refused)
        if t is None or list(t.shape) != shape:
            fail(f"{name} must be {shape}, got {sizes(t)}")
    if present(t_ln_w) and not D:
        fail("t_ln_w and t_ln_b are given only with T-GRUs (t_w)")
    return T, B, I, H, D
