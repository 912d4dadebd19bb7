"""The machine's float32 GEMM rate at the shapes the decoders use, on 1 and 2 threads.

    python benchmarks/bench_gemm.py                       # the dtmt small preset's per-step shapes and a big one
    python benchmarks/bench_gemm.py --shapes 64x256x768
    python benchmarks/bench_gemm.py --decode               # beam 4, batch 1: dtmt's per-step decoder shapes, cold

Each M x K x N shape is timed as x [M, K] @ W^T (W [N, K], as nn.Linear / the kernels' input projections) and
as the weight gradient g^T [N, M] @ x [M, K]; median of --repeat timings of --inner calls. This is the
ceiling the fused kernels work under: at the per-step shapes (M = batch rows) the GEMMs are slower per FLOP
than at M = T·B and gain little from a second thread.

Each shape also shows the weight read rate, K·N·4 bytes / time of x @ W^T, next to what the memory gives a plain
read of the same weights (W.sum()). With --cold every call uses the next of enough distinct weight matrices to
fill 64 MiB, so they come from memory rather than cache, as in decoding, where a step reads every decoder weight
once (~10 MB for dtmt's small preset). --decode selects the M = 4 shapes of beam 4, batch 1;
--rows changes their M (1 for greedy decoding at batch 1).

For M <= 8 the last column is the package's small-row kernel (`dtmt_kernels.functional.linear`,
csrc/small_gemm_cpu.cpp) on the same weights, as weight GB/s, next to x @ W^T's (why the small-row loop:
docs/design/cpu_kernels.md, "Streaming the weights").
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

try:
    from dtmt_kernels import _C
except ImportError:  # the package not built: torch's figures only
    _C = None


def cold_weights(N: int, K: int, nbytes: int = 64 << 20, cap: int | None = None, generator=None) -> list:
    """Distinct float32 [N, K] weight matrices filling `nbytes` (at least one, at most `cap`): a loop taking the
    next one each call reads its weights from memory rather than cache (--cold; bench_peers.speed_probe)."""
    count = max(1, nbytes // (4 * N * K))
    if cap is not None:
        count = min(cap, count)
    return [torch.randn(N, K, generator=generator) for _ in range(count)]


def rate(f, flops: float, inner: int, repeat: int) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            f()
        times.append((time.perf_counter() - t) / inner)
    return flops / statistics.median(times) / 1e9


def _shape(text: str) -> str:
    """--shapes' MxKxN, each a positive integer (foo was a ValueError's traceback after the first shapes ran)."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected MxKxN of positive integers, e.g. 50x512x1024, got {text!r}")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=["50x128x1024", "50x256x768", "50x512x1024",
                                                                "2050x512x1024"], help="MxKxN, e.g. 50x512x1024")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--decode", action="store_true",
                   help="dtmt small preset's decoder shapes at beam 4, batch 1 (M = 4), with --cold")
    p.add_argument("--cold", action="store_true", help="cycle through 64 MiB of distinct weights")
    p.add_argument("--rows", type=int, default=4, help="M of the --decode shapes")
    p.add_argument("--inner", type=int, default=50)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # (common.py, beside this script)
    from common import check_options, provenance, provenance_line

    # (--repeat 0 was an empty median, --threads 0 torch's error, after the first shapes had run)
    check_options(p, a, (("threads", 1), ("rows", 1), ("inner", 1), ("repeat", 1)))
    if a.decode:
        a.shapes = [f"{a.rows}x{kn}" for kn in ("128x4000", "512x1280", "256x1024", "256x768", "512x512")]
        a.cold = True
    small_ok = _C is not None
    print(provenance_line(provenance(__file__, argv)), flush=True)
    print(f"torch {torch.__version__}; GFLOP/s (x W^T | weight gradient), weight GB/s (x W^T | W.sum()"
          + (" | small-row kernel" if small_ok else "") + ")" + (", cold weights" if a.cold else ""))
    rows, before = [], torch.get_num_threads()
    for threads in a.threads:
        torch.set_num_threads(threads)
        for shape in a.shapes:
            M, K, N = (int(v) for v in shape.split("x"))
            x, g = torch.randn(M, K), torch.randn(M, N)
            ws = cold_weights(N, K, cap=1024) if a.cold else [torch.randn(N, K)]
            weight = itertools.cycle(ws).__next__
            flops, nbytes = 2.0 * M * K * N, 4.0 * K * N
            inner = max(1, a.inner * 50 // max(M, 50))
            fwd = rate(lambda: x @ weight().t(), flops, inner, a.repeat)
            wgrad = rate(lambda: g.t() @ x, flops, inner, a.repeat)
            read = rate(lambda: weight().sum(), nbytes, inner, a.repeat)
            gbs = fwd * nbytes / flops
            small = None
            if small_ok and M <= _C.SMALL_ROWS_MAX:
                small = rate(lambda: torch.ops.dtmt.small_rows_linear(x, weight(), None), flops, inner, a.repeat) * nbytes / flops
            print(f"threads {threads}  {M:>5} x {K:>4} x {N:>5}: {fwd:6.1f} | {wgrad:6.1f}    {gbs:5.1f} | {read:5.1f}"
                  + (f" | {small:5.1f}" if small is not None else ""))
            rows.append({"threads": threads, "shape": shape, "gflops": fwd, "wgrad_gflops": wgrad,
                         "weight_gbs": gbs, "read_gbs": read, "small_rows_gbs": small})
    torch.set_num_threads(before)
    return rows


if __name__ == "__main__":
    main()
