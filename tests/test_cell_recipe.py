"""Adding a cell (issue 75 item 4; the recipe: docs/design/cpu_kernels.md, "One table of the cells' rows"): a gated
cell touches four files, `layout.py` (its row of CELLS), `reference.py` (its equations), `cell_math.h` (its element
functions and their branch in gated_elem_forward / gated_elem_backward) and `triton_kernels.py`.

- No other kernel source names a gated kind: the C++ and CUDA sources choose code for a kind through the generated
  X-macros and cell_math.h's gated_elem_* (nothing else says kGRU, kLGRU or kLAU), and no other module of the
  kernel package compares a cell name or keys a table by one.
- A test-only cell follows the recipe for the C++ half: "xgru", a GRU whose candidate adds a linear path without a
  gate of its own (W: r z c lin, U: r z c; c = tanh(xc + r hc) + lin), is a row added to the table and a branch in a
  copy of cell_math.h, compiled by the host compiler with the header the table generates; its row functions
  (gated_forward_row / gated_backward_row, what the CPU copies run) equal its equations in float64, forward and
  every gradient, with layer norm and candidate dropout. The CUDA kernels reach a kind's element only through the
  same gated_elem_* (the first test), so they need no step of their own; they are not compiled for the test cell
  here (the emulated kernels take minutes to build: tests/test_cuda_sources.py builds them for the real cells)."""
import ast
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from dtmt_kernels.ops.transition import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
GATED = [name for name, row in layout.CELLS.items() if name not in ("atr", "tgru")]   # the gated base cells
RECIPE_PY = {os.path.join("dtmt_kernels", "ops", "transition", f)
             for f in ("layout.py", "reference.py", "triton_kernels.py")}
GATED_KIND = r"\bk(?:" + "|".join(n.upper() for n in GATED) + r")\b"   # their C++ kind names


def _strip_comments(text: str) -> str:
    """C++ source without its /* */ and // comments."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def test_no_other_kernel_source_names_a_gated_kind():
    named = []
    for folder, _, files in os.walk(CSRC):
        for f in files:
            if f.endswith((".h", ".cpp", ".cu", ".cuh")) and f not in ("cell_math.h",):
                with open(os.path.join(folder, f), encoding="utf-8") as fh:
                    code = _strip_comments(fh.read())
                named += [(f, m) for m in re.findall(GATED_KIND, code)]
    assert named == []
    compared = []
    for folder, _, files in os.walk(os.path.join(ROOT, "dtmt_kernels")):
        for f in files:
            if not f.endswith(".py") or os.path.relpath(os.path.join(folder, f), ROOT) in RECIPE_PY:
                continue
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                operands = []
                if isinstance(node, ast.Compare):
                    operands = [node.left, *node.comparators]
                    operands += [e for o in node.comparators if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                                 for e in o.elts]
                elif isinstance(node, ast.Dict):
                    operands = [k for k in node.keys if k is not None]
                compared += [(f, node.lineno) for o in operands
                             if isinstance(o, ast.Constant) and o.value in GATED]
    assert compared == []


def test_the_header_generator_takes_a_new_row():
    """cell_layout_header for the table with the test-only row: its kind number, row counts and base-cell rule, and
    both X-macros list it (so every kind dispatch gets its case)."""
    cells = dict(layout.CELLS, xgru=(5, 4, 3, 2, True))
    header = _header(cells)
    assert "kXGRU = 5" in header and "kind == kXGRU ? 4 : " in header and "kind == kXGRU ? 3 : " in header
    assert "kind == kXGRU ? 2 : " in header and "|| kind == kXGRU;" in header and "5 xgru" in header
    every, base = [line for line in header.splitlines() if line.startswith("#define DTMT_FOR_EACH")]
    assert every.endswith("X(kXGRU)") and base.endswith("X(kXGRU)")


def _header(cells) -> str:
    saved = layout.CELLS, layout.KINDS, layout.CELL_KINDS
    try:
        layout.CELLS = cells
        layout.KINDS = {name: row[0] for name, row in cells.items()}
        layout.CELL_KINDS = tuple(name for name in cells if name != "tgru")
        return layout.cell_layout_header()
    finally:
        layout.CELLS, layout.KINDS, layout.CELL_KINDS = saved


# the test-only cell's branches, as the recipe writes them into cell_math.h's gated_elem_forward / _backward
FORWARD_BRANCH = """  } else if constexpr (KIND == kXGRU) {
    return lgru_elem_forward<A>(r, z, A(1), xc, lin, hc, h, m);   // an L-GRU whose linear path has no gate
"""
BACKWARD_BRANCH = """  } else if constexpr (KIND == kXGRU) {
    A unused;
    lgru_elem_backward<A>(r, z, A(1), xc, lin, hc, h, m, dhn, dr_pre, dz_pre, unused, dxc, dlin, dhc, dh);
"""

DRIVER = r"""
#include <cstdio>
#include <vector>
#include "cell_math.h"
using namespace dtmt;
int main() {
  int H;
  if (std::scanf("%d", &H) != 1) return 1;
  // xp [4H], hp [3H], h [H], lnw [2H], lnb [2H], drop [H], dout [H]
  std::vector<double> v(4 * H + 3 * H + H + 2 * H + 2 * H + H + H);
  for (double& x : v) if (std::scanf("%lf", &x) != 1) return 1;
  const double *xp = v.data(), *hp = xp + 4 * H, *h = hp + 3 * H, *lnw = h + H, *lnb = lnw + 2 * H,
               *drop = lnb + 2 * H, *dout = drop + H;
  std::vector<double> scratch(3 * 3 * H), out(H), dxp(4 * H), dhp(3 * H), dh(H), dlnw(2 * H, 0.0), dlnb(2 * H, 0.0);
  gated_forward_row<kXGRU, double, double>(H, xp, hp, h, lnw, lnb, drop, 1e-5, scratch.data(), out.data());
  gated_backward_row<kXGRU, double, double>(H, xp, hp, h, lnw, lnb, drop, 1e-5, dout, scratch.data(), dxp.data(),
                                            dhp.data(), dh.data(), dlnw.data(), dlnb.data());
  for (auto* a : {&out, &dxp, &dhp, &dh, &dlnw, &dlnb})
    for (double x : *a) std::printf("%.17g\n", x);
  return 0;
}
"""


def _xgru(xp, hp, h, lnw, lnb, drop, eps=1e-5):
    """The test-only cell's equations (what reference.py would hold), from the products: gates r, z through their
    layer norms; c = drop * (tanh(xc + r hc) + lin); h' = (1 - z) h + z c."""
    H = h.shape[-1]
    xr, xz, xc, lin = xp.split(H)
    hr, hz, hc = hp.split(H)
    r = torch.sigmoid(F.layer_norm(xr + hr, (H,), lnw[:H], lnb[:H], eps))
    z = torch.sigmoid(F.layer_norm(xz + hz, (H,), lnw[H:], lnb[H:], eps))
    c = drop * (torch.tanh(xc + r * hc) + lin)
    return (1 - z) * h + z * c


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_a_test_only_cell_follows_the_recipe(tmp_path):
    with open(os.path.join(CSRC, "cell_math.h"), encoding="utf-8") as f:
        math = f.read()
    for marker, branch in (("  // (a new gated kind: its forward branch here)\n", FORWARD_BRANCH),
                           ("  // (a new gated kind: its backward branch here)\n", BACKWARD_BRANCH)):
        assert math.count(marker) == 1, "cell_math.h no longer marks where a gated kind's branch goes"
        math = math.replace(marker, branch)
    (tmp_path / "cell_math.h").write_text(math)
    (tmp_path / "cell_layout.inc").write_text(_header(dict(layout.CELLS, xgru=(5, 4, 3, 2, True))))
    (tmp_path / "driver.cpp").write_text(DRIVER)
    exe = str(tmp_path / "driver")
    subprocess.run(["c++", "-std=c++17", "-O1", "-I", str(tmp_path), str(tmp_path / "driver.cpp"), "-o", exe],
                   check=True, capture_output=True, text=True)
    H = 7
    g = torch.Generator().manual_seed(0)
    xp, hp, h = (torch.randn(n * H, generator=g, dtype=torch.float64) for n in (4, 3, 1))
    lnw = 1 + 0.3 * torch.randn(2 * H, generator=g, dtype=torch.float64)
    lnb = 0.2 * torch.randn(2 * H, generator=g, dtype=torch.float64)
    drop = (torch.rand(H, generator=g, dtype=torch.float64) > 0.3).double() / 0.7
    dout = torch.randn(H, generator=g, dtype=torch.float64)
    values = torch.cat([xp, hp, h, lnw, lnb, drop, dout])
    run = subprocess.run([exe], input=f"{H}\n" + "\n".join(repr(float(v)) for v in values), check=True,
                         capture_output=True, text=True)
    got = torch.tensor([float(x) for x in run.stdout.split()], dtype=torch.float64)
    out, dxp, dhp, dh, dlnw, dlnb = got.split([H, 4 * H, 3 * H, H, 2 * H, 2 * H])
    leaves = [t.clone().requires_grad_() for t in (xp, hp, h, lnw, lnb)]
    expected = _xgru(*leaves, drop)
    grads = torch.autograd.grad(expected, leaves, dout)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("xp", "hp", "h", "lnw", "lnb"), (dxp, dhp, dh, dlnw, dlnb), grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")
