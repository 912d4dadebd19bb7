"""Training under torch.autocast in bfloat16 (`dtmt train --amp bf16`) against float32, in one process (issue 22
item 4; why it is off by default: docs/design/training.md, "bfloat16 on the CPU"):

    python benchmarks/bench_amp.py [--model dtmt] [--threads 1] [--rounds 3] [--batches 4]

The model and batches are bench_compile.py's (the system's small preset, synthetic batches of the Bible's shape).
Alternating float32 and bfloat16-autocast updates (forward under autocast, backward and Adam in float32, as the
trainer does) --rounds times over --batches batches, it prints target tokens/s of each and their ratio per round,
and the time of one bfloat16 GEMM against float32 at the recurrent and output-layer shapes, which says whether this
CPU has bfloat16 dot products (oneDNN's report is printed too). Writes benchmarks/out/amp/<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_compile import add_batch_arguments, alternate, cpu_name, small_model_and_batches  # noqa: E402


def gemm_ms(m: int, k: int, n: int, dtype, repeat: int = 5) -> float:
    import torch

    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(repeat):
        torch.mm(a, b)
    return (time.perf_counter() - t0) / repeat * 1e3


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_batch_arguments(p)
    p.add_argument("--out", default=os.path.join(HERE, "out", "amp"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    bf16_isa = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    gemms = {}
    for shape in ((a.batch_size, 256, 768), (a.batch_size * a.tgt_len, 256, 4000)):
        f32, bf16 = gemm_ms(*shape, torch.float32), gemm_ms(*shape, torch.bfloat16)
        gemms["x".join(map(str, shape))] = dict(float32_ms=f32, bfloat16_ms=bf16)
        print(f"GEMM {shape}: float32 {f32:.2f} ms, bfloat16 {bf16:.2f} ms ({f32 / bf16:.2f}x)", flush=True)
    model, batches = small_model_and_batches(a)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)

    def update(amp: bool, batch) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _, n = model(*batch, smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        opt.step()
        return int(n)

    update(False, batches[0])
    update(True, batches[0])   # warm both
    rows = alternate(update, (("float32", False), ("bf16", True)), batches, a.rounds)
    result = dict(model=a.model, threads=a.threads, cpu=cpu_name(), torch=torch.__version__,
                  onednn_bf16=bf16_isa, batch=[a.batch_size, a.src_len, a.tgt_len], gemms=gemms, rounds=rows,
                  params=sum(p.numel() for p in model.parameters()))
    print(f"{a.model} ({result['params'] / 1e6:.1f} M parameters), {cpu_name()} (oneDNN bfloat16: {bf16_isa}), "
          f"{a.threads} thread(s): median ratio bf16 / float32 "
          f"{sorted(r['bf16'] / r['float32'] for r in rows)[len(rows) // 2]:.3f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.model}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
