"""Data at scale (issue 24): prepare's speed and memory, and training's memory, against the corpus size.

    python benchmarks/bench_data.py                                  # 0.1 M, 1 M and 5 M pairs (~30 min on 2 cores)
    python benchmarks/bench_data.py --sizes 20k,50k --processes 1    # quick

For each size N it generates a synthetic corpus from the Bible (pair k glues two training verses drawn with a
seeded generator, Spanish to Spanish and English to English, ~60 words a side, like the corpus of the issue), then
times, as a user runs them:
  * `dtmt prepare files --src ... --tgt ... --dev-src ... --dev-tgt ...` (validation, copy, SentencePiece on the
    default sample, binarizing on every core): wall time, pairs/s, and the peak resident memory of its processes
    (the main one, and all of them together);
  * `dtmt train --model dtmt` (small preset, --threads 1 a process) for --steps updates, on 1 and on 2 processes
    (`torch.distributed.run`): the peak resident memory of each training process up to its last update, and the
    time from the launch to the end of the first update.
Memory is sampled from /proc every 50 ms (VmRSS of every process of the run's tree; the mapped token files count
there as the pages read so far). The dev split is 20 Bible dev verses, so the closing validation is quick.
Output: OUT/bench_data.json, OUT/bench_data.md (the table, under the run's header: machine, commit, date, torch,
command) and OUT/bench_data.png (memory against corpus size).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

STEP_LINE = re.compile(r"\bstep (\d[\d,]*) loss")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 100k, 1M, 0.1M)")
    return int(float(m.group(1)) * {"": 1, "k": 10 ** 3, "m": 10 ** 6}[m.group(2).lower()])


def generate(bible: str, n: int, out: str, seed: int = 1) -> tuple:
    """out/raw.{es,en}: n pairs, each two random training verses glued; out/dev.{es,en}: 20 dev verses."""
    from dtmt_models.data.corpus import corpus_paths, read_parallel

    os.makedirs(out, exist_ok=True)
    paths = (os.path.join(out, "raw.es"), os.path.join(out, "raw.en"))
    if all(os.path.isfile(p) for p in paths) and open(os.path.join(out, "raw.n")).read().strip() == str(n):
        return paths + dev_files(bible, out)
    pairs = read_parallel(*corpus_paths(bible, "train"))
    rng = random.Random(seed)
    m = len(pairs)
    with open(paths[0], "w", encoding="utf-8") as fs, open(paths[1], "w", encoding="utf-8") as ft:
        for _ in range(n):
            i, j = rng.randrange(m), rng.randrange(m)
            fs.write(f"{pairs[i][0]} {pairs[j][0]}\n")
            ft.write(f"{pairs[i][1]} {pairs[j][1]}\n")
    with open(os.path.join(out, "raw.n"), "w") as f:
        f.write(f"{n}\n")
    return paths + dev_files(bible, out)


def dev_files(bible: str, out: str) -> tuple:
    from dtmt_models.data.corpus import corpus_paths, read_parallel

    dev = read_parallel(*corpus_paths(bible, "dev"))[:20]
    paths = (os.path.join(out, "dev.es"), os.path.join(out, "dev.en"))
    for side, path in enumerate(paths):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(p[side] + "\n" for p in dev)
    return paths


# ------------------------------------------------------------------------------------- process-tree memory
def _children() -> dict:
    kids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_measured(cmd, env=None, log=None, interval: float = 0.05) -> dict:
    """Runs cmd; samples the RSS of its whole process tree every `interval` seconds. Returns wall time, the peak
    of every process (by pid, with its command line), the peak of the tree's sum, the time the first update ended
    and the peaks up to the last update line seen (training)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peaks, names = {}, {}
    state = {"tree_peak": 0, "first_update_s": None, "steps": 0, "peaks_at_last_step": {}}
    lines = []

    def reader():
        for line in proc.stdout:
            lines.append(line)
            if log:
                log.write(line)
            m = STEP_LINE.search(line)
            if m:
                step = int(m.group(1).replace(",", ""))
                if state["first_update_s"] is None:
                    state["first_update_s"] = time.perf_counter() - t0
                state["steps"] = max(state["steps"], step)
                state["peaks_at_last_step"] = dict(peaks)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    while proc.poll() is None:
        kids = _children()
        tree, todo = [], [proc.pid]
        while todo:
            p = todo.pop()
            tree.append(p)
            todo.extend(kids.get(p, []))
        total = 0
        for p in tree:
            r = _rss_kib(p)
            total += r
            if r > peaks.get(p, 0):
                peaks[p] = r
                names.setdefault(p, _cmdline(p))
        state["tree_peak"] = max(state["tree_peak"], total)
        time.sleep(interval)
    th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write("".join(lines[-30:]))
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return {"pid": proc.pid, "wall_s": wall, "peaks_kib": peaks, "names": names, "tree_peak_kib": state["tree_peak"],
            "first_update_s": state["first_update_s"], "peaks_at_last_step_kib": state["peaks_at_last_step"],
            "output": "".join(lines)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"), help="the prepared Bible corpus")
    p.add_argument("--sizes", default="0.1M,1M,5M", help="corpus sizes in pairs (default: 0.1M,1M,5M)")
    p.add_argument("--processes", default="1,2", help="training process counts (default: 1,2; 0: prepare only)")
    p.add_argument("--steps", type=int, default=10, help="training updates (default: 10)")
    p.add_argument("--model", default="dtmt")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "data"))
    p.add_argument("--prepare-args", default="", help="more options for dtmt prepare files, e.g. '--sample 300000'")
    p.add_argument("--keep", action="store_true", help="keep the generated corpora (they take ~0.5 GB per M pairs)")
    a = p.parse_args(argv)
    from common import check_options

    check_options(p, a, (("steps", 1),))
    from dtmt_models import list_models

    if a.model not in list_models():   # (refused by `dtmt train` after the corpora were generated and prepared)
        p.error(f"--model {a.model}: not a system (one of {', '.join(list_models())})")
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(f"--sizes: {exc}")
    if any(n < 1 for n in sizes):
        p.error(f"--sizes {a.sizes}: every size must be at least 1 pair")
    try:
        procs = [int(x) for x in a.processes.split(",")]
    except ValueError:
        p.error(f"--processes takes whole numbers separated by commas, got {a.processes!r}")
    if any(k < 0 for k in procs):
        p.error(f"--processes {a.processes}: a count must be >= 0 (0: prepare only)")
    procs = [k for k in procs if k > 0]
    from dtmt_models.data.corpus import CorpusError, corpus_paths

    try:   # (a --data without the corpus was a CorpusError's traceback after OUT/synth-N/ and the log were made)
        for split in ("train", "dev"):
            corpus_paths(a.data, split)
    except CorpusError as exc:
        p.error(f"--data {a.data}: {exc}")
    from common import machine_name, make_out_dir, provenance, provenance_line, write_json

    make_out_dir(p, a.out)
    a.run = provenance(__file__, argv)
    print(provenance_line(a.run), flush=True)
    machine = machine_name()
    results = []
    log = open(os.path.join(a.out, "bench_data.log"), "w")
    for n in sizes:
        work = os.path.join(a.out, f"synth-{n}")
        t0 = time.perf_counter()
        raw_src, raw_tgt, dev_src, dev_tgt = generate(a.data, n, work)
        gen_s = time.perf_counter() - t0
        corpus = os.path.join(work, "corpus")
        print(f"{n:,} pairs: generated in {gen_s:.0f}s; dtmt prepare files ...", flush=True)
        prep = run_measured([sys.executable, "-m", "dtmt_models.cli", "prepare", "files", "--src", raw_src,
                             "--tgt", raw_tgt, "--dev-src", dev_src, "--dev-tgt", dev_tgt, "--out", corpus,
                             *a.prepare_args.split()], log=log)
        main_pid = prep["pid"]
        row = {"pairs": n, "prepare_s": prep["wall_s"], "prepare_pairs_per_s": n / prep["wall_s"],
               "prepare_rss_main_mib": prep["peaks_kib"][main_pid] / 1024,
               "prepare_rss_tree_mib": prep["tree_peak_kib"] / 1024,
               "prepare_log": [line for line in prep["output"].splitlines() if "pairs/s" in line or "trained" in line],
               "train": {}}
        print(f"  prepare {prep['wall_s']:.0f}s ({row['prepare_pairs_per_s']:,.0f} pairs/s), peak RSS main "
              f"{row['prepare_rss_main_mib']:,.0f} MiB, sum over its processes {row['prepare_rss_tree_mib']:,.0f} MiB",
              flush=True)
        for k in procs:
            out = os.path.join(work, f"run{k}")
            train = ["--data", corpus, "--model", a.model, "--max-steps", str(a.steps), "--valid-every", "1000000",
                     "--log-every", "1", "--progress", "lines", "--threads", "1", "--out", out, "--overwrite"]
            if k == 1:
                cmd = [sys.executable, "-m", "dtmt_models.cli", "train"] + train
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(k),
                       "--master_port", "29561", "-m", "dtmt_models.cli.train"] + train
            r = run_measured(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), log=log)
            ranks = {pid: kib for pid, kib in r["peaks_at_last_step_kib"].items()
                     if "dtmt_models.cli" in r["names"].get(pid, "") and "torch.distributed.run" not in r["names"][pid]}
            row["train"][k] = {"rss_per_process_mib": sorted(v / 1024 for v in ranks.values()),
                               "first_update_s": r["first_update_s"], "wall_s": r["wall_s"], "steps": a.steps}
            print(f"  train, {k} process(es): peak RSS up to update {a.steps} "
                  f"{', '.join(f'{v:,.0f}' for v in row['train'][k]['rss_per_process_mib'])} MiB; first update "
                  f"after {r['first_update_s']:.1f}s", flush=True)
        results.append(row)
        if not a.keep:
            for name in ("raw.es", "raw.en", "raw.n"):
                os.remove(os.path.join(work, name))
        write_json(os.path.join(a.out, "bench_data.json"), {"machine": machine, "run": a.run, "model": a.model,
                                                             "steps": a.steps, "rows": results})
    report(results, machine, a, procs)
    return 0


def report(results, machine, a, procs) -> None:
    from common import provenance_line

    lines = [provenance_line(a.run), "",
             f"Machine: {machine}; `dtmt train --model {a.model}` (small preset), {a.steps} updates, one thread a "
             f"process; prepare with the default settings (SentencePiece on a sample of up to 1 M lines a side, "
             f"one encoding process per core).", "",
             "| pairs | prepare s | pairs/s | prepare peak RSS MiB (main / all) | "
             + " | ".join(f"train RSS MiB, {k} proc | first update s, {k} proc" for k in procs) + " |",
             "|---:|---:|---:|---:|" + "---:|---:|" * len(procs)]
    for r in results:
        cells = [f"{r['pairs']:,}", f"{r['prepare_s']:.0f}", f"{r['prepare_pairs_per_s']:,.0f}",
                 f"{r['prepare_rss_main_mib']:,.0f} / {r['prepare_rss_tree_mib']:,.0f}"]
        for k in procs:
            t = r["train"][k] if k in r["train"] else r["train"].get(str(k))
            cells += [" / ".join(f"{v:,.0f}" for v in t["rss_per_process_mib"]), f"{t['first_update_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "bench_data.md"), "w") as f:
        f.write(text)
    print(text)
    from dtmt_models.plotting import figure, save

    fig = figure(6, 3.6, what="the memory plot")
    if fig is None:
        return
    ax = fig.add_subplot(1, 1, 1)
    xs = [r["pairs"] for r in results]
    for k in procs:
        ys = [max(r["train"][k]["rss_per_process_mib"]) for r in results]
        ax.plot(xs, ys, "o-", label=f"dtmt train, {k} process(es): largest process")
    ax.plot(xs, [r["prepare_rss_tree_mib"] for r in results], "s--", label="dtmt prepare files: sum over its processes")
    ax.set_xscale("log")
    ax.set_xlabel("training pairs")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("memory against corpus size", fontsize=10)
    save(fig, os.path.join(a.out, "bench_data.png"), tight=True)


if __name__ == "__main__":
    sys.exit(main())
