"""Which dev criterion picks the checkpoint that is best on test? (issue 21, item 5)

    dtmt train --data data/bible --model dtmt --max-time 30m --valid-every 250 --keep-last 1000 --out runs/ckpt
    python benchmarks/bench_ckpt_choice.py --run runs/ckpt --data data/bible

For every checkpoint the run kept (step_<updates>.pt, `dtmt train --keep-last`), this measures afresh (from the
file, not the run's log) the two numbers `dtmt train` measures at each validation, dev loss and greedy dev BLEU
(what picks `best.pt`: `--best-by loss`, the default, or `--best-by bleu`), and with `dtmt evaluate` (beam 4,
α 0.6) the BLEU of the whole dev set and of the test set.
It adds the averages of the last k checkpoints (`dtmt average`, for each k of --average). Then for each
criterion (lowest dev loss, highest greedy dev BLEU, highest beam dev BLEU, the last checkpoint, the average of
the last k): the checkpoint it picks and that checkpoint's test BLEU, beside the best test BLEU of any kept
checkpoint; and over the run's checkpoints the Spearman rank correlation of each per-checkpoint criterion with
test BLEU. Output: RUN/ckpt_choice.md and .json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (average ranks for ties); nan for fewer than 3 points."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else float("nan")


def evaluate(ckpt: str, data: str, split: str, beam: int, out_dir: str, log: str) -> float:
    if not os.path.isfile(os.path.join(out_dir, "scores.json")):
        with open(log, "a") as f:
            # `dtmt evaluate` in this process (a fresh interpreter per checkpoint would cost seconds each)
            from dtmt_models.cli import evaluate as evaluate_cli

            args = ["--checkpoint", ckpt, "--data", data, "--split", split, "--beam", str(beam), "--out-dir", out_dir,
                    "--quiet"]
            f.write("$ dtmt evaluate " + " ".join(args) + "\n")
            f.flush()
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                status = evaluate_cli.main(args)
            if status != 0:
                raise RuntimeError(f"dtmt evaluate {' '.join(args)} failed (exit {status}); see {log}")
    with open(os.path.join(out_dir, "scores.json")) as f:
        return json.load(f)["bleu"]


def dev_loss(ckpt: str, data: str) -> float:
    """Plain NLL per target subword on the dev split, as `dtmt train` computes it at a validation."""
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.training.trainer import corpus_nll

    model, sv, tv, ckpt_dict = load_model(ckpt)
    ids = [(sv.encode(s), tv.encode(t)) for s, t in read_parallel(*corpus_paths(data, "dev"))]
    return corpus_nll(model, [p for p in ids if p[0]], ckpt_dict["config"]["max_tokens"])[0]


def main(argv=None):
    from bench_cells import machine_name

    from dtmt_models.models.checkpoint import average_checkpoints, save_checkpoint
    from dtmt_models.training.trainer import step_checkpoints

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="a run directory with step_<updates>.pt files")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--average", default="2,3,5", help="k values: average the last k checkpoints")
    a = p.parse_args(argv)
    kept = step_checkpoints(a.run)
    if len(kept) < 2:
        p.error(f"{a.run} holds {len(kept)} step_<updates>.pt checkpoints; train with --keep-last")
    work = os.path.join(a.run, "ckpt_choice")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "evaluate.log")
    rows = []
    for step, path in kept:
        r = {"name": os.path.basename(path), "step": step, "dev_loss": dev_loss(path, a.data),
             "dev_bleu_greedy": evaluate(path, a.data, "dev", 1, os.path.join(work, f"{step}.dev.greedy"), log)}
        for split in ("dev", "test"):
            r[f"{split}_bleu_beam"] = evaluate(path, a.data, split, a.beam, os.path.join(work, f"{step}.{split}"), log)
        rows.append(r)
        print(f"{r['name']}: dev loss {r['dev_loss']:.3f}, greedy dev {r['dev_bleu_greedy']:.2f}, beam dev "
              f"{r['dev_bleu_beam']:.2f}, test {r['test_bleu_beam']:.2f}", flush=True)
    averages = []
    for k in (int(x) for x in a.average.split(",") if x):
        if k > len(kept):
            continue
        path = os.path.join(work, f"avg_last{k}.pt")
        save_checkpoint(path, average_checkpoints([p_ for _, p_ in kept[-k:]]))
        r = {"name": f"average of the last {k}", "k": k}
        for split in ("dev", "test"):
            r[f"{split}_bleu_beam"] = evaluate(path, a.data, split, a.beam, os.path.join(work, f"avg{k}.{split}"), log)
        averages.append(r)
        print(f"{r['name']}: beam dev {r['dev_bleu_beam']:.2f}, test {r['test_bleu_beam']:.2f}", flush=True)
    test = [r["test_bleu_beam"] for r in rows]
    picks = [("lowest dev loss (`--best-by loss`)", min(rows, key=lambda r: r["dev_loss"]),
              spearman([-r["dev_loss"] for r in rows], test)),
             ("highest greedy dev BLEU (`--best-by bleu`)", max(rows, key=lambda r: r["dev_bleu_greedy"]),
              spearman([r["dev_bleu_greedy"] for r in rows], test)),
             ("highest beam dev BLEU", max(rows, key=lambda r: r["dev_bleu_beam"]),
              spearman([r["dev_bleu_beam"] for r in rows], test)),
             ("the last checkpoint", rows[-1], spearman([r["step"] for r in rows], test))]
    best = max(rows, key=lambda r: r["test_bleu_beam"])
    lines = [f"Checkpoint choice on {a.run} ({len(rows)} checkpoints; {machine_name()}); test and dev BLEU with beam "
             f"{a.beam}, α 0.6. Command: `python benchmarks/bench_ckpt_choice.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| criterion | picks | its test BLEU | Spearman ρ with test BLEU over the checkpoints |",
             "|---|---|---:|---:|"]
    for name, r, rho in picks:
        lines.append(f"| {name} | {r['name']} | {r['test_bleu_beam']:.2f} | {rho:.2f} |")
    for r in averages:
        lines.append(f"| {r['name']} | — | {r['test_bleu_beam']:.2f} | |")
    lines.append(f"| (oracle: best test BLEU of one checkpoint) | {best['name']} | {best['test_bleu_beam']:.2f} | |")
    lines += ["", "| checkpoint | dev loss | greedy dev BLEU | beam dev BLEU | test BLEU |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['dev_loss']:.3f} | {r['dev_bleu_greedy']:.2f} | {r['dev_bleu_beam']:.2f} | "
                     f"{r['test_bleu_beam']:.2f} |")
    for r in averages:
        lines.append(f"| {r['name']} | | | {r['dev_bleu_beam']:.2f} | {r['test_bleu_beam']:.2f} |")
    text = "\n".join(lines)
    with open(os.path.join(a.run, "ckpt_choice.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.run, "ckpt_choice.json"), "w") as f:
        json.dump({"checkpoints": rows, "averages": averages}, f, indent=1)
    print("\n" + text)
    return rows, averages


if __name__ == "__main__":
    main()
