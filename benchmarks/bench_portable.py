"""The portable build against a -march=native build: forward+backward time of the cpp backend's layers.

    python benchmarks/bench_portable.py                    # builds the native variant first (DTMT_NATIVE=1), once
    python benchmarks/bench_portable.py --native-so PATH   # or compares with a _C extension built elsewhere
    python benchmarks/bench_portable.py --quick            # tiny grid, one round (smoke test)

The default build compiles the hot loops once per instruction set and picks one at run time (setup.py,
csrc/cpu_dispatch.cpp); a DTMT_NATIVE=1 build compiles everything for this machine. This times the layers of
bench_cells.py (deep transition with layer norm at each depth, GRU, ATR; T x B x H grid, input size H, float32)
on the cpp backend with three builds, each in a process of its own: this checkout's extension with the copy it
chooses ("portable"), the same with the baseline x86-64 copy forced (DTMT_CPU_ISA=baseline: what the vector
copies buy), and the native extension. The processes alternate, A B C, C A B, B C A, ..., for --rounds rounds,
so a drift of the machine's speed touches all three alike. `ms` is the median over the rounds of each process's
median of --repeat runs; `x native` = native time / this build's time in the same round (1.00: as fast, below:
slower), the median over the rounds, with their range.
Prints a table with the machine named and writes bench_portable.csv to --out.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("portable", "baseline", "native")


def load_kernels(path: str) -> None:
    """Make the extension at `path` the dtmt_kernels._C that dtmt_kernels imports (before dtmt_kernels is)."""
    import torch  # noqa: F401  (the extension links against torch's libraries)
    spec = importlib.util.spec_from_file_location("dtmt_kernels._C", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dtmt_kernels._C"] = module
    spec.loader.exec_module(module)


def build_native(out_dir: str) -> str:
    """Builds this checkout with DTMT_NATIVE=1 into out_dir (once; delete it to rebuild) and returns the _C path."""
    found = glob.glob(os.path.join(out_dir, "dtmt_kernels", "_C*.so"))
    if not found:
        env = dict(os.environ, DTMT_NATIVE="1", DTMT_NO_CUDA="1")
        print(f"# building the -march=native variant into {out_dir} (DTMT_NATIVE=1 python setup.py build_ext)")
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", out_dir, "--build-temp",
                        os.path.join(out_dir, "temp")], cwd=ROOT, env=env, check=True)
        found = glob.glob(os.path.join(out_dir, "dtmt_kernels", "_C*.so"))
    return found[0]


def configs(args):
    for T in args.T:
        for bh in args.BH:
            B, H = (int(v) for v in bh.split("x"))
            for depth in args.depths:
                yield "deep-transition", depth, T, B, H
            yield "gru", 0, T, B, H
            yield "atr", 0, T, B, H


def worker(args) -> None:
    """One process: times every configuration with the extension this process loaded; one JSON line each."""
    if args.kernels:
        load_kernels(args.kernels)
    import torch

    sys.path.insert(0, ROOT)
    from benchmarks.bench_cells import build, fwd_bwd
    from benchmarks.common import time_fn
    from dtmt_kernels import _C

    for kind, depth, T, B, H in configs(args):
        torch.manual_seed(0)
        x = torch.randn(T, B, H, requires_grad=True)
        layer = build(kind, H, H, depth, "cpp")
        ms = 1e3 * time_fn(fwd_bwd(layer, x), args.repeat)
        print(json.dumps(dict(kind=kind, depth=depth, T=T, B=B, H=H, ms=ms, isa=_C.cpu_isa(), so=_C.__file__)))


def run_variant(variant: str, native_so: str, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--repeat", str(args.repeat), "--T",
           *map(str, args.T), "--BH", *args.BH, "--depths", *map(str, args.depths)]
    env = {k: v for k, v in os.environ.items() if k != "DTMT_CPU_ISA"}
    if variant == "native":
        cmd += ["--kernels", native_so]
    elif variant == "baseline":
        env["DTMT_CPU_ISA"] = "baseline"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--native-so", default=None, help="a _C extension built with DTMT_NATIVE=1 (default: build one "
                   "into OUT/native_build)")
    p.add_argument("--T", type=int, nargs="+", default=[50], help="sequence lengths")
    p.add_argument("--BH", nargs="+", default=["16x128", "64x256"], help="batch x hidden sizes")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 4], help="T-GRU depths of the deep transition")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per process (median)")
    p.add_argument("--rounds", type=int, default=3, help="processes per build, alternated")
    p.add_argument("--quick", action="store_true", help="tiny grid, one round (smoke test)")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="directory for bench_portable.csv")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernels", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from benchmarks.common import batch_hidden_sizes, check_options

    check_options(p, args, (("T", 1), ("depths", 0), ("repeat", 1), ("rounds", 1)))
    if args.quick:   # (the options not given: one given with it had been replaced without a word)
        for name, value in dict(T=[5], BH=["2x16"], depths=[1], repeat=1, rounds=1).items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    batch_hidden_sizes(p, args.BH)   # (each process's int() failed after the native build: a traceback)
    if args.native_so is not None and not os.path.isfile(args.native_so):
        p.error(f"--native-so {args.native_so}: no such file")
    if args.worker:
        return worker(args)

    from benchmarks.common import machine_name, write_csv

    native_so = args.native_so or build_native(os.path.join(args.out, "native_build"))
    times = {}  # (variant, config) -> per-round medians
    isa = {}
    for r in range(args.rounds):
        k = r % len(VARIANTS)
        for variant in VARIANTS[k:] + VARIANTS[:k]:
            for row in run_variant(variant, native_so, args):
                key = (row["kind"], row["depth"], row["T"], row["B"], row["H"])
                times.setdefault((variant, key), []).append(row["ms"])
                isa[variant] = row["isa"]
    rows = []
    for key in configs(args):
        native = times[("native", key)]
        for v in VARIANTS:
            ratios = [n / t for n, t in zip(native, times[(v, key)])]  # within each round
            rows.append(dict(zip(("kind", "depth", "T", "B", "H"), key), build=v, isa=isa[v],
                             ms=statistics.median(times[(v, key)]), vs_native=statistics.median(ratios),
                             vs_native_min=min(ratios), vs_native_max=max(ratios)))
    machine = machine_name()
    print(f"# machine: {machine}")
    print(f"# builds: portable = this checkout ({isa['portable']} copy chosen), baseline = the same with "
          f"DTMT_CPU_ISA=baseline, native = {native_so}; {args.rounds} rounds x median of {args.repeat}")
    header = ["kind", "depth", "T", "B", "H", "native ms", "portable ms", "x native (range)", "baseline ms",
              "x native (range)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    by = {(r["build"],) + tuple(r[c] for c in ("kind", "depth", "T", "B", "H")): r for r in rows}

    def ratio(r):
        return f"{r['vs_native']:.3f} ({r['vs_native_min']:.2f}-{r['vs_native_max']:.2f})"

    for key in configs(args):
        nat, por, bas = (by[(v,) + key] for v in ("native", "portable", "baseline"))
        print(f"| {' | '.join(map(str, key))} | {nat['ms']:.1f} | {por['ms']:.1f} | {ratio(por)} | "
              f"{bas['ms']:.1f} | {ratio(bas)} |")
    for v in ("portable", "baseline"):
        ratios = [r["vs_native"] for r in rows if r["build"] == v]
        print(f"# {v}: geometric mean x native {statistics.geometric_mean(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}")
    path = write_csv(os.path.join(args.out, "bench_portable.csv"), rows,
                     ["kind", "depth", "T", "B", "H", "build", "isa", "ms", "vs_native", "vs_native_min",
                      "vs_native_max"])
    print(f"# wrote {path}")
    return rows


if __name__ == "__main__":
    main()
