"""Instructions executed by the fused cells' element loops, counted by callgrind (repeatable on a noisy VM).

    valgrind --tool=callgrind --callgrind-out-file=cg.out \\
        --toggle-collect='*cell_forward_rows*' --toggle-collect='*cell_backward_rows*' \\
        python benchmarks/callgrind_cells.py --cell atr [--root TREE]
    callgrind_annotate cg.out | head -30

The workload: one layer of --cell as dtmt_kernels.nn builds it (seed 0; I 128 -> H 256, T 30, B 32, float32, one
thread, C++ backend), without and with layer norm, forward and backward 3 times each. --root imports dtmt_kernels
from another checkout (an older commit with its own build) to count before/after in the same way. Valgrind runs
the AVX2 copy of the loops (it does not emulate AVX-512). Without valgrind the script just runs the workload.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cell", default="atr", choices=("gru", "lgru", "lau", "atr"))
    p.add_argument("--depth", type=int, default=0, help="T-GRUs after the cell (not for atr)")
    p.add_argument("--root", default=os.path.dirname(HERE), help="the checkout whose dtmt_kernels is counted")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    sys.path.insert(0, a.root)
    import torch

    import dtmt_kernels as dk

    torch.set_num_threads(1)
    T, B, I, H = 30, 32, 128, 256
    for ln in (False, True):
        torch.manual_seed(0)
        if a.cell == "atr":
            layer = dk.nn.ATR(I, H, layer_norm=ln)
        else:
            layer = dk.nn.DeepTransitionGRU(I, H, depth=a.depth, cell=a.cell, layer_norm=ln)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, B, I, generator=g, requires_grad=True)
        h0 = torch.zeros(B, H)
        for _ in range(a.repeat):
            w = layer.direction_weights(0, dict(layer.named_parameters()))
            out, h_n = dk.functional.transition_sequence(x, h0, w, None, None, False, "cpp")
            (out.sum() + h_n.sum()).backward()
    return 0


if __name__ == "__main__":
    sys.exit(main())
