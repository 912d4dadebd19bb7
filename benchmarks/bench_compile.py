"""torch.compile of a whole system's training update against eager, in one process (issue 22; why training stays
eager: docs/design/training.md, "Eager, not compiled"):

    python benchmarks/bench_compile.py [--model dtmt] [--threads 1] [--rounds 3] [--backend inductor]

The model is the system's `small` preset with the Bible's vocabulary sizes (4,000 a side); the batches are
synthetic with the Bible's shape at the main job's token budget (64 pairs, source 28 and target 30 tokens, padded
lengths drawn per pair, one shape for all batches: a teacher-forced decoder loop is unrolled into the graph, so
every target length is a graph of its own). Prints the compile time (the first compiled update, forward and
backward) and, alternating eager and compiled updates --rounds times over --batches batches, target tokens/s of
each and their ratio per round. Candidate and other dropouts on, as in training. Writes
benchmarks/out/compile/<model>.json.
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


def cpu_name() -> str:
    """The CPU's model name (bench_cells.machine_record: /proc/cpuinfo, or the platform's name without it)."""
    from bench_cells import machine_record

    return machine_record()["model name"]


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the model and its synthetic batches, shared with bench_amp.py."""
    p.add_argument("--model", default="dtmt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--src-len", type=int, default=28)
    p.add_argument("--tgt-len", type=int, default=30)


VOCAB = 4000   # the Bible's SentencePiece vocabularies, a side


def small_model_and_batches(a):
    """The system's small preset (training mode) and --batches synthetic batches (src, lengths, prev, target) of
    the Bible's shape, seeded."""
    import torch

    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model

    torch.manual_seed(0)
    V = VOCAB
    model = build_model(a.model, V, V, **get_preset(a.model, "small")["model"]).train()
    g = torch.Generator().manual_seed(1)
    B, S, T = a.batch_size, a.src_len, a.tgt_len
    batches = []
    for _ in range(a.batches):
        lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
        lengths[0] = S
        src = torch.randint(4, V, (B, S), generator=g) * (torch.arange(S) < lengths[:, None])
        tgt_len = torch.randint(T // 2, T + 1, (B,), generator=g)
        target = torch.randint(4, V, (B, T), generator=g) * (torch.arange(T) < tgt_len[:, None])
        prev = torch.cat([torch.full((B, 1), 1), target[:, :-1]], 1)
        batches.append((src, lengths, prev, target))
    return model, batches


def alternate(update, variants, batches, rounds: int) -> list:
    """`rounds` rounds of every (name, arg) in `variants` in turn, each one update(arg, batch) per batch: per round,
    {name: target tokens/s}; a line a round with the last variant's ratio to the first's."""
    rows = []
    for r in range(rounds):
        rates = {}
        for name, arg in variants:
            t0, tokens = time.perf_counter(), 0
            for batch in batches:
                tokens += update(arg, batch)
            rates[name] = tokens / (time.perf_counter() - t0)
        rows.append(rates)
        first, last = variants[0][0], variants[-1][0]
        print(f"round {r + 1}: " + ", ".join(f"{name} {rate:,.0f} tok/s" for name, rate in rates.items()) +
              f", ratio {rates[last] / rates[first]:.3f}", flush=True)
    return rows


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_batch_arguments(p)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "compile"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, batches = small_model_and_batches(a)
    B, S, T = a.batch_size, a.src_len, a.tgt_len
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    compiled = torch.compile(model, fullgraph=True, backend=a.backend)

    def update(fn, batch):
        loss, _, n = fn(*batch, smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        opt.step()
        return int(n)

    t0 = time.perf_counter()
    update(compiled, batches[0])
    compile_s = time.perf_counter() - t0
    update(model, batches[0])   # warm both
    rows = alternate(update, (("eager", model), ("compiled", compiled)), batches, a.rounds)
    result = dict(model=a.model, backend=a.backend, threads=a.threads, cpu=cpu_name(), torch=torch.__version__,
                  batch=[B, S, T], compile_s=compile_s, rounds=rows,
                  params=sum(p.numel() for p in model.parameters()))
    print(f"{a.model} ({result['params'] / 1e6:.1f} M parameters), {cpu_name()}, {a.threads} thread(s): compile "
          f"{compile_s:.1f} s; median ratio compiled / eager "
          f"{sorted(r['compiled'] / r['eager'] for r in rows)[len(rows) // 2]:.3f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.model}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
