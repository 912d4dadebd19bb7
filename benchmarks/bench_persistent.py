"""The persistent forward (issue 72; DTMT_CUDA_RECURRENCE=persistent, csrc/persistent_cuda_kernels.cuh) against the
cuda backend's per-step forward and cuDNN's GRU, on the GPU, all in strict fp32 (TF32 off for cuBLAS and cuDNN).

    python benchmarks/bench_persistent.py [--T 50] [--B 1 8 64 256] [--H 512] [--repeat 10] [--out DIR]

The switch is read once a process, so each mode runs in a child process of its own. For every case (one GRU layer;
the deep transition, L-GRU + 4 T-GRUs with layer norm; ATR) and batch size, a child
- checks its forward against the float64 reference on the device (ragged lengths, the reverse direction), and
  reports the largest difference of the outputs (relative to their largest value);
- times the forward alone and forward + backward (both persistent in the persistent mode), eager, median of
  --repeat, and the peak memory of forward + backward.
The parent prints one table: the two modes side by side, steps / persistent (above 1: the persistent launch is
faster), and cuDNN's torch.nn.GRU in the same math mode beside the GRU rows (cuDNN / ours: above 1, ours faster).
A persistent forward that does not fit the device falls back to the per-step one with a warning: the child reports
it, and that row says so. Writes DIR/bench_persistent.csv when --out is given. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CASES = [("gru", "gru", 0, False), ("deep-transition", "lgru", 4, True), ("atr", "atr", 0, False)]


def build(cell: str, depth: int, ln: bool, H: int, backend: str):
    import dtmt_kernels as dk

    if cell == "atr":
        return dk.nn.ATR(H, H, layer_norm=ln, backend=backend)
    return dk.nn.DeepTransitionGRU(H, H, depth=depth, cell=cell, layer_norm=ln, backend=backend)


def child(mode: str, T: int, Bs, H: int, repeat: int) -> list:
    import torch

    from bench_cells import fwd_bwd, fwd_only, peak_memory_mb, time_fn

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name, cell, depth, ln in CASES:
        for B in Bs:
            torch.manual_seed(0)
            layer = build(cell, depth, ln, H, "cuda").cuda()
            reference = build(cell, depth, ln, H, "reference").cuda().double()
            reference.load_state_dict(layer.state_dict())
            x = torch.randn(T, B, H, device="cuda")
            lengths = torch.randint(1, T + 1, (B,), device="cuda")
            lengths[0] = T
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                out, h_n = layer(x, lengths=lengths)
            fell_back = any("does not fit" in str(w.message) for w in caught)
            with torch.no_grad():
                ref_out, ref_h = reference(x.double(), lengths=lengths)
            scale = max(ref_out.abs().max().item(), 1e-30)
            err = max((out.double() - ref_out).abs().max().item(), (h_n.double() - ref_h).abs().max().item()) / scale
            xg = x.clone().requires_grad_()
            row = dict(case=name, T=T, B=B, H=H, mode=mode, fell_back=fell_back, rel_err=err,
                       fwd_ms=1e3 * time_fn(fwd_only(layer, x), repeat, "cuda"),
                       fwd_bwd_ms=1e3 * time_fn(fwd_bwd(layer, xg), repeat, "cuda"),
                       peak_MB=peak_memory_mb(fwd_bwd(layer, xg)))
            if cell == "gru" and mode == "steps":   # cuDNN in the same (strict fp32) mode
                gru = torch.nn.GRU(H, H).cuda()
                row["cudnn_fwd_ms"] = 1e3 * time_fn(fwd_only(gru, x), repeat, "cuda")
                row["cudnn_fwd_bwd_ms"] = 1e3 * time_fn(fwd_bwd(gru, xg), repeat, "cuda")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=50)
    p.add_argument("--B", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["steps", "persistent"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_persistent: needs a CUDA device (the persistent kernels run on the GPU; the emulated tests in "
              "tests/test_cuda_sources.py check them on the CPU)", file=sys.stderr)
        return 2
    if a.child:
        child(a.child, a.T, a.B, a.H, a.repeat)
        return 0
    from bench_cells import machine_name

    results = {}
    for mode in ("steps", "persistent"):
        env = dict(os.environ, DTMT_CUDA_RECURRENCE=mode)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--T", str(a.T), "--B",
                            *map(str, a.B), "--H", str(a.H), "--repeat", str(a.repeat)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"bench_persistent: the {mode} run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                results[(row["case"], row["B"], mode)] = row
    print(f"# {machine_name('cuda')}; strict fp32 on every side (TF32 off); T={a.T}, H={a.H}; eager, median of "
          f"{a.repeat}; `python benchmarks/bench_persistent.py`")
    print("| case | B | steps fwd ms | persistent fwd ms | x fwd | steps fwd+bwd ms | persistent fwd+bwd ms | x fwd+bwd "
          "| cuDNN GRU fwd / fwd+bwd ms | rel. err (steps / persistent) | peak MB (steps / persistent) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for name, *_ in CASES:
        for B in a.B:
            s, q = results.get((name, B, "steps")), results.get((name, B, "persistent"))
            if s is None or q is None:
                continue
            cudnn = (f"{s['cudnn_fwd_ms']:.2f} / {s['cudnn_fwd_bwd_ms']:.2f}" if "cudnn_fwd_ms" in s else "")
            note = " (fell back: does not fit)" if q["fell_back"] else ""
            print(f"| {name}{note} | {B} | {s['fwd_ms']:.2f} | {q['fwd_ms']:.2f} | {s['fwd_ms'] / q['fwd_ms']:.2f} | "
                  f"{s['fwd_bwd_ms']:.2f} | {q['fwd_bwd_ms']:.2f} | {s['fwd_bwd_ms'] / q['fwd_bwd_ms']:.2f} | "
                  f"{cudnn} | {s['rel_err']:.1e} / {q['rel_err']:.1e} | {s['peak_MB']:.0f} / {q['peak_MB']:.0f} |")
            table.append({**{f"steps_{k}": v for k, v in s.items()}, **{f"persistent_{k}": v for k, v in q.items()}})
    if a.out and table:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_persistent.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted({k for row in table for k in row}))
            w.writeheader()
            w.writerows(table)
    bad = [k for k, row in results.items() if row["rel_err"] > 1e-4]
    if bad:
        print(f"bench_persistent: forward differs from the float64 reference by more than 1e-4 in {bad}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
