"""Quality per wall-clock: every system trained on the same corpus for the same training-time budget.

    python benchmarks/bench_quality.py                                   # all systems, 10 min each, Bible
    python benchmarks/bench_quality.py --systems dtmt transformer --budget 30m
    python benchmarks/bench_quality.py --systems dtmt transformer --budget 1h --parallel   # side by side
    python benchmarks/bench_quality.py --quick                           # tiny, for the tests
    python benchmarks/bench_quality.py --systems base=dtmt "drop01=dtmt --opt dropout=0.1" --threads 1

A --systems entry is a system name, or LABEL=SYSTEM followed by extra `dtmt train` arguments for that run only
(preset variants side by side; the label names the run's folder and its row).

For each system (its `small` preset) this runs `dtmt train --max-time BUDGET` on --data (default data/bible,
prepared with `dtmt prepare bible` if missing; another --data must be a prepared corpus) into --out/LABEL (a run
already there is refused, or replaced with --overwrite), then `dtmt evaluate` of best.pt on dev and test with beam 4,
and reports parameters, training target tokens/s, decoding words/s (test, beam 4, batched), dev and test BLEU
and chrF. Output in --out: bench_quality.md (the Markdown table, with machine and settings), bench_quality.csv,
and bench_quality.png (dev BLEU against training time, from each run's validations). Training time excludes
validation, so the budget buys the same number of training seconds for every system. With --parallel the
systems train at the same time, each on cores / systems threads (its log in train_SYSTEM.log): half the wall
time for two systems, and anything else the machine does slows them alike.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def start(args, log, runner=()):
    """Starts `dtmt ARGS` with its output appended to `log` (through `runner`, a script that runs the module, where
    given: bench_peers' strict_fp32.py); returns (process, args, log)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, *runner, "-m", "dtmt_models.cli", *args]
    with open(log, "a") as f:
        f.write("$ dtmt " + " ".join(args) + "\n")
        f.flush()
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), args, log


def wait(job):
    proc, args, log = job
    if proc.wait() != 0:
        raise RuntimeError(f"dtmt {' '.join(args)} failed (exit {proc.returncode}); see {log}")


def dtmt(args, log):
    wait(start(args, log))


def dtmt_here(args, log):
    """`dtmt ARGS` in this process (no interpreter and torch to start again), its Python output appended to `log`;
    what it built is freed before the next (a decoder refers to itself: only the cycle collector frees it)."""
    import contextlib
    import gc

    from dtmt_models.cli import main as cli

    with open(log, "a") as f:
        f.write("$ dtmt " + " ".join(args) + "\n")
        f.flush()
        with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                code = cli(args)
            except SystemExit as exc:   # argparse's errors
                code = exc.code if isinstance(exc.code, int) else 1
    gc.collect()
    if code != 0:
        raise RuntimeError(f"dtmt {' '.join(args)} failed (exit {code}); see {log}")


def read_log(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None):
    from common import check_options, machine_name, write_csv

    import dtmt_models.models.systems  # noqa: F401  (all model code loaded now, not hours later for the table)
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.models.presets import PRESETS
    from dtmt_models.cli.train import parse_duration

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=sorted(PRESETS))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--budget", default="10m", help="training time per system (e.g. 90s, 10m, 1h)")
    p.add_argument("--valid-every", type=int, default=200)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=0,
                   help="threads per training (default: torch's; with --parallel: the cores shared out)")
    p.add_argument("--parallel", action="store_true",
                   help="train all systems at once, each on its share of the cores, so that whatever else "
                        "runs on the machine slows them alike (then evaluate one after another)")
    p.add_argument("--no-train", action="store_true",
                   help="evaluate and tabulate the runs already in --out (e.g. after an interrupted benchmark)")
    p.add_argument("--quick", action="store_true", help="toy settings for the tests (use with a toy --data)")
    p.add_argument("--train-args", default="", help="extra `dtmt train` arguments, e.g. \"--vocab-size 2000\"")
    p.add_argument("--out", default=os.path.join(HERE, "out", "quality"))
    p.add_argument("--overwrite", action="store_true", help="replace the runs already in --out (each LABEL's folder)")
    a = p.parse_args(argv)
    from dtmt_models.decoding.hypotheses import MAX_BEAM
    try:
        budget = parse_duration(a.budget)
    except ValueError as exc:
        p.error(str(exc).replace("--max-time", "--budget"))
    # (checked before any training: --beam 0 was refused by `dtmt evaluate` after every system's budget was spent)
    if not 1e-3 <= budget < float("inf"):   # (inf passed here, and `dtmt train` refused it in a traceback)
        p.error(f"--budget {budget:g}: must be a finite duration >= 0.001 (seconds)")
    check_options(p, a, (("valid_every", 1), ("beam", 1, MAX_BEAM), ("threads", 0)))
    default_data = os.path.join(ROOT, "data", "bible")
    if not os.path.isfile(os.path.join(a.data, "corpus.json")) and \
            os.path.abspath(a.data) != os.path.abspath(default_data):   # (a mistyped --data got a Bible built there)
        p.error(f"--data {a.data}: no corpus.json; make the corpus with `dtmt prepare` (only the default, "
                f"{default_data}, is prepared here)")
    extra = a.train_args.split()
    if a.quick:   # (first: a --train-args given with it overrides them, as the last of a flag given twice wins)
        extra = ["--vocab-size", "60", "--opt", "embed_dim=16", "--opt", "hidden_size=16", "--max-tokens", "300",
                 *extra]
    runs = {}
    for entry in a.systems:
        head, *own = entry.split() or [""]
        label, labelled, system = head.partition("=")
        if not labelled:
            system = label
        if system not in PRESETS or not label or label in runs or (own and not labelled):
            p.error(f"--systems {entry!r}: expected SYSTEM or LABEL=SYSTEM [ARGS] with a new label and one of "
                    f"{', '.join(sorted(PRESETS))}")
        runs[label] = (system, own)
    a.systems = list(runs)
    if not (a.no_train or a.overwrite):   # (`dtmt train --overwrite` below replaced them without a word)
        held = [label for label in a.systems for name in ("best.pt", "last.pt", "train_log.csv")
                if os.path.exists(os.path.join(a.out, label, name))]
        if held:
            p.error(f"--out {a.out}: already holds the run of {', '.join(dict.fromkeys(held))}; add --overwrite to "
                    f"replace it, --no-train to evaluate it, or choose another --out")
    if a.no_train:
        missing = [s for s in a.systems if not os.path.isfile(os.path.join(a.out, s, "best.pt"))]
        if missing:
            p.error(f"--no-train: no best.pt in {a.out} for {', '.join(missing)}")
    # (made after every check: a refused --systems had left an empty folder)
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "bench_quality.log")
    if not os.path.isfile(os.path.join(a.data, "corpus.json")):
        dtmt(["prepare", "bible", "--out", a.data], log)
    threads = a.threads or (max(1, (os.cpu_count() or 1) // len(a.systems)) if a.parallel else 0)

    def train(label):
        system, own = runs[label]
        print(f"== {label}: training for {a.budget}" + (f" on {threads} thread(s)" if threads else "")
              + (f" ({system} {' '.join(own)})" if label != system or own else ""), flush=True)
        run = os.path.join(a.out, label)
        return start(["train", "--data", a.data, "--model", system, "--out", run, "--overwrite", "--max-time",
                      a.budget, "--valid-every", str(a.valid_every), "--patience", "0", "--progress", "lines",
                      "--log-every", "50", *(["--threads", str(threads)] if threads else []), *extra, *own],
                     os.path.join(a.out, f"train_{label}.log") if a.parallel else log)

    if a.parallel and not a.no_train:
        jobs = [train(system) for system in a.systems]
        try:
            for job in jobs:
                wait(job)
        finally:   # one failed (or Ctrl-C): stop the others rather than leave them training
            for proc, _, _ in jobs:
                if proc.poll() is None:
                    proc.terminate()
    rows = []
    for system in a.systems:
        run = os.path.join(a.out, system)
        if not (a.parallel or a.no_train):
            wait(train(system))
        train_rows = read_log(os.path.join(run, "train_log.csv"))
        tr = [r for r in train_rows if r["kind"] == "train"]
        valid = [r for r in train_rows if r["kind"] == "valid"]
        tokens = sum(int(r["tokens"]) for r in tr)
        elapsed = float(tr[-1]["elapsed_s"]) if tr else float("nan")
        row = {"system": system, "steps": int(train_rows[-1]["step"]), "train_s": elapsed,
               "train_tok_s": tokens / elapsed if tr else float("nan"),
               "curve": [(float(r["elapsed_s"]), float(r["dev_bleu"])) for r in valid]}
        for split in ("dev", "test"):
            out = os.path.join(run, f"eval_{split}")
            dtmt_here(["evaluate", "--checkpoint", os.path.join(run, "best.pt"), "--data", a.data, "--split", split,
                       "--beam", str(a.beam), "--out-dir", out, "--quiet"], log)
            with open(os.path.join(out, "scores.json")) as f:
                s = json.load(f)
            row[f"{split}_bleu"], row[f"{split}_chrf"] = s["bleu"], s["chrf"]
            if split == "test":
                row["decode_words_s"] = s["decode"]["hyp_words_per_s"]
        model = load_model(os.path.join(run, "best.pt"))[0]
        row["params"] = sum(p.numel() for p in model.parameters())  # a tied embedding counted once
        rows.append(row)
        print(f"   {row['steps']} updates, {row['train_tok_s']:,.0f} tok/s; dev BLEU {row['dev_bleu']:.2f}, "
              f"test BLEU {row['test_bleu']:.2f}", flush=True)
    fields = ["system", "params", "steps", "train_s", "train_tok_s", "decode_words_s", "dev_bleu", "dev_chrf",
              "test_bleu", "test_chrf"]
    write_csv(os.path.join(a.out, "bench_quality.csv"), rows, fields)
    lines = [f"Quality at equal training time ({machine_name()}); budget {a.budget} of training per system"
             + (f", all trained at once on {threads} thread(s) each" if a.parallel else "") + ", "
             f"small presets{' with ' + ' '.join(extra) if extra else ''}, data {a.data}, beam {a.beam}; command: "
             f"`python benchmarks/bench_quality.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| system | params | updates | train tok/s | decode words/s | dev BLEU | dev chrF | test BLEU | test chrF |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['params']:,} | {r['steps']:,} | {r['train_tok_s']:,.0f} | "
                     f"{r['decode_words_s']:,.0f} | {r['dev_bleu']:.2f} | {r['dev_chrf']:.2f} | {r['test_bleu']:.2f} | "
                     f"{r['test_chrf']:.2f} |")
    text = "\n".join(lines)
    with open(os.path.join(a.out, "bench_quality.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in rows:
            if r["curve"]:
                xs, ys = zip(*r["curve"])
                ax.plot([x / 60 for x in xs], ys, "o-", ms=3, label=r["system"])
        ax.set_xlabel("training time (min)")
        ax.set_ylabel("dev BLEU (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"dev BLEU against training time ({a.budget} each)", fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "bench_quality.png"), dpi=110)
    except ImportError:
        pass
    return rows


if __name__ == "__main__":
    main()
