"""Where a batch-1 translation's time goes, phase by phase, from the timers compiled into the extension.

    DTMT_PHASE_TIMERS=1 python setup.py build_ext --inplace      # a build with the timers (csrc/phase_timers.h)
    python benchmarks/bench_step_phases.py --checkpoint benchmarks/out/dev_dtmt/best.pt --threads 1
    python setup.py build_ext --inplace                           # back to the build without them

Translates the first --sentences test sources of --data one at a time (`translate` with a decoder built once, as
`dtmt translate` does), after one untimed sentence, and reports for each phase of the
C++ search (csrc/phase_timers.h) its time per sentence or per decoder step and its calls. Phases nest: a step holds
the query cell, attention, weighing, decoder cell, readout, output product and log-softmax; a cell (query and
decoder alike, so two calls a step, shown once under the query cell) holds its recurrent product, its row pass and
its T-GRUs' product and row pass;
the attention holds its query product, scores and softmax. Each timed scope costs two clock reads (tens of ns), so a
timers build runs a little slower than a plain one: compare phases with each other, and time speed with the plain
build (bench_pages, bench_decode). Output: a table on stdout and, with --out, OUT/bench_step_phases.md and .json.
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

# (phase, depth in the table, per): per "sentence" or per "step" (a decoder step of the search)
LAYOUT = [("encode", 0, "sentence"), ("search", 0, "sentence"), ("search_setup", 1, "sentence"),
          ("step", 1, "step"), ("query_cell", 2, "step"), ("recurrent_product", 3, "step"), ("cell_rows", 3, "step"),
          ("tgru_product", 3, "step"), ("tgru_rows", 3, "step"), ("attention", 2, "step"),
          ("query_product", 3, "step"), ("scores", 3, "step"), ("attention_softmax", 3, "step"),
          ("weigh", 2, "step"), ("decoder_cell", 2, "step"), ("readout", 2, "step"), ("output_product", 2, "step"),
          ("log_softmax", 2, "step"), ("token_rows", 1, "step"), ("eos_mask", 1, "step"),
          ("top_candidates", 1, "step"), ("bookkeeping", 1, "step")]
NOTES = {"recurrent_product": "both cells: within query_cell and decoder_cell",
         "cell_rows": "both cells", "tgru_product": "both cells", "tgru_rows": "both cells",
         "decoder_cell": "its parts in the rows under query_cell", "weigh": "steps with the context's products",
         "scores": "with the query's layer norm, where there is one",
         "attention_softmax": "with the context where a step computes one",
         "eos_mask": "with the log-probabilities as float32"}


DEFAULT_CHECKPOINT = os.path.join(ROOT, "benchmarks", "out", "dev_dtmt", "best.pt")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--sentences", type=int, default=200, help="the first N test sources (default 200)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--out", default=None, help="write bench_step_phases.md and .json here")
    a = p.parse_args(argv)
    from common import check_options
    from dtmt_models.decoding.hypotheses import MAX_BEAM

    check_options(p, a, (("sentences", 1), ("threads", 1), ("beam", 1, MAX_BEAM)))
    from dtmt_kernels import _C

    if not _C.PHASE_TIMERS:
        raise SystemExit("bench_step_phases: this build of dtmt_kernels has no phase timers; build one with "
                         "`DTMT_PHASE_TIMERS=1 python setup.py build_ext --inplace` (and rebuild without it after)")
    from common import DEV_DTMT_MADE_BY, check_checkpoint

    check_checkpoint(p, a.checkpoint, DEFAULT_CHECKPOINT, DEV_DTMT_MADE_BY)   # (a FileNotFoundError's traceback)
    import torch
    from common import machine_name, torch_threads, write_report

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model

    model, sv, tv, _ = load_model(a.checkpoint)
    sources = [s for s, _ in read_parallel(*corpus_paths(a.data, "test"))][:a.sentences]
    with torch_threads(a.threads), torch.no_grad():
        decoder = model.inference_decoder()
        translate(model, sv, tv, sources[:1], beam=a.beam, decoder=decoder)   # out of the timing
        _C.reset_phase_times()
        t0 = time.perf_counter()
        for s in sources:
            translate(model, sv, tv, [s], beam=a.beam, decoder=decoder)
        seconds = time.perf_counter() - t0
    times = {name: (sec, calls) for name, sec, calls in _C.phase_times()}
    n, steps = len(sources), max(times["step"][1], 1)
    rows = []
    for name, depth, per in LAYOUT:
        sec, calls = times[name]
        each = sec / (n if per == "sentence" else steps)
        rows.append({"phase": name, "depth": depth, "per": per, "seconds": sec, "calls": calls,
                     "us_each": each * 1e6, "share": sec / seconds})
    inside = times["encode"][0] + times["search"][0]
    result = {"machine": machine_name(threads=False), "checkpoint": os.path.relpath(a.checkpoint, ROOT),
              "sentences": n, "threads": a.threads, "beam": a.beam, "seconds": seconds,
              "ms_a_sentence": seconds / n * 1e3, "steps_a_sentence": steps / n,
              "outside_ms_a_sentence": (seconds - inside) / n * 1e3, "phases": rows}
    text = table(result)
    print(text, end="")
    if a.out:
        write_report(a.out, "bench_step_phases", text, result)
    return result


def table(r: dict) -> str:
    lines = [f"Batch-1 phases, {r['machine']}, {r['threads']} thread(s); {r['checkpoint']}, the first "
             f"{r['sentences']} test sources one at a time, beam {r['beam']} (a build with DTMT_PHASE_TIMERS=1; "
             f"`python benchmarks/bench_step_phases.py`): {r['ms_a_sentence']:.2f} ms a sentence, "
             f"{r['steps_a_sentence']:.1f} decoder steps a sentence, {r['outside_ms_a_sentence']:.2f} ms a sentence "
             f"outside the `encode` and `search` phases (Python, tokenising, the first state; and the encoder where "
             f"it is not a FrozenTransitionLayer's op).", "",
             "| phase | time | calls | share of the sentence |", "|---|---:|---:|---:|"]
    for row in r["phases"]:
        unit = "ms a sentence" if row["per"] == "sentence" else "µs a step"
        value = row["us_each"] / 1e3 if row["per"] == "sentence" else row["us_each"]
        note = f" ({NOTES[row['phase']]})" if row["phase"] in NOTES else ""
        lines.append(f"| {'&nbsp;&nbsp;' * row['depth']}{row['phase']}{note} | {value:.2f} {unit} | {row['calls']:,} "
                     f"| {100 * row['share']:.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
