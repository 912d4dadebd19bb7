"""Training under torch.autocast in bfloat16 (`dtmt train --amp bf16`) against float32, in one process (issue 22
item 4; why it is off by default: docs/design/training.md, "bfloat16 on the CPU"):

    python benchmarks/bench_amp.py [--model dtmt] [--threads 1] [--rounds 3] [--batches 4]

The model is the system's small preset; the batches are synthetic, of the Bible's shape (64 pairs, source 28 and
target 30 tokens, padded lengths drawn per pair).
Alternating float32 and bfloat16-autocast updates (forward under autocast, backward and Adam in float32, as the
trainer does) --rounds times over --batches batches, it prints target tokens/s of each and their ratio per round,
and the time of one bfloat16 GEMM against float32 at the recurrent and output-layer shapes, which says whether this
CPU has bfloat16 dot products (oneDNN's report is printed too). Writes benchmarks/out/amp/<model>.json.

    python benchmarks/bench_amp.py --quality --device cuda [--steps 600] [--seeds 1 2] [--model dtmt]

--quality asks whether bfloat16 may be the default on a device (issue 73 item 2): `dtmt train` on the Bible corpus
(prepared if missing) for --steps updates with --amp off and --amp bf16, per seed, alternated (off and bf16 of a
seed one after the other), validating three times; the dev loss of each at each validation, the difference of the
modes' means against the spread between seeds (the noise), and the target tokens/s of each. Writes
benchmarks/out/amp/quality-<model>-<device>.json.
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
    """The machine in words, without torch's thread count (each result names its threads)."""
    from common import machine_name

    return machine_name(threads=False)


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the model and its synthetic batches."""
    p.add_argument("--model", default="dtmt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--src-len", type=int, default=28)
    p.add_argument("--tgt-len", type=int, default=30)


def check_batch_arguments(p: argparse.ArgumentParser, a) -> None:
    """The options of add_batch_arguments, each refused in one line before anything runs: --rounds 0 or --batches 0
    was an IndexError after the GEMMs had been timed, --batch-size 0 another, --src-len 1 or --tgt-len 1 drew
    empty sentences (lengths from len // 2), --threads 0 torch's error, --model nope a traceback."""
    from common import check_options

    from dtmt_models.models.presets import get_preset

    check_options(p, a, (("threads", 1), ("rounds", 1), ("batches", 1), ("batch_size", 1), ("src_len", 2),
                         ("tgt_len", 2)))
    try:
        get_preset(a.model, "small")
    except ValueError as exc:
        p.error(f"--model {a.model}: {exc}")


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


def gemm_ms(m: int, k: int, n: int, dtype, repeat: int = 5) -> float:
    import torch

    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(repeat):
        torch.mm(a, b)
    return (time.perf_counter() - t0) / repeat * 1e3


def quality(argv) -> dict:
    """--quality: the dev loss after a fixed number of updates, float32 against bfloat16 autocast, per seed."""
    import statistics

    from bench_quality import dtmt, read_log
    from common import machine_name, write_json

    p = argparse.ArgumentParser(description="bench_amp.py --quality")
    p.add_argument("--quality", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="dtmt")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--data", default=os.path.join(os.path.dirname(HERE), "data", "bible"))
    p.add_argument("--train-args", default="", help="more `dtmt train` arguments (e.g. --preset paper)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "amp"))
    p.add_argument("--runs", default=None, help="where the training runs go (default OUT/quality-MODEL-DEVICE)")
    a = p.parse_args(argv)
    # before any folder is made or run trained: --device cuda without a GPU and --steps -1 had been tracebacks of the
    # first `dtmt train`, a mistyped --data got a Bible built there, an unknown --model failed in training
    from common import check_options
    from dtmt_models.models.presets import get_preset

    check_options(p, a, (("steps", 1),), device="device")
    if len(set(a.seeds)) < len(a.seeds):
        p.error(f"--seeds {' '.join(map(str, a.seeds))}: a seed given twice (its runs would replace each other)")
    try:
        get_preset(a.model, "small")
    except ValueError as exc:
        p.error(f"--model {a.model}: {exc}")
    default_data = os.path.join(os.path.dirname(HERE), "data", "bible")
    if not os.path.isfile(os.path.join(a.data, "corpus.json")) and \
            os.path.abspath(a.data) != os.path.abspath(default_data):
        p.error(f"--data {a.data}: no corpus.json; make the corpus with `dtmt prepare` (only the default, "
                f"{default_data}, is prepared here)")
    runs_dir = a.runs or os.path.join(a.out, f"quality-{a.model}-{a.device}")
    os.makedirs(runs_dir, exist_ok=True)
    log = os.path.join(runs_dir, "commands.log")   # every `dtmt` command and its output
    if not os.path.isfile(os.path.join(a.data, "corpus.json")):
        dtmt(["prepare", "bible", "--out", a.data], log)
    runs = {}
    for seed in a.seeds:
        for amp in ("off", "bf16"):
            out = os.path.join(runs_dir, f"{amp}-seed{seed}")
            t0 = time.perf_counter()
            dtmt(["train", "--data", a.data, "--model", a.model, "--out", out, "--overwrite", "--device", a.device,
                  "--amp", amp, "--seed", str(seed), "--max-steps", str(a.steps), "--valid-every",
                  str(max(1, a.steps // 3)), "--patience", "0", "--progress", "none", "--bleu-sentences", "1",
                  *a.train_args.split()], log)
            rows = read_log(os.path.join(out, "train_log.csv"))
            train = [r for r in rows if r["kind"] == "train"]
            runs[(amp, seed)] = {
                "dev_loss": {int(r["step"]): float(r["dev_loss"]) for r in rows if r["kind"] == "valid"},
                # every window's target tokens over the time inside updates up to the last (elapsed_s: cumulative)
                "tok_s": sum(float(r["tokens"]) for r in train) / max(float(train[-1]["elapsed_s"]), 1e-9),
                "wall_s": time.perf_counter() - t0}
            print(f"  {amp:>4s} seed {seed}: dev loss {runs[(amp, seed)]['dev_loss']}, "
                  f"{runs[(amp, seed)]['tok_s']:,.0f} target tok/s", flush=True)
    steps = sorted(set.intersection(*(set(r["dev_loss"]) for r in runs.values())))
    lines = [f"bfloat16 autocast against float32 ({machine_name(a.device)}; `dtmt train --model {a.model} "
             f"{a.train_args}` on {a.data}, {a.steps} updates, seeds {a.seeds}, each seed's two runs one after the "
             f"other; dev loss: cross-entropy per target subword, no smoothing)", "",
             "| updates | float32 dev loss | bf16 dev loss | bf16 - float32 (means) | spread between seeds |",
             "|---:|---|---|---:|---:|"]
    verdict = []
    for step in steps:
        f32 = [runs[("off", s)]["dev_loss"][step] for s in a.seeds]
        b16 = [runs[("bf16", s)]["dev_loss"][step] for s in a.seeds]
        diff = statistics.mean(b16) - statistics.mean(f32)
        spread = max(max(f32) - min(f32), max(b16) - min(b16))
        verdict.append(abs(diff) <= spread)
        lines.append(f"| {step:,} | {' / '.join(f'{x:.3f}' for x in f32)} | {' / '.join(f'{x:.3f}' for x in b16)} | "
                     f"{diff:+.3f} | {spread:.3f} |")
    speed = statistics.mean(runs[("bf16", s)]["tok_s"] / runs[("off", s)]["tok_s"] for s in a.seeds)
    lines += ["", f"Target tokens/s, bf16 over float32 (time inside updates, mean over seeds): {speed:.2f}x. "
                  f"Within noise at every validation: {all(verdict)}."]
    text = "\n".join(lines)
    print("\n" + text)
    write_json(os.path.join(a.out, f"quality-{a.model}-{a.device}.json"),
               {"runs": {f"{k[0]}-seed{k[1]}": v for k, v in runs.items()}, "table": text,
                "within_noise": all(verdict), "speed_bf16_over_float32": speed})
    return {"within_noise": all(verdict), "speed": speed, "runs": runs}


def main(argv=None):
    if "--quality" in (sys.argv[1:] if argv is None else argv):
        return quality(sys.argv[1:] if argv is None else argv)
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_arguments(p)
    p.add_argument("--out", default=os.path.join(HERE, "out", "amp"))
    a = p.parse_args(argv)
    check_batch_arguments(p, a)
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
