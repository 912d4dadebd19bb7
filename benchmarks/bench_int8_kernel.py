"""The int8 small-row kernel against the float32 one on a real decoder's matrices (issue 25, item 2).

    python benchmarks/bench_int8_kernel.py --checkpoint benchmarks/out/peers_30m_b/dtmt/step_0001734.pt

Takes every weight matrix the fused decoder step reads (FusedRNMTDecoder: the two cells' input, recurrent and
T-GRU matrices, the attention's query and output projections, the readout's three and the output layer), and
times `torch.ops.dtmt.small_rows_linear(x, W, b)` with W in float32 and as int8 rows (pack_int8_rows) for
M rows of x (1: greedy at batch 1; 4: beam 4 at batch 1; 8; 32: batched, which takes the dequantize-and-GEMM
path), on one thread, best of --repeat rounds of --calls calls each. Reported per M: the sum over the matrices
(one step's linear layers), float32 and int8 microseconds and their ratio, and the bytes of weights a step reads
in each. Also per M, float32 "as a step": all the matrices one after another in a call, as a decoder step reads
them (together larger than a core's L2, so the weights come from further away than when one matrix is timed over
and over; the op is called from Python, matrix after matrix, so the figure also holds what Python spends between
the calls: a standalone C++ copy of the loop over matrices of the same shapes took about half the time, Xeon 207,
2026-11-26); and the floor of that: one torch.sum over the same float32 bytes (the core's streaming rate, GB/s).
Output: OUT/bench_int8_kernel.md and .json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def step_matrices(decoder):
    """(name, float32 weight [N, K]) of every matrix a fused decoder step multiplies by."""
    out = []
    for cell_name, cell in (("query_cell", decoder.query_cell), ("decoder_cell", decoder.decoder_cell)):
        w_ih, w_hh, t_w = cell.params[0], cell.params[2], cell.params[6]
        out += [(f"{cell_name}.w_ih", w_ih), (f"{cell_name}.w_hh", w_hh)]
        out += [(f"{cell_name}.t_w[{k}]", t_w[k]) for k in range(t_w.shape[0] if t_w.numel() else 0)]
    for prefix, weights in (("attention", decoder.attention), ("readout", decoder.readout)):
        out += [(f"{prefix}.{name}", getattr(weights, name)) for name in weights.MATRICES
                if getattr(weights, name) is not None]
    return out


def best_time(fn, calls: int, repeat: int) -> float:
    """Seconds per call, the best of `repeat` rounds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


DEFAULT_CHECKPOINT = os.path.join(HERE, "out", "peers_30m_b", "dtmt", "step_0001734.pt")   # (RESULTS.md's run)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--rows", default="1,4,8,32")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "out", "int8_kernel"))
    p.add_argument("--isa", default="", help="the CPU loops to time (e.g. avx2 on an AVX-512 machine: the AVX2 "
                                             "loops; DTMT_INT8_VNNI=0 in the environment keeps the avx512 copy off "
                                             "its VNNI loops); default: the best this CPU runs")
    a = p.parse_args(argv)
    from common import PEERS_30M_MADE_BY, check_checkpoint, check_options, make_out_dir, torch_threads

    # (negative calls printed negative µs, 0 a ZeroDivisionError, "--rows a" a ValueError's traceback)
    try:
        a.rows = [int(m) for m in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows {a.rows}: must be integers separated by commas, e.g. 1,4,8,32")
    check_options(p, a, (("rows", 1), ("calls", 1), ("repeat", 1)))
    if a.isa:
        from dtmt_kernels import _C

        if a.isa not in _C.supported_cpu_isas():   # (a bad option: exit 2, as argparse's)
            p.error(f"--isa {a.isa}: this CPU runs {', '.join(_C.supported_cpu_isas())}")
    # (a missing checkpoint, the default one of a local run above all, was a FileNotFoundError's traceback)
    check_checkpoint(p, a.checkpoint, DEFAULT_CHECKPOINT, PEERS_30M_MADE_BY)
    make_out_dir(p, a.out)   # (after every check: nothing written for a refusal)
    with torch_threads(1):
        return _run(a, argv)


def _run(a, argv):
    import torch
    from common import machine_name, write_report

    from dtmt_kernels.ops.linear.quantize import pack_int8_rows
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.engine.rnmt import FusedRNMTDecoder

    from dtmt_kernels import _C

    if a.isa:   # (checked in main)
        _C.set_cpu_isa(a.isa)
    model, _, _, ckpt = load_model(a.checkpoint)
    decoder = model.eval().inference_decoder()
    if not isinstance(decoder, FusedRNMTDecoder):
        raise SystemExit(f"{a.checkpoint}: {ckpt['model_name']} has no fused decoder step")
    matrices = step_matrices(decoder)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        packed = [(name, w.contiguous(), pack_int8_rows(w), torch.randn(w.shape[0], generator=gen))
                  for name, w in matrices]
        flat = torch.cat([w.reshape(-1) for _, w, _, _ in packed])
        stream = best_time(lambda: flat.sum(), a.calls, a.repeat)
        for M in a.rows:
            f32 = i8 = 0.0
            xs = []
            for name, w, q, b in packed:
                x = torch.randn(M, w.shape[1], generator=gen)
                xs.append(x)
                f32 += best_time(lambda: torch.ops.dtmt.small_rows_linear(x, w, b), a.calls, a.repeat)
                i8 += best_time(lambda: torch.ops.dtmt.small_rows_linear(x, q, b), a.calls, a.repeat)

            def step():
                for (_, w, _, b), x in zip(packed, xs):
                    torch.ops.dtmt.small_rows_linear(x, w, b)
            f32_step = best_time(step, a.calls, a.repeat)
            rows.append({"rows": M, "float32_us": f32 * 1e6, "int8_us": i8 * 1e6, "ratio": i8 / f32,
                         "float32_step_us": f32_step * 1e6})
            print(f"M={M}: float32 {f32 * 1e6:.0f} us ({f32_step * 1e6:.0f} as a step), int8 {i8 * 1e6:.0f} us, "
                  f"int8/float32 {i8 / f32:.2f}", flush=True)
    f32_bytes = sum(w.numel() * 4 for _, w, _, _ in packed)
    i8_bytes = sum(q.numel() for _, _, q, _ in packed)
    cmd = "python benchmarks/bench_int8_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [f"The step's linear layers, float32 against int8 rows: {ckpt['model_name']} "
          f"({os.path.relpath(a.checkpoint, ROOT)}), {len(matrices)} matrices, {f32_bytes / 1e6:.2f} MB float32 / "
          f"{i8_bytes / 1e6:.2f} MB int8; {machine_name()}; 1 thread, best of {a.repeat} x {a.calls} calls. "
          f"A sum over the float32 bytes takes {stream * 1e6:.0f} µs ({f32_bytes / stream / 1e9:.1f} GB/s): the "
          f"floor of a float32 step's products. Command: `{cmd.strip()}`", "",
          "| rows (M) | float32 µs | float32 as a step µs | int8 µs | int8 / float32 |", "|---:|---:|---:|---:|---:|"]
    md += [f"| {r['rows']} | {r['float32_us']:.0f} | {r['float32_step_us']:.0f} | {r['int8_us']:.0f} | "
           f"{r['ratio']:.2f} |" for r in rows]
    text = "\n".join(md) + "\n"
    write_report(a.out, "bench_int8_kernel", text, {"rows": rows, "matrices": [n for n, *_ in packed],
                                                   "float32_bytes": f32_bytes, "int8_bytes": i8_bytes,
                                                   "float32_sum_us": stream * 1e6})
    print(text)
    return rows


if __name__ == "__main__":
    main()
