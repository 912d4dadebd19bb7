"""What the transition weights' per-forward forms and the layers' batch-first transposes cost in a training update
(issue 75 item 5: is forming the flat weights once per model, or kernels that take the batch-first layout, worth
their complexity?).

    python benchmarks/bench_forms.py                      # dtmt, small preset, cpp backend, 2 threads
    python benchmarks/bench_forms.py --system rnnsearch-atr --updates 30

On `bench_train.py`'s synthetic batches (a 2,000-target-token budget, Bible-like lengths), after --warmup updates:
  update_ms     a training update (forward, backward, clipping, Adam), the mean over --updates
  forms_ms      the time inside the layers' and cells' weight forming (`direction_weights`, `kernel_params`:
                the dict of parameters, the widened biases, the stacked T-GRU weights), measured around each
                outermost call, forward only (their backward is a split of the gradients), per update
  transposes_ms for every batch-first sequence layer, forward + backward of the layer on its input as batch-first
                minus the same on the same data time-major (the layer's transposes and the copies they cause),
                medians over --repeats alternated pairs, summed over the layers' calls in an update: a
                difference of two timings, each with its noise, so that it can come out negative where the
                transposes cost less than that noise (few --repeats, a busy machine); it is reported as measured,
                with `transposes_note` saying so, not clamped at 0
and each as a share of the update. Both are measured in one process, the layouts alternated.
The run's header (`common.provenance`: machine, commit, date, torch, command) goes to stderr first and into the
JSON as `run` (stdout is the JSON alone)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def transposes_note(transposes_s: float, repeats: int):
    """What a negative transposes figure means, in words (None where it is not negative): the batch-first calls'
    median ran faster than the time-major ones', so the transposes cost less than the two timings' noise; it is not a
    saving. (A difference of two medians, reported as measured rather than clamped at 0.)"""
    if transposes_s >= 0:
        return None
    return (f"negative: the batch-first calls' median ran faster than the time-major calls' over {repeats} "
            f"repeat(s): the transposes cost less than the timings' noise here, not a saving (more --repeats narrow "
            f"it)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default="dtmt")
    p.add_argument("--preset", default="small")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)
    from benchmarks.common import check_options, provenance, provenance_line
    from dtmt_models.models.presets import get_preset

    # before anything runs: --updates 0 was a ZeroDivisionError, --repeats 0 an empty median, --warmup 0 timed no
    # layer call without a word, --max-tokens 0 made no batch, --threads 0 torch's error, --system / --preset a
    # traceback (the transposes are measured on the layer calls of the last warm-up update)
    check_options(p, a, (("updates", 1), ("warmup", 1), ("repeats", 1), ("max_tokens", 81), ("threads", 1)))
    try:
        options = get_preset(a.system, a.preset)["model"]
    except ValueError as exc:
        p.error(f"--system {a.system} --preset {a.preset}: {exc}")
    if a.json:   # (before the measurement: a --json in a missing folder failed after it)
        folder = os.path.dirname(os.path.abspath(a.json))
        if not os.path.isdir(folder) or os.path.isdir(a.json):
            p.error(f"--json {a.json}: " + ("a folder" if os.path.isdir(a.json) else f"no folder {folder}"))

    run_record = provenance(__file__, argv)
    print(provenance_line(run_record), file=sys.stderr, flush=True)

    import torch

    import dtmt_kernels as dk
    from dtmt_kernels import _C
    from benchmarks.bench_train import synthetic_batches, training_update
    from dtmt_models.data.batching import collate
    from dtmt_models.models.registry import build_model
    from dtmt_models.training.allocator import tune_malloc

    torch.set_num_threads(a.threads)
    tune_malloc()
    torch.manual_seed(0)
    model = build_model(a.system, 4000, 4000, **options)
    model.set_backend("cpp")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = [collate(b) for b in synthetic_batches(a.warmup + a.updates, a.max_tokens, 4000)]

    # the weight forming, timed around each outermost call
    base = dk.nn._TransitionBase   # where both are defined, for the layers and the cells
    spent, depth = [0.0], [0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - t0
        return wrapper

    # the sequence layers' calls: (layer, input shape) of one update
    calls = []

    def record(layer, args, kwargs):
        calls.append((layer, tuple(args[0].shape), kwargs.get("lengths", args[2] if len(args) > 2 else None)))

    layers = [m for m in model.modules() if isinstance(m, dk.nn.TransitionLayer) and m.batch_first]
    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in layers]

    def update(*batch):
        training_update(model, opt, *batch)

    for b in batches[:a.warmup]:
        update(*b)
    for h in hooks:
        h.remove()
    one_update_calls = calls[-len(layers):] if layers else []

    originals = base.direction_weights, base.kernel_params
    base.direction_weights, base.kernel_params = timed(originals[0]), timed(originals[1])
    try:
        t0 = time.perf_counter()
        for b in batches[a.warmup:]:
            update(*b)
        update_s = (time.perf_counter() - t0) / a.updates
    finally:
        base.direction_weights, base.kernel_params = originals
    forms_s = spent[0] / a.updates

    # the transposes: each recorded call, batch-first against time-major on the same data, alternated
    transposes_s = 0.0
    for layer, shape, lengths in one_update_calls:
        x = torch.randn(shape, requires_grad=True)
        xt = x.detach().transpose(0, 1).contiguous().requires_grad_()

        def run(inp, batch_first):
            layer.batch_first = batch_first
            try:
                out, h = layer(inp, lengths=lengths)
                (out.sum() + h.sum()).backward()
            finally:
                layer.batch_first = True

        times = {True: [], False: []}
        for i in range(a.repeats + 1):
            for bf in ((True, False) if i % 2 else (False, True)):
                t0 = time.perf_counter()
                run(x if bf else xt, bf)
                if i:   # (the first pair warms up)
                    times[bf].append(time.perf_counter() - t0)
        transposes_s += statistics.median(times[True]) - statistics.median(times[False])
    model.zero_grad(set_to_none=True)

    result = {"system": a.system, "preset": a.preset, "threads": a.threads, "update_ms": 1e3 * update_s,
              "forms_ms": 1e3 * forms_s, "forms_share": forms_s / update_s,
              "transposes_ms": 1e3 * transposes_s, "transposes_share": transposes_s / update_s,
              "layer_calls": len(one_update_calls), "cpu_isa": _C.cpu_isa(), "run": run_record}
    note = transposes_note(transposes_s, a.repeats)
    if note:
        result["transposes_note"] = note
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
