"""What the ops' argument checks (csrc/op_checks.h, issue 71 item 1) cost per call, in instructions counted by
callgrind (repeatable on a noisy VM):

    python benchmarks/bench_op_checks.py [--calls 50] [--out DIR]

Runs itself under `valgrind --tool=callgrind`, once per op, on one thread: `rnmt_step` of the small dtmt preset's
decoder at batch 1, beam 4 (the step a search makes most often, and the op with the most checks: two cells, the
attention's and the readout's weights, four Tensor[] lists made contiguous), and `transition_forward` of one
L-GRU + T-GRU layer over 30 positions of 1 sentence (the smallest sequence call). From callgrind_annotate's
inclusive counts it reports, per call, the instructions of the op's kernel (rnmt_step_cpu /
transition_forward_cpu) and of the checks made before it (check_cell through cell_weights, the weights'
from_list, the lists' dense / check_sequence), and the checks' share of the two.
Without valgrind on PATH it says so and exits 2. Output: OUT/bench_op_checks.md and .json.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# per op: its kernel, and the functions whose inclusive counts are its checks (in a run of that op alone)
KERNELS = {"rnmt_step": "dtmt::rnmt_step_cpu(", "transition_forward": "dtmt::transition_forward_cpu("}
CHECKS = {
    "rnmt_step": ("dtmt::check_cell(", "dtmt::AttentionWeights::from_list(", "dtmt::ReadoutWeights::from_list(",
                  "dense(c10::ArrayRef<at::Tensor>)"),
    "transition_forward": ("check_sequence(",),
}


def workload(calls: int, op: str = "") -> None:
    """`calls` calls of each op (or of `op` alone)."""
    sys.path.insert(0, ROOT)
    import torch

    import dtmt_kernels as dk
    from dtmt_models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.no_grad():
        if op in ("", "rnmt_step"):
            model = build_model("dtmt", 4000, 4000).eval()   # the small preset: embed 128, hidden 256, 4 heads
            decoder = model.inference_decoder()
            src, lengths = torch.randint(4, 4000, (1, 20)), torch.tensor([20])
            state = decoder.reorder(decoder.encode(src, lengths), torch.zeros(4, dtype=torch.long))
            prev = torch.randint(4, 4000, (4,))
            for _ in range(calls):
                decoder.step(state, prev)
        if op in ("", "transition_forward"):
            layer = dk.nn.DeepTransitionGRU(128, 256, depth=1, cell="lgru", layer_norm=True)
            x = torch.randn(30, 1, 128)
            for _ in range(calls):
                layer(x)


def inclusive_counts(text: str) -> dict:
    """{function name: inclusive instructions} of a `callgrind_annotate --inclusive=yes` listing."""
    counts = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) (?:\([\s\d.]+%\)\s+)?(.*)", line)   # (the name keeps its "file:")
        if m and m.group(2).strip():
            name = m.group(2).strip()
            counts[name] = max(counts.get(name, 0), int(m.group(1).replace(",", "")))
    return counts


def count(calls: int, op: str) -> dict:
    out = tempfile.mktemp(prefix="bench_op_checks_", suffix=".cg")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__),
           "--workload", "--op", op, "--calls", str(calls)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out], check=True,
                              capture_output=True, text=True).stdout
    finally:
        if os.path.exists(out):
            os.remove(out)
    counts = inclusive_counts(text)

    def of(pattern):
        return max((v for k, v in counts.items() if pattern in k), default=0)
    kernel = of(KERNELS[op])
    found = {pattern: of(pattern) for pattern in CHECKS[op]}
    checks = sum(found.values())
    if not kernel:
        raise SystemExit(f"bench_op_checks: callgrind saw no {KERNELS[op]} (symbols stripped?)")
    return {"op": op, "calls": calls, "kernel_instructions_per_call": kernel / calls,
            "check_instructions_per_call": checks / calls, "share": checks / (kernel + checks),
            "checks": {k: v / calls for k, v in found.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=os.path.join(HERE, "out", "op_checks"))
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--op", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.workload:   # (a child of the run below, whose options are checked)
        return workload(a.calls, a.op)
    sys.path.insert(0, HERE)
    from common import check_options, commit, machine_name, make_out_dir, write_report

    check_options(p, a, (("calls", 1),))
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("bench_op_checks: valgrind (callgrind) is not installed", file=sys.stderr)
        return 2
    make_out_dir(p, a.out)   # (before the measurement: an --out that cannot be made failed after it)

    rows = [count(a.calls, op) for op in CHECKS]
    rev = commit()
    md = (f"Instructions a call of each op, and of its argument checks (callgrind, {a.calls} calls, one thread; "
          f"{machine_name(threads=False)}; commit {rev}). Command: `python benchmarks/bench_op_checks.py "
          f"--calls {a.calls}`\n\n| op | kernel's instructions a call | the checks' | checks' share |\n"
          "|---|---:|---:|---:|\n")
    for r in rows:
        md += (f"| {r['op']} | {r['kernel_instructions_per_call']:,.0f} | {r['check_instructions_per_call']:,.0f} | "
               f"{100 * r['share']:.3f}% |\n")
    write_report(a.out, "bench_op_checks", md, {"commit": rev, "machine": machine_name(threads=False), "rows": rows})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
