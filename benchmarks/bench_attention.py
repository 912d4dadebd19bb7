"""Speed and saved-for-backward memory of one decoder step of additive attention, fused (cpp) against reference.

    python benchmarks/bench_attention.py             # the sizes of the small and paper DTMT presets
    python benchmarks/bench_attention.py --quick     # tiny sizes, one repetition (as the tests run it)
    python benchmarks/bench_attention.py --device cuda   # the CUDA kernels against the reference on the GPU

On the GPU the fused backend is `cuda` with its attention kernels (csrc/attention_cuda.cu), which this process
turns on (`dk.functional.ATTENTION_KERNEL_BACKENDS`; not yet the default), at the same sizes and at a paper-size
training batch (256 rows); strict fp32 on both sides (no matmul in the scores; the reference's context is a bmm,
run with TF32 off).

Times `MultiHeadAdditiveAttention` (scores v·tanh(q + k_j) per head, masked softmax, per-head context, output
projection) for one decoder step, given the keys precomputed once per batch, as the decoders call it:
forward only (under no_grad, as in beam search) and forward + backward (as in training). Also the scores op
alone (`dtmt_kernels.functional.additive_scores`), where the fused kernel does its work. `saved_KB` is what
autograd keeps for backward in one step (the keys, annotations, query and parameters, which the decoder holds
anyway, and the parameters are not counted). Median of --repeat runs after a warm-up; ratios are within one run.
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
from common import (check_options, machine_name, make_out_dir, provenance, provenance_line, time_fn,  # noqa: E402
                    write_csv)
from dtmt_models.models.attention import MultiHeadAdditiveAttention  # noqa: E402

# (name, B, S, query size H, annotation size C = 2H, attention size A, heads)
SIZES = [("small preset", 64, 32, 256, 512, 256, 4), ("paper preset", 64, 32, 1024, 2048, 1024, 16)]
CUDA_SIZES = SIZES + [("paper preset, training batch", 256, 32, 1024, 2048, 1024, 16)]
QUICK = [("quick", 3, 5, 8, 16, 8, 2)]


def saved_kb(fn, exclude) -> float:
    seen, total = {t.untyped_storage().data_ptr() for t in exclude}, 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total / 1024


def measure(name, B, S, H, C, A, heads, repeat, device="cpu"):
    torch.manual_seed(0)
    att = MultiHeadAdditiveAttention(H, C, A, heads).to(device)
    ann = torch.randn(B, S, C, device=device, requires_grad=True)
    query = torch.randn(B, H, device=device, requires_grad=True)
    mask = (torch.arange(S).unsqueeze(0) < torch.randint(S // 2 + 1, S + 1, (B,)).unsqueeze(1)).to(device)
    keys = att.precompute(ann).detach().requires_grad_()
    q = att.query(query).view(B, heads, -1).detach().requires_grad_()
    rows = []
    for backend in ("reference", "cpp" if device == "cpu" else "cuda"):
        att.backend = backend

        def step():
            return att(query, keys, ann, mask)

        def step_fb():
            ctx, _ = step()
            ctx.sum().backward()

        def fwd():
            with torch.no_grad():
                step()

        def scores_fb():
            dk.functional.additive_scores(keys, q, att.v, backend).sum().backward()

        rows.append(dict(size=name, B=B, S=S, A=A, heads=heads, backend=backend,
                         fwd_ms=time_fn(fwd, repeat, device) * 1e3, fwd_bwd_ms=time_fn(step_fb, repeat, device) * 1e3,
                         scores_fwd_bwd_ms=time_fn(scores_fb, repeat, device) * 1e3,
                         saved_KB=saved_kb(step, [ann, keys, query, mask, *att.parameters()])))
    ref = rows[0]
    for r in rows:
        r["x_fwd"] = ref["fwd_ms"] / r["fwd_ms"]
        r["x_fwd_bwd"] = ref["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        r["x_scores"] = ref["scores_fwd_bwd_ms"] / r["scores_fwd_bwd_ms"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20, help="timed repetitions (median reported)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (smoke test)")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="directory for bench_attention.csv")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: cpp against reference; cuda: the cuda backend's kernels against reference on the GPU")
    a = p.parse_args(argv)
    check_options(p, a, (("repeat", 1), ("threads", 0)))   # (--repeat 0 was an empty median after the first size)
    fused = "cpp" if a.device == "cpu" else "cuda"
    if fused not in dk.available_backends() or (a.device == "cuda" and not torch.cuda.is_available()):
        where = " on a machine with a GPU" if fused == "cuda" else ""
        p.error(f"the {fused} backend is not available here (build the extension{where} first)")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cuda":   # strict fp32 on both sides; the cuda kernels on for this process
        torch.backends.cuda.matmul.allow_tf32 = False
        dk.functional.ATTENTION_KERNEL_BACKENDS = dk.functional.ATTENTION_KERNEL_BACKENDS | {"cuda"}
    make_out_dir(p, a.out)   # (a file there was a FileExistsError after every size had been timed)
    record = provenance(__file__, argv, a.device)
    print(provenance_line(record), flush=True)
    sizes, repeat = (QUICK, 1) if a.quick else (CUDA_SIZES if a.device == "cuda" else SIZES, a.repeat)
    rows = [r for size in sizes for r in measure(*size, repeat, a.device)]
    mode = ", strict fp32" if a.device == "cuda" else ""
    print(f"\nAdditive attention, one decoder step ({machine_name(a.device)}{mode})\n")
    print("| size | B | S | A | heads | backend | fwd ms | × | fwd+bwd ms | × | scores fwd+bwd ms | × | saved KB |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['B']} | {r['S']} | {r['A']} | {r['heads']} | {r['backend']} | {r['fwd_ms']:.3f} | "
              f"{r['x_fwd']:.2f} | {r['fwd_bwd_ms']:.3f} | {r['x_fwd_bwd']:.2f} | {r['scores_fwd_bwd_ms']:.3f} | "
              f"{r['x_scores']:.2f} | {r['saved_KB']:.1f} |")
    write_csv(os.path.join(a.out, "bench_attention.csv"), rows, list(rows[0]), comment=provenance_line(record))
    return rows


if __name__ == "__main__":
    main()
