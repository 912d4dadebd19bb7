"""Training throughput and memory of every system, fused backend against the reference backend, in one run.

    python benchmarks/bench_train.py                  # every system, small preset sizes, table + CSV + PNG
    python benchmarks/bench_train.py --systems dtmt transformer --steps 5 --quick
    python benchmarks/bench_train.py --one dtmt cpp --profile 25   # one pair, where its time goes
    python benchmarks/bench_train.py --one dtmt cuda --device cuda --preset paper --max-tokens 4000 --graphs on \
        --profile 30                                                # where a graphed update's device time goes
    python benchmarks/bench_train.py --device cuda --preset paper --fused cuda triton --max-tokens 4000
    python benchmarks/bench_train.py --device cuda --preset paper --systems dtmt --fused cuda --graphs on \
        --math strict tf32 bf16                                     # each math mode, the ratios in one run

Each (system, backend) pair is measured in a fresh subprocess (so the peak resident memory belongs to that
pair alone) on the same synthetic batches: a token budget of --max-tokens target tokens, source and target
lengths drawn from the length distribution of Bible verses (mean ~30 subwords), vocabularies of --vocab.
A training update is forward + backward + clipping + Adam step, as in `dtmt train` (with its malloc
settings: dtmt_models/training/allocator.py; DTMT_MALLOC=default for glibc's own). Reported:
  tok/s        target tokens per second over --steps updates after --warmup updates (median of the per-update
               rates is not used: total tokens over total time)
  saved_MB     bytes autograd keeps for backward in one update (tensors sharing storage counted once)
  peak_rss_MB  the subprocess's peak resident memory (model, optimizer, activations, the Python runtime)
  speedup      fused tok/s over reference tok/s of the same system
With --rounds N every pair is measured N times, each system's pairs one after the other and in the reverse order
every other round (the VM's speed drifts by 20% over minutes: one round's ratios moved by as much between runs,
2026-11-29); the table gives each pair's median tok/s and each ratio as the median of the rounds' ratios, with
their range; the CSV has every round's row.
Math (--math, each pair in every mode given): `strict`, float32 with TF32 off for cuBLAS and cuDNN (torch's default
for matmuls; cuDNN's own default allows TF32); `tf32`, float32 with both allowing TF32 (a GPU mode; the persistent
launches' products follow the same flag); `bf16`, strict float32 with each update's forward under torch.autocast in
bfloat16, as `dtmt train --amp bf16` runs it. The table's "× strict" is a mode's tok/s over strict's, round by round.
All systems are built from their `small` preset (`dtmt_models.models.presets`), so sizes are comparable to what
`dtmt train` trains by default (--quick: at tiny widths instead). The transformer has no recurrent layers: it is
listed once ("-" backend).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def synthetic_batches(n: int, max_tokens: int, vocab: int, seed: int = 0):
    """n batches of (src ids, tgt ids) pairs under a token budget; lengths ~ Bible verses (5-80, mean ~30)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(5, min(80, int(rng.gauss(30, 12))))
        pairs = []
        while (len(pairs) + 1) * (length + 1) <= max_tokens:
            s = max(3, length + rng.randint(-3, 3))
            t = max(3, length + rng.randint(-3, 3))
            pairs.append(([rng.randrange(4, vocab) for _ in range(s)], [rng.randrange(4, vocab) for _ in range(t)]))
        out.append(pairs)
    return out


MATH = ("strict", "tf32", "bf16")
VARIANTS = ("unrolled", "attention")   # BACKEND+VARIANT: measure_one's docstring


def training_update(model, opt, src, lengths, prev, target, autocast=None):
    """One training update as `dtmt train` makes it (forward with label smoothing 0.1, backward of the mean loss,
    clipping at 1.0, the optimizer's step): (loss, nll) detached and the number of target tokens. autocast: a
    callable giving the forward's context (the trainer's `--amp bf16`), or None."""
    import contextlib

    import torch

    with autocast() if autocast is not None else contextlib.nullcontext():
        loss, nll, n = model(src, lengths, prev, target=target, smoothing=0.1)
    opt.zero_grad(set_to_none=True)
    (loss / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach(), nll.detach(), n


def measure_one(system: str, backend: str, steps: int, warmup: int, max_tokens: int, vocab: int, threads: int,
                profile: int = 0, device: str = "cpu", preset: str = "small", tiny: bool = False,
                graphs: bool = False, math: str = "strict"):
    """One (system, backend) pair in this process, in math mode `math` (MATH; the module's docstring). With
    profile > 0, the timed updates run under torch.profiler and the `profile` ops with the most self CPU time are
    printed to stderr; on a CUDA device, with the device's activity too, the `profile` kernels with the most device
    time (a graphed update's kernels are listed one by one, under no op: kernel names say what ran), and the device
    time of all of them over the timed updates' wall time (`device_busy`). On a CUDA device the timed updates end
    with a synchronisation, and peak_gpu_MB is the device memory's peak. tiny: the preset's model at embedding /
    hidden widths 16 / 32 (the transformer 16 / 64; --quick: the plumbing, not a figure). graphs: the timed updates
    replayed as CUDA graphs (dtmt_models.training.graphs, as `dtmt train --cuda-graphs`), after two passes over all
    the batches (each bucket's first batch eager, its second captured: capture_s); on the CPU the capture is stood
    in for (the plumbing, not a figure). A backend written BACKEND+unrolled (e.g. cuda+unrolled) runs BACKEND with
    its step cells in `dk.nn.unrolled` blocks, their weight
    gradients once over all steps (dk.nn.UNROLLED_BACKENDS extended for this process); BACKEND+attention runs its
    attention on the attention ops' kernels (dk.functional.ATTENTION_KERNEL_BACKENDS extended: cuda's, not yet the
    default); both may be given (cuda+unrolled+attention)."""
    import contextlib

    import torch

    from dtmt_models.data.batching import collate
    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model
    from dtmt_models.training.allocator import tune_malloc

    if threads:
        torch.set_num_threads(threads)
    if math not in MATH or (math == "tf32" and not device.startswith("cuda")):
        raise SystemExit(f"bench_train.py: --math {math} is not a mode on {device} (strict or bf16 there; tf32 is a "
                         f"GPU mode)")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = math == "tf32"
    # as the trainer's autocast (no cache of cast weights under graphs: a capture would keep stale ones)
    autocast = ((lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16, cache_enabled=not graphs))
                if math == "bf16" else None)
    tune_malloc()   # as `dtmt train` (DTMT_MALLOC=default: glibc's own settings)
    torch.manual_seed(0)
    options = get_preset(system, preset)["model"]
    if tiny:
        options = dict(options, embed_dim=16, hidden_size=64 if system == "transformer" else 32)
    model = build_model(system, vocab, vocab, **options).to(device)
    base, *variants = backend.split("+")
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"bench_train.py: unknown backend variant {backend!r} (BACKEND+unrolled, BACKEND+attention)")
    if variants:
        import dtmt_kernels as dk
        name = dk.resolve_backend(base, torch.device(device)).name
        if "unrolled" in variants:
            dk.nn.UNROLLED_BACKENDS = dk.nn.UNROLLED_BACKENDS | {name}
        if "attention" in variants:
            dk.functional.ATTENTION_KERNEL_BACKENDS = dk.functional.ATTENTION_KERNEL_BACKENDS | {name}
    if backend != "-":
        model.set_backend(base)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = [tuple(t.to(device) for t in collate(b))
               for b in synthetic_batches(warmup + steps, max_tokens, vocab)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    runner, capture_s = None, None   # (graphs: GraphedUpdates, made after the warm-up)

    def update_parts(src, lengths, prev, target):
        return training_update(model, opt, src, lengths, prev, target, autocast)

    def update(batch, saved=None):
        if runner is not None:
            return int(runner.update(*batch)[2])
        if saved is None:
            return update_parts(*batch)[2]
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
            return update_parts(*batch)[2]

    class Saved:
        def __init__(self):
            self.seen, self.bytes = set(), 0

        def pack(self, t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in self.seen and not isinstance(t, torch.nn.Parameter):
                self.seen.add(key)
                self.bytes += key[1]
            return t

    saved = Saved()
    update(batches[0], saved)
    for b in batches[1:warmup]:
        update(b)
    if graphs:
        from dtmt_models.training.graphs import GraphedUpdates, StandInCapture

        runner = GraphedUpdates(update_parts, model, opt, torch.device(device),
                                capture=None if device.startswith("cuda") else StandInCapture(), log=lambda m: None)
        sync()
        t0 = time.perf_counter()
        for b in batches * 2:   # every bucket eager once, then captured
            runner.update(*b)
        sync()
        capture_s = time.perf_counter() - t0
    sync()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    on_gpu = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    prof = torch.profiler.profile(activities=activities) if profile else None
    with prof if prof is not None else contextlib.nullcontext():
        tokens, t0 = 0, time.perf_counter()
        for b in batches[warmup:]:
            tokens += update(b)
        sync()
        elapsed = time.perf_counter() - t0
    device_busy = None
    if prof is not None:
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=profile), file=sys.stderr)
        if on_gpu:
            print(device_time_table(prof, profile), file=sys.stderr)
            device_busy = kernel_microseconds(prof) / 1e6 / elapsed
    return {"system": system, "backend": backend,
            "graphs": ("on" if device.startswith("cuda") else "stand-in") if graphs else "off", "math": math,
            "params": sum(p.numel() for p in model.parameters()),
            "tok_s": tokens / elapsed, "ms_per_update": 1000 * elapsed / steps, "saved_MB": saved.bytes / 2 ** 20,
            "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_MB": torch.cuda.max_memory_allocated() / 2 ** 20 if device.startswith("cuda") else None,
            "captured": runner.captured if runner else None, "capture_s": capture_s,
            "pool_MB": runner.capturer.pool_bytes() / 2 ** 20 if runner else None, "device_busy": device_busy}


def _kernel_events(prof) -> list:
    """The device kernels a torch.profiler run recorded (name, µs), graph replays' kernels included."""
    import torch

    kernels = []
    for e in prof.events():   # (not the ranges of record_function that torch also marks on the device's timeline)
        if (getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.name
                and not getattr(e, "is_user_annotation", False) and not e.name.startswith(("Memcpy", "Memset"))):
            kernels.append((e.name, float(e.time_range.elapsed_us())))
    return kernels


def kernel_microseconds(prof) -> float:
    """The device time of every kernel a torch.profiler run recorded, µs (copies and memsets apart)."""
    return sum(us for _, us in _kernel_events(prof))


def device_time_table(prof, rows: int) -> str:
    """The `rows` kernel names with the most device time over a torch.profiler run, with their calls, total ms and
    share of all kernels' time: where an update's device time goes (kernels launched eagerly and replayed from a
    CUDA graph alike)."""
    import collections

    total, calls = collections.Counter(), collections.Counter()
    for name, us in _kernel_events(prof):   # (grouped by the whole name, shortened only to print)
        total[name] += us
        calls[name] += 1
    everything = sum(total.values()) or 1.0
    lines = [f"| kernel ({len(total)} names, {sum(calls.values())} launches, {everything / 1000:.1f} ms) | calls | "
             "ms | share |", "|---|---:|---:|---:|"]
    for name, us in total.most_common(rows):
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {calls[name]} | {us / 1000:.2f} | {100 * us / everything:.1f}% |")
    return "\n".join(lines)


def bucket_table(data: str, vocab_size: int, max_len: int, budgets, steps) -> list:
    """--buckets: how `dtmt train --cuda-graphs` buckets an epoch of `data`'s training pairs (its binarized corpus
    at BPE `vocab_size`, pairs up to `max_len` subwords, the trainer's batches of epoch 0, seed 1) for each token
    budget and (rows step, lengths step): the bucket shapes an epoch and the padded tokens (source + target) over
    those of the batches as collate pads them."""
    import collections

    from dtmt_models.data import binarized
    from dtmt_models.data.batching import kept_indices, token_batches
    from dtmt_models.training.graphs import GraphOptions, padded_shape

    lengths = binarized.open_binarized(data, "bpe", vocab_size).split("train").lengths()
    keep = kept_indices(lengths, max_len)
    rows = []
    for max_tokens in budgets:
        batches = token_batches(lengths, max_tokens, seed=1, epoch=0, keep=keep)
        for batch_step, length_step in steps:
            options = GraphOptions(length_step=length_step, batch_step=batch_step)
            shapes, real, padded = collections.Counter(), 0, 0
            for b in batches:
                B, S, T = len(b), int(lengths[b, 0].max()), int(lengths[b, 1].max()) + 1
                shape = padded_shape(B, S, T, options)
                shapes[shape] += 1
                real += B * (S + T)
                padded += shape[0] * (shape[1] + shape[2])
            rows.append(dict(max_tokens=max_tokens, batch_step=batch_step, length_step=length_step,
                             batches=len(batches), buckets=len(shapes), padded_over_real=padded / real))
    return rows


def run(argv=None):
    from common import (check_options, machine_name, make_out_dir, provenance, provenance_line,  # noqa: E402
                        write_csv)   # (same directory)

    from dtmt_models.models.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=sorted(PRESETS))
    p.add_argument("--fused", nargs="+", default=["auto"], type=backend_spec,
                   help="the fused backend(s) to compare with the reference (auto: cpp on CPU, cuda on a GPU); "
                        "BACKEND+unrolled: BACKEND with its step cells' weight gradients once over all steps "
                        "(dk.nn.unrolled); BACKEND+attention: its attention on the attention ops' kernels (cuda's "
                        "are not yet the default); both: BACKEND+unrolled+attention. A variant's ratio to BACKEND "
                        "is printed below the table")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--preset", default="small", choices=["small", "paper"], help="the systems' sizes")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every pair this many times, each system's pairs in turn and in the reverse order "
                        "every other round; the table gives medians, a ratio the median of the rounds' ratios")
    p.add_argument("--max-tokens", type=int, default=2000,
                   help="target tokens a batch (at least 81: a pair of the longest synthetic length)")
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--graphs", nargs="+", choices=("off", "on"), default=["off"],
                   help="eager updates (off) and/or updates replayed as CUDA graphs (on), each pair in both; on the "
                        "CPU 'on' stands the capture in (the plumbing, not a figure)")
    p.add_argument("--math", nargs="+", choices=MATH, default=["strict"],
                   help="math mode(s), each pair in every one given (strict, tf32, bf16: the module's docstring); "
                        "tf32 on a GPU only")
    p.add_argument("--quick", action="store_true",
                   help="a tiny run of tiny models (for the tests: the plumbing, not a figure)")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--one", nargs=2, metavar=("SYSTEM", "BACKEND"),
                   help="measure one pair in this process (e.g. --one dtmt cpp), printing a JSON row")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --one: profile the timed updates and print the N ops with most self CPU time")
    p.add_argument("--buckets", metavar="DATA", default=None,
                   help="instead: the bucket shapes and padding of `dtmt train --cuda-graphs` on the prepared "
                        "corpus DATA, one epoch at 2,000 / 4,000 / 8,000 tokens a batch (BPE --vocab, pairs up to "
                        "100 subwords)")
    a = p.parse_args(argv)
    check_options(p, a, (("steps", 1), ("warmup", 0), ("rounds", 1), ("max_tokens", 81), ("vocab", 5),
                         ("threads", 0), ("profile", 0)), systems=("systems", PRESETS), device="device")
    if a.buckets:
        from dtmt_models.data.corpus import CorpusError, corpus_paths

        try:   # (a corpus that is not there, or not binarized at --vocab: a traceback)
            corpus_paths(a.buckets, "train")
            rows = bucket_table(a.buckets, a.vocab, 100, (2000, 4000, 8000), ((8, 8), (16, 8), (16, 16)))
        except CorpusError as exc:
            p.error(f"--buckets {a.buckets}: {exc}")
        print(provenance_line(provenance(__file__, argv, a.device)))
        print(f"Buckets of --cuda-graphs, one epoch of {a.buckets} (BPE {a.vocab}, seed 1, epoch 0)\n\n"
              "| tokens a batch | rows / lengths step | batches | buckets | padded tokens over real ones |\n"
              "|---:|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['max_tokens']:,} | {r['batch_step']} / {r['length_step']} | {r['batches']} | {r['buckets']} "
                  f"| {r['padded_over_real']:.2f} |")
        return rows
    if a.quick:
        a.steps, a.warmup, a.max_tokens, a.vocab = 2, 1, 300, 200
    if "tf32" in a.math and not a.device.startswith("cuda"):
        p.error("--math tf32 is a GPU mode (with --device cuda)")
    if a.one:
        if a.one[0] not in PRESETS:   # (a KeyError's traceback in the build)
            p.error(f"--one {a.one[0]}: not a system (one of {', '.join(sorted(PRESETS))})")
        if a.one[1] != "-":
            try:
                backend_spec(a.one[1])
            except argparse.ArgumentTypeError as exc:
                p.error(f"--one {' '.join(a.one)}: {exc} (or - for a system without recurrent layers)")
        if len(a.math) > 1 or len(a.graphs) > 1:
            p.error("--one measures one pair in one mode: one --math and one --graphs")
        # (the header to stderr: this mode's stdout is one JSON row, which the table's run and a profile's file read)
        print(provenance_line(provenance(__file__, argv, a.device)), file=sys.stderr, flush=True)
        print(json.dumps(measure_one(*a.one, a.steps, a.warmup, a.max_tokens, a.vocab, a.threads, a.profile,
                                     a.device, a.preset, tiny=a.quick, graphs=a.graphs == ["on"], math=a.math[0])))
        return []
    make_out_dir(p, a.out)
    record = provenance(__file__, argv, a.device)
    print(provenance_line(record), flush=True)
    runs = []   # one row per pair and round
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pairs = [(s, b, g, m) for s in a.systems for b in (("-",) if s == "transformer" else (*a.fused, "reference"))
             for g in a.graphs for m in a.math]
    failed = {}   # a pair whose run failed: its message, the pair left out of later rounds and of the table (one
    #               failed capture had lost every pair's measurements, the table never written)
    for rnd in range(a.rounds):
        # each system's pairs one after the other, in the reverse order every other round (a machine whose speed
        # drifts favours neither side of a ratio)
        order = pairs if rnd % 2 == 0 else [p for s in a.systems for p in reversed([q for q in pairs if q[0] == s])]
        for system, backend, graphs, math in order:
            if (system, backend, graphs, math) in failed:
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--one", system, backend, "--steps", str(a.steps),
                   "--warmup", str(a.warmup), "--max-tokens", str(a.max_tokens), "--vocab", str(a.vocab),
                   "--threads", str(a.threads), "--device", a.device, "--preset", a.preset, "--graphs", graphs,
                   "--math", math, *(["--quick"] if a.quick else [])]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                tail = "\n".join(r.stderr.strip().splitlines()[-12:])
                failed[(system, backend, graphs, math)] = f"{system}/{backend} (graphs {graphs}, math {math}) failed"
                print(f"  round {rnd + 1}: {failed[(system, backend, graphs, math)]} (left out):\n{tail}", flush=True)
                continue
            row = dict(json.loads(r.stdout.strip().splitlines()[-1]), round=rnd + 1)
            runs.append(row)
            gpu = f"  {row['peak_gpu_MB']:7.0f} MB GPU peak" if row.get("peak_gpu_MB") is not None else ""
            print(f"  round {rnd + 1}: {system:<14s} {backend:<9s} graphs {graphs:<3s} {math:<6s} "
                  f"{row['tok_s']:9,.0f} tok/s  "
                  f"{row['saved_MB']:8.1f} MB saved  {row['peak_rss_MB']:7.0f} MB peak{gpu}", flush=True)
    key = lambda r: (r["system"], r["backend"], r["graphs"], r["math"])  # noqa: E731
    by_round = {(key(r), r["round"]): r for r in runs}

    def ratios(r, other):
        """The ratio of r's tok/s to `other`'s (a key) in each round: the same run, the same minutes."""
        return [by_round[(key(r), n)]["tok_s"] / by_round[(other, n)]["tok_s"] for n in range(1, a.rounds + 1)
                if (other, n) in by_round]

    rows = []   # one per pair: medians over the rounds
    for k in dict.fromkeys(key(r) for r in runs):
        rs = [r for r in runs if key(r) == k]
        row = dict(rs[0], rounds=len(rs), tok_s=statistics.median(r["tok_s"] for r in rs),
                   ms_per_update=statistics.median(r["ms_per_update"] for r in rs))
        row.pop("round")
        rows.append(row)
    for r in rows:   # the fused backend against the reference, and graphs against eager, round by round
        ref = (ratios(r, (r["system"], "reference", r["graphs"], r["math"])) if r["backend"] not in ("reference", "-")
               else [])
        r["speedup"] = statistics.median(ref) if ref else None
        r["speedup_range"] = (min(ref), max(ref)) if len(ref) > 1 else None
        eager = ratios(r, (r["system"], r["backend"], "off", r["math"])) if r["graphs"] != "off" else []
        r["graphs_vs_eager"] = statistics.median(eager) if eager else None
        strict = ratios(r, (r["system"], r["backend"], r["graphs"], "strict")) if r["math"] != "strict" else []
        r["vs_strict"] = statistics.median(strict) if strict else None
    by = {key(r): r for r in rows}
    fields = ["system", "backend", "graphs", "math", "round", "params", "tok_s", "ms_per_update", "saved_MB",
              "peak_rss_MB", "peak_gpu_MB", "captured", "capture_s", "pool_MB"]
    write_csv(os.path.join(a.out, "bench_train.csv"), runs, fields,   # every round's measurement
              comment=provenance_line(record))
    sizes = (f"{a.preset} presets at widths 16 / 32, the transformer 16 / 64 (--quick)" if a.quick
             else f"{a.preset} presets")
    print(f"\nTraining throughput ({machine_name(a.device)}; {sizes}, max_tokens {a.max_tokens}, "
          f"vocab {a.vocab}, math {' / '.join(a.math)}, {a.steps} updates after {a.warmup} warm-up"
          + (f"; {a.rounds} rounds, each pair's median, ratios the median of the rounds' (their range)"
             if a.rounds > 1 else "") + ")\n")
    on_gpu = a.device.startswith("cuda")
    graphed = a.graphs != ["off"]
    maths = a.math != ["strict"]
    print("| system | backend |" + (" graphs |" if graphed else "") + (" math |" if maths else "")
          + " params | target tok/s | ms/update | saved MB | peak RSS MB |" + (" peak GPU MB |" if on_gpu else "")
          + " fused/ref |" + (" × strict |" if maths else "")
          + (" graphs/eager | captured | capture s | pool MB |" if graphed else ""))
    print("|---|---|" + ("---|" if graphed else "") + ("---|" if maths else "") + "---:|---:|---:|---:|---:|"
          + ("---:|" if on_gpu else "") + "---:|" + ("---:|" if maths else "")
          + ("---:|---:|---:|---:|" if graphed else ""))
    for r in rows:
        sp = f"{r['speedup']:.2f}×" if r["speedup"] else ""
        if r["speedup_range"]:
            sp += f" ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})"
        gpu = f" {r['peak_gpu_MB']:.0f} |" if on_gpu else ""
        extra = ""
        if graphed:
            ge = f"{r['graphs_vs_eager']:.2f}×" if r["graphs_vs_eager"] else ""
            extra = (f" {ge} | {r['captured'] if r['captured'] is not None else ''} | "
                     f"{'' if r['capture_s'] is None else format(r['capture_s'], '.1f')} | "
                     f"{'' if r['pool_MB'] is None else format(r['pool_MB'], ',.0f')} |")
        vs = (f" {r['vs_strict']:.2f}× |" if r["vs_strict"] else " |") if maths else ""
        print(f"| {r['system']} | {r['backend']} |" + (f" {r['graphs']} |" if graphed else "")
              + (f" {r['math']} |" if maths else "")
              + f" {r['params']:,} | {r['tok_s']:,.0f} | {r['ms_per_update']:.0f} | {r['saved_MB']:.1f} | "
              f"{r['peak_rss_MB']:.0f} |{gpu} {sp} |{vs}{extra}")
    for r in rows:   # a backend variant against its backend, round by round
        base = r["backend"].partition("+")[0]
        if base != r["backend"]:
            vs = ratios(r, (r["system"], base, r["graphs"], r["math"]))
            if vs:
                spread = f" ({min(vs):.2f}-{max(vs):.2f})" if len(vs) > 1 else ""
                print(f"\n{r['system']}: {r['backend']} against {base}: {statistics.median(vs):.2f}× the target tok/s"
                      f"{spread}")
    if rows:   # (no pair ran: no figure)
        draw_throughput(rows, by, graphed, maths, os.path.join(a.out, "bench_train.png"))
    if failed:   # (after the table of the others: exit status 1, each failure named)
        raise SystemExit("bench_train: " + "; ".join(failed.values()) + " (their messages above)")
    return rows


def draw_throughput(rows, by, graphed: bool, maths: bool, path: str) -> None:
    """The throughput figure: target tokens/s of each pair, by system (nothing where matplotlib is absent)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    series = list(dict.fromkeys((r["backend"], r["graphs"], r["math"]) for r in rows))
    width = 0.8 / len(series)
    for i, (backend, graphs, math) in enumerate(series):
        xs = [j + width * i for j, s in enumerate(systems) if (s, backend, graphs, math) in by]
        ys = [by[(s, backend, graphs, math)]["tok_s"] for s in systems if (s, backend, graphs, math) in by]
        name = backend if backend != "-" else "(no recurrent layers)"
        ax.bar(xs, ys, width=width, label=name + (f", graphs {graphs}" if graphed else "")
               + (f", {math}" if maths else ""))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(systems))], systems, rotation=20, fontsize=8)
    ax.set_ylabel("target tokens / s")
    ax.legend(fontsize=8)
    ax.set_title("training throughput", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def backend_spec(value: str) -> str:
    """--fused's values: a backend name, optionally with variants (BACKEND+unrolled, BACKEND+attention, both)."""
    from dtmt_kernels.backends import BACKEND_NAMES

    base, *variants = value.split("+")
    if base not in BACKEND_NAMES or set(variants) - set(VARIANTS) or len(set(variants)) < len(variants):
        raise argparse.ArgumentTypeError(f"{value!r}: a backend ({', '.join(BACKEND_NAMES)}) with at most the "
                                         f"variants +unrolled and +attention")
    return value


def main(argv=None):
    sys.path.insert(0, HERE)
    return run(argv)


if __name__ == "__main__":
    main()
