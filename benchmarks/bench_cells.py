"""Forward+backward speed and saved-for-backward memory of the recurrent layers, by backend.

    python benchmarks/bench_cells.py                 # default grid, prints a table, writes CSV + PNG
    python benchmarks/bench_cells.py --quick         # a small grid (seconds), as the tests run it

For every (T, B, H) of the grid it times, in one run:
  - the deep transition block (L-GRU + `depth` T-GRUs, per-gate layer norm) on the reference and cpp backends
  - the plain GRU (depth 0, no layer norm) on reference and cpp, and torch.nn.GRU
  - ATR on reference and cpp
and it measures the machine's GEMM rate in the same run twice: a large square GEMM (peak) and exactly the
GEMMs the fused kernel performs for that configuration, timed alone ("shape-matched"). `gemm_eff` is the
fused run's GEMM FLOPs per second over the shape-matched rate: the share of the time that is GEMM work.
`saved_B` is the bytes autograd keeps for backward per step and sequence (parameters and the input not
counted; tensors sharing storage counted once).
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import dtmt_kernels as dk  # noqa: E402
from dtmt_kernels.nn import CELL_ROWS  # noqa: E402


def machine_name() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def time_fn(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fwd_bwd(layer, x):
    def run():
        layer.zero_grad(set_to_none=True)
        out, h_n = layer(x)
        out.sum().backward()
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


def shape_matched_gemm_time(cell: str, depth: int, T: int, B: int, I: int, H: int, repeat: int) -> float:
    """Time of exactly the GEMMs the fused kernel runs, alone, with the same calls it makes."""
    n_in, n_h, _ = CELL_ROWS[cell]
    x = torch.randn(T * B, I)
    w_ih, b_ih = torch.randn(n_in * H, I), torch.randn(n_in * H)
    w_hh, b_hh = torch.randn(n_h * H, H) * 0.01, torch.randn(n_h * H)
    t_w = [torch.randn(3 * H, H) * 0.01 for _ in range(depth)]
    t_b = torch.randn(3 * H)
    h = torch.randn(B, H)
    hp = torch.empty(T, B, n_h * H)
    hpt = torch.empty(max(depth, 1), T, B, 3 * H)
    dh = torch.empty(B, H)
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
    return time_fn(run, repeat)


def peak_gemm_rate(repeat: int, n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / time_fn(lambda: a.mm(b), repeat)


def build(kind: str, I: int, H: int, depth: int, backend: str):
    if kind == "deep-transition":
        return dk.nn.DeepTransitionGRU(I, H, depth=depth, cell="lgru", layer_norm=True, backend=backend)
    if kind == "gru":
        return dk.nn.DeepTransitionGRU(I, H, depth=0, cell="gru", layer_norm=False, backend=backend)
    if kind == "atr":
        return dk.nn.ATR(I, H, backend=backend)
    raise ValueError(kind)


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


def add_ratios(rows):
    """speedup = reference time / this time, at the same config; vs_gru = cpp GRU time / this time."""
    ref = {(r["kind"], r["depth"], r["T"], r["B"], r["H"]): r["ms"] for r in rows if r["impl"] == "reference"}
    gru = {(r["T"], r["B"], r["H"]): r["ms"] for r in rows if r["impl"] == "cpp" and r["kind"] == "gru"}
    for r in rows:
        base = ref.get((r["kind"], r["depth"], r["T"], r["B"], r["H"]))
        r["speedup_vs_ref"] = base / r["ms"] if base else float("nan")
        g = gru.get((r["T"], r["B"], r["H"]))
        r["vs_cpp_gru"] = g / r["ms"] if g else float("nan")
    return rows


COLUMNS = ["kind", "depth", "T", "B", "H", "impl", "ms", "speedup_vs_ref", "vs_cpp_gru", "gflops", "gemm_eff",
           "saved_B", "gemm_ms", "peak_gflops"]


def print_table(rows, machine):
    print(f"# machine: {machine}")
    header = ["kind", "depth", "T", "B", "H", "impl", "ms", "x_ref", "x_gru", "GFLOP/s", "gemm_eff", "saved B/step/seq"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['kind']} | {r['depth']} | {r['T']} | {r['B']} | {r['H']} | {r['impl']} | {r['ms']:.1f} | "
              f"{r['speedup_vs_ref']:.2f} | {r['vs_cpp_gru']:.2f} | {r['gflops']:.1f} | {r['gemm_eff']:.0%} | "
              f"{r['saved_B']:.0f} |")
    peak = rows[0]["peak_gflops"] if rows else float("nan")
    print(f"# peak GEMM rate (1024^3 sgemm, same run): {peak:.1f} GFLOP/s")


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in COLUMNS})


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
    p.add_argument("--device", default="cpu", choices=["cpu"], help="cpu (GPU backends: a later issue)")
    p.add_argument("--T", type=int, nargs="+", default=[50], help="sequence lengths")
    p.add_argument("--BH", nargs="+", default=["16x128", "64x256"], help="batch x hidden sizes, e.g. 64x256")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 4], help="T-GRU depths of the deep transition")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--quick", action="store_true", help="tiny grid, one repetition (smoke test)")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="directory for bench_cells.csv/.png")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.BH, args.depths, args.repeat = [5], ["2x16"], [1], 1
    grid = [(T, int(bh.split("x")[0]), int(bh.split("x")[1])) for T in args.T for bh in args.BH]
    machine = machine_name()
    rows = add_ratios(run_grid(grid, args.depths, args.repeat))
    print_table(rows, machine)
    os.makedirs(args.out, exist_ok=True)
    write_csv(rows, os.path.join(args.out, "bench_cells.csv"))
    plot(rows, os.path.join(args.out, "bench_cells.png"), machine)
    print(f"# wrote {os.path.join(args.out, 'bench_cells.csv')} and bench_cells.png")
    return rows


if __name__ == "__main__":
    main()
