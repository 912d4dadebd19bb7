"""Forward+backward speed and saved-for-backward memory of the recurrent layers, by backend.

    python benchmarks/bench_cells.py                 # default grid, prints a table, writes CSV + PNG
    python benchmarks/bench_cells.py --quick         # a small grid (seconds), as the tests run it
    python benchmarks/bench_cells.py --device cuda   # GPU: triton, cuda, reference (eager), cuDNN GRU

For every (T, B, H) of the grid it times, in one run:
  - the deep transition block (L-GRU + `depth` T-GRUs, per-gate layer norm) on the reference and cpp backends
  - the plain GRU (depth 0, no layer norm) on reference and cpp, and torch.nn.GRU
  - ATR on reference and cpp
and it measures the machine's GEMM rate in the same run twice: a large square GEMM (peak) and exactly the
GEMMs the fused kernel performs for that configuration, timed alone ("shape-matched"). `gemm_eff` is the
shape-matched GEMMs' time over the layer's time (the layer's GEMM FLOPs per second over the shape-matched rate):
what share of the layer's time its GEMMs would take at the rate they run alone. It is a ratio of two timings taken
apart, not a measured share, and nothing bounds it by 100%: above 100% the GEMMs alone took longer than the whole
layer, which says that one of the two timings was disturbed (a single repetition, as --quick takes, on a busy
machine: 224 ms for GEMMs that take 0.2 ms, seen on a shared 2-core VM) or, at tiny sizes, that the GEMMs' own
per-call costs outweigh the layer's; the table then says so below it.
`saved_B` is the bytes autograd keeps for backward per step and sequence (parameters and the input not
counted; tensors sharing storage counted once).

With `--device cuda` the implementations are the GPU backends that are available (triton, cuda) against the
eager reference and cuDNN's torch.nn.GRU, each timed forward+backward and forward only (under no_grad),
with CUDA synchronisation around every timed call; `peak_MB` is the peak CUDA memory allocated during one
forward+backward beyond what was allocated before it, `x_gru` compares with cuDNN (`vs_cudnn_gru`), and
`--dtype` selects float32 / bfloat16 / float16. Default GPU grid: T=50, B x H in {8x512, 64x512}.
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
from common import (batch_hidden_sizes, check_options, machine_name, make_out_dir, provenance,  # noqa: E402
                    provenance_line, time_fn, write_csv)
from dtmt_kernels.nn import CELL_ROWS  # noqa: E402


def fwd_only(layer, x):
    def run():
        with torch.no_grad():
            layer(x)
    return run


def peak_memory_mb(fn) -> float:
    """Peak CUDA memory allocated by one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def fwd_bwd(layer, x):
    """One forward and backward of `layer` on x, the output's gradient a dense tensor of ones made at the first call
    and kept, as a network's loss gives it. (`out.sum().backward()`, as before, hands the layer a stride-0 expansion:
    a layer whose kernels read dense gradients copies it whole, a tensor of the output's size that autograd's own
    ops never make, so that the peak memory of forward + backward compared a copy with none: ATR at B = 256, 182
    against the reference backend's 175 MB on an H200, 2026-11-30.)"""
    grad = []

    def run():
        layer.zero_grad(set_to_none=True)
        out, h_n = layer(x)
        if not grad:
            grad.append(torch.ones_like(out))
        out.backward(grad[0])
    return run


def saved_bytes(layer, x) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters and x excluded)."""
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    del out
    return sum(seen.values())


def gemm_flops(cell: str, depth: int, T: int, B: int, I: int, H: int) -> float:
    """FLOPs of the GEMMs of one forward + backward: the forward GEMMs, then two of the same size each for
    the input gradient and the weight gradient."""
    n_in, n_h, _ = CELL_ROWS[cell]
    forward = 2 * T * B * I * n_in * H + T * (2 * B * H * n_h * H + depth * 2 * B * H * 3 * H)
    return 3.0 * forward


def shape_matched_gemm_time(cell: str, depth: int, T: int, B: int, I: int, H: int, repeat: int,
                            device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Time of exactly the GEMMs the fused kernel runs, alone, with the same calls it makes."""
    n_in, n_h, _ = CELL_ROWS[cell]
    kw = dict(device=device, dtype=dtype)
    x = torch.randn(T * B, I, **kw)
    w_ih, b_ih = torch.randn(n_in * H, I, **kw), torch.randn(n_in * H, **kw)
    w_hh, b_hh = torch.randn(n_h * H, H, **kw) * 0.01, torch.randn(n_h * H, **kw)
    t_w = [torch.randn(3 * H, H, **kw) * 0.01 for _ in range(depth)]
    t_b = torch.randn(3 * H, **kw)
    h = torch.randn(B, H, **kw)
    hp = torch.empty(T, B, n_h * H, **kw)
    hpt = torch.empty(max(depth, 1), T, B, 3 * H, **kw)
    dh = torch.empty(B, H, **kw)
    h_all = h.repeat(T, 1)

    def run():
        xp = torch.addmm(b_ih, x, w_ih.t())
        for t in range(T):
            torch.addmm(b_hh, h, w_hh.t(), out=hp[t])
            for k in range(depth):
                torch.addmm(t_b, h, t_w[k].t(), out=hpt[k, t])
        for t in range(T):
            for k in range(depth):
                dh.addmm_(hpt[k, t], t_w[k])
            dh.addmm_(hp[t], w_hh)
        xp.mm(w_ih)
        xp.t().mm(x)
        hp.view(T * B, -1).t().mm(h_all)
        for k in range(depth):
            hpt[k].view(T * B, -1).t().mm(h_all)
    return time_fn(run, repeat, device)


def peak_gemm_rate(repeat: int, n: int = 1024, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / time_fn(lambda: a.mm(b), repeat, device)


def build(kind: str, I: int, H: int, depth: int, backend: str):
    if kind == "deep-transition":
        return dk.nn.DeepTransitionGRU(I, H, depth=depth, cell="lgru", layer_norm=True, backend=backend)
    if kind == "gru":
        return dk.nn.DeepTransitionGRU(I, H, depth=0, cell="gru", layer_norm=False, backend=backend)
    if kind == "atr":
        return dk.nn.ATR(I, H, backend=backend)
    raise ValueError(kind)


def gpu_impls():
    """The GPU backends this process can run, in the order they are reported."""
    return [b for b in ("triton", "cuda") if b in dk.available_backends()]


def run_grid_cuda(grid, depths, repeat: int, dtype: torch.dtype = torch.float32, with_reference: bool = True,
                  device: str = "cuda", peak_n: int = 4096):
    """--device cuda: every available GPU backend, the eager reference and cuDNN, fwd+bwd and fwd only.

    `device` is "cuda" from the command line; the tests pass "cpu" with TRITON_INTERPRET=1 (the triton
    backend then runs on CPU tensors, and torch.nn.GRU is ATen's CPU GRU) so that this path, which otherwise
    runs only on a lent GPU, goes through the same code in CI. peak_MB is NaN off CUDA."""
    rows = []
    peak = peak_gemm_rate(repeat, peak_n, device, dtype)
    impls = (["reference"] if with_reference else []) + gpu_impls()
    for T, B, H in grid:
        I = H
        x = torch.randn(T, B, I, device=device, dtype=dtype, requires_grad=True)
        configs = [("deep-transition", d) for d in depths] + [("gru", 0), ("atr", 0)]
        for kind, depth in configs:
            cell = {"deep-transition": "lgru", "gru": "gru", "atr": "atr"}[kind]
            flops = gemm_flops(cell, depth, T, B, I, H)
            gemm_t = shape_matched_gemm_time(cell, depth, T, B, I, H, repeat, device, dtype)
            layers = [(impl, build(kind, I, H, depth, impl).to(device, dtype)) for impl in impls]
            if kind == "gru":
                layers.append(("torch.nn.GRU", torch.nn.GRU(I, H).to(device, dtype)))
            for impl, layer in layers:
                for mode in ("fwd+bwd", "fwd"):
                    fn = fwd_bwd(layer, x) if mode == "fwd+bwd" else fwd_only(layer, x)
                    t = time_fn(fn, repeat, device)
                    work = flops if mode == "fwd+bwd" else flops / 3
                    rows.append(dict(kind=kind, depth=depth, T=T, B=B, H=H, impl=impl, mode=mode, ms=1e3 * t,
                                     gflops=work / t / 1e9,
                                     gemm_eff=gemm_t / t if mode == "fwd+bwd" else float("nan"),
                                     saved_B=saved_bytes(layer, x) / (T * B) if mode == "fwd+bwd" else float("nan"),
                                     peak_MB=peak_memory_mb(fn) if device == "cuda" else float("nan"),
                                     gemm_ms=1e3 * gemm_t, peak_gflops=peak / 1e9,
                                     dtype=str(dtype).replace("torch.", "")))
    return rows


def run_grid(grid, depths, repeat: int, with_reference: bool = True):
    rows = []
    peak = peak_gemm_rate(repeat)
    for T, B, H in grid:
        I = H
        x = torch.randn(T, B, I, requires_grad=True)
        configs = [("deep-transition", d) for d in depths] + [("gru", 0), ("atr", 0)]
        for kind, depth in configs:
            cell = {"deep-transition": "lgru", "gru": "gru", "atr": "atr"}[kind]
            flops = gemm_flops(cell, depth, T, B, I, H)
            gemm_t = shape_matched_gemm_time(cell, depth, T, B, I, H, repeat)
            impls = (["reference"] if with_reference else []) + ["cpp"]
            for impl in impls:
                layer = build(kind, I, H, depth, impl)
                t = time_fn(fwd_bwd(layer, x), repeat)
                rows.append(dict(kind=kind, depth=depth, T=T, B=B, H=H, impl=impl, ms=1e3 * t,
                                 gflops=flops / t / 1e9, gemm_eff=gemm_t / t,
                                 saved_B=saved_bytes(layer, x) / (T * B), gemm_ms=1e3 * gemm_t,
                                 peak_gflops=peak / 1e9))
            if kind == "gru":
                gru = torch.nn.GRU(I, H)
                t = time_fn(fwd_bwd(gru, x), repeat)
                rows.append(dict(kind=kind, depth=0, T=T, B=B, H=H, impl="torch.nn.GRU", ms=1e3 * t,
                                 gflops=flops / t / 1e9, gemm_eff=gemm_t / t,
                                 saved_B=saved_bytes(gru, x) / (T * B), gemm_ms=1e3 * gemm_t,
                                 peak_gflops=peak / 1e9))
    return rows


def add_ratios(rows, device: str = "cpu"):
    """speedup = reference time / this time, at the same config (and mode); vs_cpp_gru = cpp GRU time / this
    time (CPU) or vs_cudnn_gru = torch.nn.GRU (cuDNN) time / this time (CUDA)."""
    gru_impl, gru_key = ("cpp", "vs_cpp_gru") if device == "cpu" else ("torch.nn.GRU", "vs_cudnn_gru")
    ref = {(r["kind"], r["depth"], r["T"], r["B"], r["H"], r.get("mode")): r["ms"] for r in rows
           if r["impl"] == "reference"}
    gru = {(r["T"], r["B"], r["H"], r.get("mode")): r["ms"] for r in rows
           if r["impl"] == gru_impl and r["kind"] == "gru"}
    for r in rows:
        base = ref.get((r["kind"], r["depth"], r["T"], r["B"], r["H"], r.get("mode")))
        r["speedup_vs_ref"] = base / r["ms"] if base else float("nan")
        g = gru.get((r["T"], r["B"], r["H"], r.get("mode")))
        r[gru_key] = g / r["ms"] if g else float("nan")
    return rows


COLUMNS = ["kind", "depth", "T", "B", "H", "impl", "ms", "speedup_vs_ref", "vs_cpp_gru", "gflops", "gemm_eff",
           "saved_B", "gemm_ms", "peak_gflops"]
COLUMNS_CUDA = ["kind", "depth", "T", "B", "H", "impl", "mode", "dtype", "ms", "speedup_vs_ref", "vs_cudnn_gru",
                "gflops", "gemm_eff", "saved_B", "peak_MB", "gemm_ms", "peak_gflops"]


def _fmt(v: float, spec: str) -> str:
    return "-" if v != v else format(v, spec)  # NaN: not measured in this mode


def math_mode(math: str, dtype: str) -> str:
    """Each side's arithmetic, in words, for a GPU table's header (issue 72 item 1: like for like, or said)."""
    if dtype != "float32":
        return (f"math: {dtype} storage on every side, products accumulated in float32 (cuBLAS, cuDNN and our "
                f"kernels)")
    if math == "strict":
        return "math: strict fp32 on every side (TF32 off for cuBLAS and cuDNN; our kernels fp32 FMA)"
    return ("math: torch's fast mode (TF32 allowed): cuBLAS and cuDNN on TF32 tensor cores; our per-step kernels "
            "still fp32 FMA, the ATen GEMMs they call TF32, the persistent launches' products TF32")


def print_table(rows, machine, device: str = "cpu"):
    print(f"# machine: {machine}")
    if device == "cuda":
        header = ["kind", "depth", "T", "B", "H", "impl", "mode", "ms", "x_ref", "x_cudnn_gru", "GFLOP/s",
                  "gemm_eff", "saved B/step/seq", "peak MB"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print(f"| {r['kind']} | {r['depth']} | {r['T']} | {r['B']} | {r['H']} | {r['impl']} | {r['mode']} | "
                  f"{r['ms']:.2f} | {r['speedup_vs_ref']:.2f} | {r['vs_cudnn_gru']:.2f} | {r['gflops']:.0f} | "
                  f"{_fmt(r['gemm_eff'], '.0%')} | {_fmt(r['saved_B'], '.0f')} | {_fmt(r['peak_MB'], '.1f')} |")
        peak = rows[0]["peak_gflops"] if rows else float("nan")
        print(f"# dtype {rows[0]['dtype'] if rows else '-'}; peak GEMM rate (4096^3 in that dtype, same run): "
              f"{peak:.0f} GFLOP/s")
        note_gemm_eff(rows)
        return
    header = ["kind", "depth", "T", "B", "H", "impl", "ms", "x_ref", "x_gru", "GFLOP/s", "gemm_eff", "saved B/step/seq"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['kind']} | {r['depth']} | {r['T']} | {r['B']} | {r['H']} | {r['impl']} | {r['ms']:.1f} | "
              f"{r['speedup_vs_ref']:.2f} | {r['vs_cpp_gru']:.2f} | {r['gflops']:.1f} | {r['gemm_eff']:.0%} | "
              f"{r['saved_B']:.0f} |")
    peak = rows[0]["peak_gflops"] if rows else float("nan")
    print(f"# peak GEMM rate (1024^3 sgemm, same run): {peak:.1f} GFLOP/s")
    note_gemm_eff(rows)


def note_gemm_eff(rows) -> None:
    """A line below the table where a row's gemm_eff is above 100%: not a share, a disturbed timing (the module's
    docstring); nothing where every row is at most 100%."""
    over = [r for r in rows if r["gemm_eff"] == r["gemm_eff"] and r["gemm_eff"] > 1]
    if over:
        print(f"# gemm_eff above 100% in {len(over)} row(s): the shape-matched GEMMs, timed apart, took longer than "
              f"the whole layer (gemm_ms up to {max(r['gemm_ms'] for r in over):.1f}): one of the two timings was "
              f"disturbed (repetitions: see --repeat), not a share of the time; rerun with more repetitions")


def plot(rows, path, machine):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot written")
        return
    labels, series = [], {}
    for r in rows:
        label = f"{r['kind']}{'-d' + str(r['depth']) if r['kind'] == 'deep-transition' else ''}\nT{r['T']} B{r['B']} H{r['H']}"
        if label not in labels:
            labels.append(label)
        if r.get("mode", "fwd+bwd") != "fwd+bwd":
            continue
        series.setdefault(r["impl"], {})[label] = r["ms"]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(labels)), 4.5))
    width = 0.8 / len(series)
    for i, (impl, vals) in enumerate(series.items()):
        xs = [j + i * width for j, lab in enumerate(labels) if lab in vals]
        ax.bar(xs, [vals[lab] for lab in labels if lab in vals], width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("forward+backward time (ms, log)")
    ax.set_title(f"bench_cells: {machine}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: reference, cpp, torch.nn.GRU; cuda: reference, triton, cuda, cuDNN torch.nn.GRU")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="input / parameter dtype (--device cuda only)")
    p.add_argument("--math", default="strict", choices=["strict", "tf32"],
                   help="--device cuda, float32: strict fp32 on every side (TF32 off for cuBLAS and cuDNN; the "
                        "default) or torch's fast mode (TF32 allowed: cuBLAS and cuDNN use tensor cores). The table "
                        "names the mode of each side.")
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths (default 50; --quick: 5)")
    p.add_argument("--BH", nargs="+", default=None,
                   help="batch x hidden sizes, e.g. 64x256 (default 16x128 64x256 on cpu, 8x512 64x512 on cuda; "
                        "--quick: 2x16)")
    p.add_argument("--depths", type=int, nargs="+", default=None,
                   help="T-GRU depths of the deep transition (default 1 4; --quick: 1)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed repetitions, median reported (default 5; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="tiny grid, one repetition (smoke test): the defaults of --T, --BH, --depths and --repeat, "
                        "which still apply where given")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="directory for bench_cells.csv/.png")
    args = p.parse_args(argv)
    # (--quick had replaced a --T, --BH, --depths or --repeat given with it, without a word)
    defaults = (dict(T=[5], BH=["2x16"], depths=[1], repeat=1) if args.quick else
                dict(T=[50], BH=["8x512", "64x512"] if args.device == "cuda" else ["16x128", "64x256"], depths=[1, 4],
                     repeat=5))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_options(p, args, (("T", 1), ("depths", 0), ("repeat", 1)), device="device")
    sizes = batch_hidden_sizes(p, args.BH)
    grid = [(T, b, h) for T in args.T for b, h in sizes]
    if args.device == "cpu":   # (refused before anything runs, as the --out below)
        if args.dtype != "float32":
            p.error("--dtype applies to --device cuda (the cpu kernels take float32 / float64)")
        if args.math != "strict":
            p.error("--math applies to --device cuda")
    make_out_dir(p, args.out)   # (a file there was a FileExistsError after the whole grid had been timed)
    record = provenance(__file__, argv, args.device)
    print(provenance_line(record), flush=True)
    if args.device == "cuda":   # (one with no CUDA device: refused by check_options)
        if not gpu_impls():
            print(f"# no GPU backend is available ({dk.available_backends()}): timing the reference and cuDNN only")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.math == "tf32"
        machine = f"{machine_name('cuda')}; {math_mode(args.math, args.dtype)}"
        rows = add_ratios(run_grid_cuda(grid, args.depths, args.repeat, getattr(torch, args.dtype)), "cuda")
        columns, name = COLUMNS_CUDA, "bench_cells_cuda"
    else:
        machine = machine_name()
        rows = add_ratios(run_grid(grid, args.depths, args.repeat))
        columns, name = COLUMNS, "bench_cells"
    print_table(rows, machine, args.device)
    write_csv(os.path.join(args.out, f"{name}.csv"), rows, columns, comment=provenance_line(record))
    plot(rows, os.path.join(args.out, f"{name}.png"), machine)
    print(f"# wrote {os.path.join(args.out, name + '.csv')} and {name}.png")
    return rows


if __name__ == "__main__":
    main()
