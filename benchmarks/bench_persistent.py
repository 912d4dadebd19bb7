"""The persistent launches (issue 72; DTMT_CUDA_RECURRENCE=persistent, csrc/persistent_cuda_kernels.cuh) against the
cuda backend's per-step path and cuDNN's GRU, on the GPU, each math mode the same on every side.

    python benchmarks/bench_persistent.py [--T 50] [--B 1 8 64 256] [--H 512] [--repeat 10]
                                          [--math strict tf32 bf16 tf32-fma bf16-fma] [--forms grid cluster multicast]
                                          [--out DIR]

Math modes (--math, each a table): `strict`, float32 with TF32 off for cuBLAS, cuDNN and our kernels (FMA products);
`tf32`, float32 with torch's TF32 flags on (torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32): cuBLAS and
cuDNN on TF32 tensor cores, and the persistent launches' products too (csrc/block_mma.cuh); `bf16`, bfloat16 storage
on every side, float accumulation (the persistent products on bf16 tensor cores); `tf32-fma` and `bf16-fma`, the same
with the persistent products on FMA (DTMT_CUDA_PRODUCTS=fma; the phase probe found FMA the faster at H = 512, B = 64:
which products the rule should pick, docs/design/persistent_recurrence.md, "Products on tensor cores"). A row whose
persistent launches ran on other products than its mode's says so.
The switch is read once a process, so each mode runs in a child process of its own. For every case (one GRU layer;
the deep transition, L-GRU + 4 T-GRUs with layer norm; ATR) and batch size, a child
- checks its forward against the float64 reference on the device (ragged lengths, the reverse direction), and
  reports the largest difference of the outputs (relative to their largest value);
- times the forward alone and forward + backward (both persistent in the persistent mode), eager, median of
  --repeat, and the peak memory of forward + backward (the per-step child also the reference backend's, in the
  same dtype: issue 72 asks for at most it), the output's gradient a dense tensor made within it on every side
  (bench_cells.fwd_bwd).
The persistent launches come in three forms (--forms): `grid`, one cooperative launch of a block per SM with the grid's
barrier (DTMT_CUDA_RECURRENCE=persistent); `cluster`, thread-block clusters of at most 16 blocks, each the whole layer
for its own batch rows, with the cluster's barrier (persistent-cluster; Hopper); and `multicast`, the grid form in
thread-block clusters of 2 whose blocks read the products' stage from L2 once a cluster (persistent-multicast; Hopper,
code built for sm_90a: TORCH_CUDA_ARCH_LIST=9.0a, as gpu_session.sh builds it). The parent prints a table per form: the
per-step path and that form side by side, steps / persistent (above 1: the persistent launch is faster), the persistent
forward's floor and the share of it reached: T x (its barriers a step x the barrier's cost + a step's recurrent products
at the device's dense rate). The barrier's cost is bounded from above by timing a GRU of one unit per block at B = 1 (as
many units as the form has blocks), whose step is a barrier and almost no work; the dense rate is a 4096^3 matrix
product's in the same math mode (`torch.mm`, the most the device's multipliers give), so the floor is one no kernel can
go under, and cuDNN's torch.nn.GRU in the same math mode beside the GRU rows.
A persistent forward that does not fit the device falls back (the cluster and multicast forms to the grid form, the grid
form to the per-step path) with a warning: the child reports which form ran (the driver's launch counts,
persistent_launches), and that row says so. Writes DIR/bench_persistent.csv when --out is given. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
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


MATH = ("strict", "tf32", "bf16", "tf32-fma", "bf16-fma")   # (-fma: the persistent products on FMA, DTMT_CUDA_PRODUCTS)
FORMS = {"grid": "persistent", "cluster": "persistent-cluster",   # --forms: the DTMT_CUDA_RECURRENCE of each
         "multicast": "persistent-multicast"}
FORM_OF = {mode: form for form, mode in FORMS.items()}
CLUSTER_BLOCKS = 16   # the cluster form's blocks (csrc/persistent_plan.h's kClusterMaxBlocks)
TOLERANCE = {"strict": 1e-4, "tf32": 2e-2, "bf16": 5e-2}   # the forward's largest error, relative to its largest value
#                                                             (a -fma mode: its base mode's)


def child(mode: str, math: str, T: int, Bs, H: int, repeat: int) -> list:
    import torch

    from bench_cells import fwd_bwd, fwd_only, peak_memory_mb
    from common import time_fn
    from dtmt_kernels.ops.transition.persistent import persistent_launches

    base = math.split("-")[0]   # (tf32-fma, bf16-fma: the base mode on every side, the persistent products on FMA)
    torch.backends.cuda.matmul.allow_tf32 = base == "tf32"
    torch.backends.cudnn.allow_tf32 = base == "tf32"
    dtype = torch.bfloat16 if base == "bf16" else torch.float32
    rows = []
    for name, cell, depth, ln in CASES:
        for B in Bs:
            torch.manual_seed(0)
            layer = build(cell, depth, ln, H, "cuda").cuda()
            reference = build(cell, depth, ln, H, "reference").cuda().double()
            reference.load_state_dict(layer.state_dict())
            layer = layer.to(dtype)
            x = torch.randn(T, B, H, device="cuda", dtype=dtype)
            lengths = torch.randint(1, T + 1, (B,), device="cuda")
            lengths[0] = T
            launched = persistent_launches()
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")   # (a fall-back's warning: the launch counts below say it)
                out, h_n = layer(x, lengths=lengths)
            ran = {k: v - launched[k] for k, v in persistent_launches().items()}
            form = ("cluster" if ran["cluster"] else "multicast" if ran.get("multicast") else
                    "grid" if ran["grid"] else "steps")
            fell_back = mode != "steps" and form != FORM_OF[mode]
            with torch.no_grad():
                ref_out, ref_h = reference(x.double(), lengths=lengths)
            scale = max(ref_out.abs().max().item(), 1e-30)
            err = max((out.double() - ref_out).abs().max().item(), (h_n.double() - ref_h).abs().max().item()) / scale
            xg = x.clone().requires_grad_()
            row = dict(case=name, T=T, B=B, H=H, mode=mode, math=math, form=form, fell_back=fell_back,
                       products="tensor cores" if ran["tensor_cores"] else "FMA" if form != "steps" else "",
                       rel_err=err,
                       fwd_ms=1e3 * time_fn(fwd_only(layer, x), repeat, "cuda"),
                       fwd_bwd_ms=1e3 * time_fn(fwd_bwd(layer, xg), repeat, "cuda"),
                       peak_MB=peak_memory_mb(fwd_bwd(layer, xg)))
            if mode == "steps":   # the reference backend's peak in the same dtype (issue 72: at most it)
                same = build(cell, depth, ln, H, "reference").cuda().to(dtype)
                same.load_state_dict(layer.state_dict())
                row["reference_peak_MB"] = peak_memory_mb(fwd_bwd(same, xg))
            if cell == "gru" and mode == "steps":   # cuDNN in the same math mode
                gru = torch.nn.GRU(H, H).cuda().to(dtype)
                row["cudnn_fwd_ms"] = 1e3 * time_fn(fwd_only(gru, x), repeat, "cuda")
                row["cudnn_fwd_bwd_ms"] = 1e3 * time_fn(fwd_bwd(gru, xg), repeat, "cuda")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if mode != "steps":   # the barrier's cost, bounded from above: a layer whose step is one barrier
        blocks = (CLUSTER_BLOCKS if mode == "persistent-cluster"
                  else torch.cuda.get_device_properties(0).multi_processor_count)
        layer = build("gru", 0, False, blocks, "cuda").cuda()
        x = torch.randn(512, 1, blocks, device="cuda")   # (float32, TF32 or not: one unit, no product to speak of)
        seconds = time_fn(fwd_only(layer, x), repeat, "cuda")
        print(json.dumps(dict(case="barrier", units=blocks, steps=512, step_us=1e6 * seconds / 512)), flush=True)
        n = 4096   # the device's dense rate in this math mode: a step's products cannot run faster
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        seconds = time_fn(lambda: torch.mm(a, b), repeat, "cuda")
        print(json.dumps(dict(case="mma", flops_per_s=2 * n ** 3 / seconds)), flush=True)
    return rows


def step_flops(cell: str, depth: int, B: int, H: int) -> int:
    """The recurrent products of one step of a layer's forward: B x H against the base cell's recurrent rows
    (dtmt_kernels' layout: 3 a unit for GRU, 4 for L-GRU and LAU, 1 for ATR) and 3 a unit for each T-GRU, 2 flops a
    multiply-add."""
    from dtmt_kernels.ops.transition.layout import CELLS

    rows = CELLS[cell][2] + depth * CELLS["tgru"][2]
    return 2 * B * H * rows * H


def floor_ms(cell: str, depth: int, ln: bool, T: int, B: int, H: int, barrier_us: float, flops_per_s) -> float:
    """The persistent forward's floor: T x (its barriers a step x `barrier_us` + a step's recurrent products at
    `flops_per_s`; None: the barriers alone)."""
    products = step_flops(cell, depth, B, H) / flops_per_s if flops_per_s else 0.0
    return 1e3 * T * (barriers_per_step(cell, depth, ln, B) * barrier_us * 1e-6 + products)


# csrc/persistent_cuda_kernels.cuh's kSpreadJoinPasses and kPersistentThreads' warps: a layer norm's join is shared
# out over the blocks, with one more barrier, where a block would take this many passes of its warps over the
# B x groups (row, gate) pairs
SPREAD_JOIN_PASSES, PERSISTENT_WARPS = 4, 8


def barriers_per_step(cell: str, depth: int, ln: bool, B: int = 1) -> int:
    """Grid barriers a step of the persistent forward waits at: one a sub-cell, two with layer norm, three where
    the layer norm's join is shared out over the blocks (join_pairs)."""
    from dtmt_kernels.ops.transition.layout import CELLS

    def norm(groups: int) -> int:
        return 0 if not ln else 2 if -(-B * groups // PERSISTENT_WARPS) >= SPREAD_JOIN_PASSES else 1
    return 1 + norm(CELLS[cell][3]) + depth * (1 + norm(CELLS["tgru"][3]))


MATH_NAMES = {"strict": "strict fp32 on every side (TF32 off for cuBLAS, cuDNN and our products)",
              "tf32": "TF32 on every side (torch's TF32 flags on: cuBLAS, cuDNN and the persistent products on TF32 "
                      "tensor cores)",
              "bf16": "bfloat16 storage on every side, float accumulation",
              "tf32-fma": "TF32 on every side but the persistent products, on FMA in strict fp32 "
                          "(DTMT_CUDA_PRODUCTS=fma)",
              "bf16-fma": "bfloat16 storage on every side, float accumulation, the persistent products on FMA "
                          "(DTMT_CUDA_PRODUCTS=fma)"}


def report(results: dict, barrier, T: int, H: int, Bs, repeat: int, machine: str, math: str = "strict",
           mma=None, form: str = "grid") -> list:
    """Prints the table of the per-step path's and one form's rows in one math mode ({(case, B, mode): row}, the
    children's JSON; `form` grid or cluster) with the floor column from that form's barrier probe and the dense rate
    (`mma`; None: no floor, or the barriers alone); returns the rows joined per case for the CSV."""
    mode = FORMS[form]
    print(f"# {machine}; {MATH_NAMES[math]}; T={T}, H={H}; the {form} form (DTMT_CUDA_RECURRENCE={mode}) against the "
          f"per-step path; eager, median of {repeat}; `python benchmarks/bench_persistent.py --math {math} --forms "
          f"{form}`")
    if barrier:
        print(f"# {'cluster' if form == 'cluster' else 'grid'} barrier: at most {barrier['step_us']:.2f} us (a step of "
              f"a GRU of one unit per block, {barrier['units']} blocks, B=1, T={barrier['steps']}: one barrier and "
              f"almost no work); the floor of a persistent forward is T x (its barriers a step x that"
              + (f" + a step's recurrent products at {mma['flops_per_s'] / 1e12:.1f} TFLOP/s, a 4096^3 torch.mm's rate "
                 f"here)" if mma else ")"))
    print("| case | B | steps fwd ms | persistent fwd ms | x fwd | floor ms (share) | steps fwd+bwd ms | persistent "
          "fwd+bwd ms | x fwd+bwd | cuDNN GRU fwd / fwd+bwd ms | rel. err (steps / persistent) | peak MB (steps / "
          "persistent / reference) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for name, cell, depth, ln in CASES:
        for B in Bs:
            s, q = results.get((name, B, "steps")), results.get((name, B, mode))
            if s is None or q is None:
                continue
            cudnn = (f"{s['cudnn_fwd_ms']:.2f} / {s['cudnn_fwd_bwd_ms']:.2f}" if "cudnn_fwd_ms" in s else "")
            note = f" (ran as {q.get('form', 'steps')}: did not fit)" if q["fell_back"] else ""
            wanted = "FMA" if math == "strict" or math.endswith("-fma") else "tensor cores"
            if q.get("products") and q["products"] != wanted:
                note += f" (products on {q['products']})"
            floor = (floor_ms(cell, depth, ln, T, B, H, barrier["step_us"], mma and mma["flops_per_s"]) if barrier
                     else float("nan"))
            print(f"| {name}{note} | {B} | {s['fwd_ms']:.2f} | {q['fwd_ms']:.2f} | {s['fwd_ms'] / q['fwd_ms']:.2f} | "
                  f"{floor:.2f} ({floor / q['fwd_ms']:.0%}) | "
                  f"{s['fwd_bwd_ms']:.2f} | {q['fwd_bwd_ms']:.2f} | {s['fwd_bwd_ms'] / q['fwd_bwd_ms']:.2f} | "
                  f"{cudnn} | {s['rel_err']:.1e} / {q['rel_err']:.1e} | {s['peak_MB']:.0f} / {q['peak_MB']:.0f} / "
                  f"{s.get('reference_peak_MB', float('nan')):.0f} |")
            table.append({"form": form, **{f"steps_{k}": v for k, v in s.items()},
                          **{f"persistent_{k}": v for k, v in q.items()}})
    return table


def envelope(multiprocessors, shared_memory, l2_cache, batch: int, forms=("grid",)) -> int:
    """--envelope: dtmt_kernels' envelope table (the CUDA driver's own arithmetic) for a device, a table per form."""
    from dtmt_kernels.ops.transition import persistent

    if multiprocessors is None or shared_memory is None:
        try:
            sms, optin, _, l2 = persistent._device_limits(None)
        except ValueError as exc:
            print(f"bench_persistent: {exc}", file=sys.stderr)
            return 2
        multiprocessors, shared_memory = multiprocessors or sms, shared_memory or optin
        l2_cache = l2 if l2_cache is None else l2_cache
    l2_cache = l2_cache or 0
    for form in forms:
        where = (f"clusters of at most {CLUSTER_BLOCKS} blocks, each of its own batch rows" if form == "cluster"
                 else f"{multiprocessors} SMs")
        print(f"# the persistent launches' envelope: {where}, {shared_memory} bytes of shared memory a block, "
              f"{l2_cache} bytes of L2, B = {batch}, {persistent._C.PERSISTENT_THREADS} threads a block; the largest "
              f"of H = {', '.join(map(str, persistent.ENVELOPE_HIDDEN))} that fits (forward / backward KB a block; "
              f"where some sub-cells' matrices are read from L2, how many, forward / backward)")
        print(persistent.envelope_table(multiprocessors, shared_memory, batch, l2_cache,
                                        CLUSTER_BLOCKS if form == "cluster" else 0))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=50)
    p.add_argument("--B", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--math", nargs="+", choices=MATH, default=["strict", "tf32"],
                   help="math modes, a table each (default: strict tf32)")
    p.add_argument("--forms", nargs="+", choices=sorted(FORMS), default=["grid"],
                   help="the persistent launches' forms, a table each against the per-step path: grid (a block per "
                        "SM, the grid's barrier), cluster (clusters of 16 blocks, each of its own batch rows, the "
                        "cluster's barrier; Hopper) and multicast (the grid form in clusters of 2 that read the stage "
                        "once a cluster; Hopper, built for sm_90a); default grid")
    p.add_argument("--out", default=None)
    p.add_argument("--envelope", action="store_true",
                   help="print the largest H that fits the persistent launches, per layer and math mode, at the first "
                        "--B, on this GPU or on --multiprocessors / --shared-memory (no GPU needed), a table per "
                        "--forms, and stop")
    p.add_argument("--multiprocessors", type=int, help="with --envelope: SMs (an H100 / H200: 132)")
    p.add_argument("--shared-memory", type=int, help="with --envelope: bytes a block may opt into (H100 / H200: 232448)")
    p.add_argument("--l2-cache", type=int, help="with --envelope: the L2's bytes (an H100: 52428800; given SMs and "
                                                "shared memory without it: 0, no matrix read from L2)")
    p.add_argument("--child", choices=["steps", *FORMS.values()], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from common import check_options

    # (--multiprocessors -1 and the like were the envelope's ValueError traceback; None: not given)
    check_options(p, a, (("T", 1), ("B", 1), ("H", 1), ("repeat", 1), ("multiprocessors", 1, 65536),
                         ("shared_memory", 0), ("l2_cache", 0)))
    import torch

    if a.envelope:
        return envelope(a.multiprocessors, a.shared_memory, a.l2_cache, a.B[0], a.forms)

    if not torch.cuda.is_available():
        print("bench_persistent: needs a CUDA device (the persistent kernels run on the GPU; the emulated tests in "
              "tests/test_cuda_sources.py check them on the CPU)", file=sys.stderr)
        return 2
    if a.child:
        child(a.child, a.math[0], a.T, a.B, a.H, a.repeat)
        return 0
    from common import machine_name, write_csv

    table, bad, barriers = [], [], {}
    for math in a.math:
        results, mma = {}, None
        for mode in ("steps", *(FORMS[f] for f in a.forms)):
            env = dict(os.environ, DTMT_CUDA_RECURRENCE=mode,
                       DTMT_CUDA_PRODUCTS="fma" if math.endswith("-fma") else "auto")
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--math", math, "--T",
                                str(a.T), "--B", *map(str, a.B), "--H", str(a.H), "--repeat", str(a.repeat)], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"bench_persistent: the {mode} run ({math}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}",
                      file=sys.stderr)
                return 1
            for line in r.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    if row["case"] == "barrier":   # (each form's own)
                        barriers[mode] = row
                    elif row["case"] == "mma":   # (the dense rate is this math mode's)
                        mma = row
                    if row["case"] in ("barrier", "mma"):
                        continue
                    results[(row["case"], row["B"], mode)] = row
        for form in a.forms:
            table += report(results, barriers.get(FORMS[form]), a.T, a.H, a.B, a.repeat, machine_name("cuda"), math,
                            mma, form)
        bad += [(math, *k) for k, row in results.items() if row["rel_err"] > TOLERANCE[math.split("-")[0]]]
    if a.out and table:
        write_csv(os.path.join(a.out, "bench_persistent.csv"), table, sorted({k for row in table for k in row}))
    if bad:
        print(f"bench_persistent: forward differs from the float64 reference by more than the math mode's tolerance "
              f"{TOLERANCE} in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
