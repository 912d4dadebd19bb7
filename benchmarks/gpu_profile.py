"""Where a GPU backend's time goes in one recurrent layer: the host launching work, or the device doing it.

    python benchmarks/gpu_profile.py                       # on a CUDA machine: T=50, H=512, B 1 8 64, float32
    python benchmarks/gpu_profile.py --B 8 --backends cuda --dtype bfloat16
    DTMT_CUDA_RECURRENCE=persistent python benchmarks/gpu_profile.py --backends cuda --math tf32

For each layer (GRU: depth 0, no layer norm; DT: L-GRU depth 4 with layer norm; ATR) and batch size, one
forward + backward (the output summed, as in bench_cells.py) with each backend, reported as:
  eager_ms    wall time of the fwd+bwd as a user calls it (median of --repeat, synchronised)
  kernel_ms   the summed durations of the GPU kernels and copies of one fwd+bwd (torch.profiler): the device's
              own work; eager_ms - kernel_ms is time the device waits for the host
  launches    kernels and copies in one fwd+bwd
  host_us     (eager_ms - kernel_ms) per launch: the host's cost of one launch and its bookkeeping
  graph_ms    the same fwd+bwd replayed as a CUDA graph (torch.cuda.make_graphed_callables), i.e. with the
              host's per-launch cost gone; "-" with the reason if the layer cannot be captured
  cudnn_ms    torch.nn.GRU (cuDNN) of the same size, fwd+bwd, eager and graphed, on the GRU rows
With --kernels N, a second table follows: for each row, its N kernels of most device time in one fwd+bwd
(name, calls, summed ms, share of kernel_ms), to tell which of a backend's kernels make its device time.
The device is named in the first line, with the math mode of every side (--math: strict fp32, TF32 off for cuBLAS
and cuDNN as for our kernels, the default; or torch's fast mode, TF32 allowed on every side) and the cuda
backend's recurrence (DTMT_CUDA_RECURRENCE: the per-step path, or the persistent launches in either form). With
--device cpu (a test of this script) the profiler sees no kernels and no graph is captured.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import dtmt_kernels as dk  # noqa: E402
from bench_cells import build, fwd_bwd, math_mode  # noqa: E402
from common import machine_name, time_fn  # noqa: E402

KINDS = {"GRU": ("gru", 0), "DT": ("deep-transition", 4), "ATR": ("atr", 0)}   # -> bench_cells.build(kind, depth)


def layer_for(kind: str, H: int, backend: str):
    if kind == "cuDNN":
        return torch.nn.GRU(H, H)
    name, depth = KINDS[kind]
    return build(name, H, H, depth, backend)


def wall_ms(fn, repeat: int, device: str) -> float:
    return 1e3 * time_fn(fn, repeat, device)


def device_work(fn, device: str):
    """(summed kernel and copy durations in ms, their count, {kernel name: [calls, ms]}) of one call of fn."""
    from torch.autograd import DeviceType
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type in (DeviceType.CUDA,)]
    by_name: dict[str, list] = {}
    for e in kern:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us() / 1e3
    return sum(e.time_range.elapsed_us() for e in kern) / 1e3, len(kern), by_name


def graphed_ms(kind: str, H: int, backend: str, x, repeat: int) -> str:
    """fwd+bwd replayed as a CUDA graph, or '- (reason)'."""
    try:
        layer = layer_for(kind, H, backend).to(x.device, x.dtype)
        graphed = torch.cuda.make_graphed_callables(layer, (x,))
        return f"{wall_ms(fwd_bwd(graphed, x), repeat, 'cuda'):.2f}"
    except Exception as e:  # reported in the table: a layer that cannot be captured is a finding too
        return f"- ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:60]})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=50)
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--B", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--backends", nargs="+", default=None, help="default: every GPU backend built (cuda, triton)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--math", default="strict", choices=["strict", "tf32"],
                   help="float32: strict fp32 on every side (TF32 off for cuBLAS and cuDNN; the default) or torch's "
                        "fast mode (TF32 allowed: cuBLAS, cuDNN and the persistent launches' products on tensor "
                        "cores)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also list each row's N kernels of most device time (default 0: none)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    backends = a.backends or ([b for b in ("cuda", "triton") if b in dk.available_backends()] if a.device == "cuda"
                              else ["cpp"])
    dtype = getattr(torch, a.dtype)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.math == "tf32"
    recurrence = os.environ.get("DTMT_CUDA_RECURRENCE") or "steps"
    print(f"# {machine_name(a.device)}; T={a.T}, H={a.H}, {a.dtype}, fwd+bwd, median of {a.repeat}; "
          f"{math_mode(a.math, a.dtype)}; the cuda backend's recurrence: DTMT_CUDA_RECURRENCE={recurrence}")
    print("| layer | B | impl | eager_ms | kernel_ms | launches | host_us | graph_ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    top = []   # (row label, kernel_ms, {name: [calls, ms]}) for --kernels
    failed = 0   # rows that failed: said in the table, and the exit status (every row failing had exited 0)
    for kind in a.kinds:
        for B in a.B:
            torch.manual_seed(0)
            x = torch.randn(a.T, B, a.H, device=a.device, dtype=dtype, requires_grad=True)
            impls = [(b, b) for b in backends] + ([("cuDNN", "-")] if kind == "GRU" else [])
            for name, backend in impls:
                k = "cuDNN" if name == "cuDNN" else kind
                try:
                    layer = layer_for(k, a.H, backend).to(a.device, dtype)
                    fn = fwd_bwd(layer, x)
                    eager = wall_ms(fn, a.repeat, a.device)
                    kern, n, by_name = device_work(fn, a.device)
                    top.append((f"{kind} B={B} {name}", kern, by_name))
                    host = 1e3 * (eager - kern) / n if n else float("nan")
                    graph = graphed_ms(k, a.H, backend, x, a.repeat) if a.device == "cuda" else "-"
                    print(f"| {kind} | {B} | {name} | {eager:.2f} | {kern:.2f} | {n} | {host:.1f} | {graph} |",
                          flush=True)
                except Exception as e:
                    failed += 1
                    first = (str(e).splitlines() or [""])[0][:80]
                    print(f"| {kind} | {B} | {name} | failed: {type(e).__name__}: {first} |||||", flush=True)
    if a.kernels > 0 and top:
        print(f"\n## The {a.kernels} kernels of most device time in each row (one fwd+bwd)")
        print("| row | kernel | calls | ms | share |")
        print("|---|---|---:|---:|---:|")
        for label, kern, by_name in top:
            ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.kernels]
            for kname, (calls, ms) in ranked:
                share = f"{100 * ms / kern:.0f}%" if kern else "-"
                print(f"| {label} | {kname[:90]} | {calls} | {ms:.2f} | {share} |")
    if failed:
        raise SystemExit(f"gpu_profile: {failed} row(s) failed (said in the table)")


if __name__ == "__main__":
    main()
