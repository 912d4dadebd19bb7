"""Load test of `dtmt serve` (issue 25, item 5): many concurrent clients, one sentence a request.

    python benchmarks/bench_serve.py --checkpoint benchmarks/out/peers_30m_b/dtmt/best.pt --data data/bible

Starts `dtmt serve -c CKPT --port 0` as a subprocess, then `--clients` concurrent clients (aiohttp, one
connection each) that each send their share of the test set's sources, one sentence per request, one request
after another, until every sentence has been sent or `--max-seconds` has passed. Each request is timed from
send to answer. Reported: requests answered, requests lost (a status other than 200, a connection error, a
timeout, or a translation that differs from `dtmt translate`'s for that sentence: the server must not change
results), throughput in sentences/s, p50 / p90 / p99 / max latency, and the decoding batches the server formed.
For scale, the same sentences are first translated offline (`translate`, the library call of `dtmt translate`,
in this process, same beam and threads) and that rate is given beside the server's. Output: OUT/bench_serve.md
and .json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks; nan if empty."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def start_server(checkpoint: str, flags) -> tuple:
    """(process, url, stderr line queue): `dtmt serve --port 0` once it says it listens."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "dtmt_models.cli", "serve", "-c", checkpoint, "--port", "0",
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: "queue.Queue[str]" = queue.Queue()

    def read():
        for line in proc.stderr:
            lines.put(line)
    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 300
    while True:
        try:
            line = lines.get(timeout=max(0.1, min(1.0, deadline - time.time())))
        except queue.Empty:
            if proc.poll() is not None:   # (it refused an option and exited: waited for the 300 s before)
                raise RuntimeError(f"dtmt serve exited ({proc.returncode}) before it listened") from None
            if time.time() < deadline:
                continue
            proc.kill()
            raise RuntimeError("dtmt serve did not start within 300 s") from None
        sys.stderr.write(line)
        if "listening on http://" in line:
            return proc, line.split("listening on ")[1].split()[0], lines


async def load(url: str, sentences, expected, clients: int, max_seconds: float, timeout: float):
    import aiohttp

    todo: "asyncio.Queue[int]" = asyncio.Queue()
    for i in range(len(sentences)):
        todo.put_nowait(i)
    latencies, lost, answered = [], [], 0
    t0 = time.perf_counter()

    async def client(session):
        nonlocal answered
        while time.perf_counter() - t0 < max_seconds:
            try:
                i = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            sent = time.perf_counter()
            try:
                async with session.post(url + "/translate", json={"sentences": [sentences[i]]}) as r:
                    reply = await r.json()
                    status = r.status
            except Exception as exc:   # noqa: BLE001 - every failure is a lost request, counted and shown
                lost.append(f"{i}: {type(exc).__name__}: {exc}")
                continue
            latencies.append(time.perf_counter() - sent)
            if status != 200:
                lost.append(f"{i}: HTTP {status}: {reply}")
            elif reply["translations"] != [expected[i]]:
                lost.append(f"{i}: a different translation than dtmt translate's")
            else:
                answered += 1

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return answered, lost, latencies, time.perf_counter() - t0


DEFAULT_CHECKPOINT = os.path.join(HERE, "out", "peers_30m_b", "dtmt", "best.pt")


def main(argv=None):
    from common import machine_name, torch_threads, write_report

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--split", default="test")
    p.add_argument("--sentences", type=int, default=0, help="the first N sources of the split (0: all)")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--batch-sentences", type=int, default=64)
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop sending after this long")
    p.add_argument("--timeout", type=float, default=300.0, help="a request without an answer after this is lost")
    p.add_argument("--out", default=os.path.join(HERE, "out", "serve"))
    a = p.parse_args(argv)
    from common import PEERS_30M_MADE_BY, check_checkpoint, check_options
    from dtmt_models.decoding.hypotheses import MAX_BEAM
    from dtmt_models.decoding.serve import MAX_WAIT_MS

    check_options(p, a, (("sentences", 0), ("clients", 1), ("beam", 1, MAX_BEAM), ("threads", 1),
                         ("max_wait_ms", 0, MAX_WAIT_MS),
                         ("batch_sentences", 1), ("max_seconds", 0), ("timeout", 0)))
    # (a missing checkpoint, the default one of a local run above all, or corpus was a traceback)
    check_checkpoint(p, a.checkpoint, DEFAULT_CHECKPOINT, PEERS_30M_MADE_BY)
    try:
        src_path, tgt_path = corpus_paths(a.data, a.split)
    except ValueError as exc:   # (CorpusError)
        p.error(f"--data {a.data} --split {a.split}: {exc}")
    sentences = [s for s, _ in read_parallel(src_path, tgt_path)]
    if a.sentences:
        sentences = sentences[:a.sentences]
    with torch_threads(a.threads):
        model, sv, tv, ckpt = load_model(a.checkpoint)
        t = time.perf_counter()
        expected = [h[0][0] for h in translate(model, sv, tv, sentences, beam=a.beam)]
        offline_s = time.perf_counter() - t
    print(f"offline: {len(sentences)} sentences in {offline_s:.1f}s ({len(sentences) / offline_s:.1f}/s)", flush=True)
    del model

    flags = ["--beam", str(a.beam), "--threads", str(a.threads), "--max-wait-ms", str(a.max_wait_ms),
             "--batch-sentences", str(a.batch_sentences)]
    proc, url, _ = start_server(a.checkpoint, flags)
    try:
        answered, lost, latencies, seconds = asyncio.run(load(url, sentences, expected, a.clients, a.max_seconds,
                                                              a.timeout))
        import urllib.request
        with urllib.request.urlopen(url + "/info", timeout=60) as r:
            counters = json.loads(r.read())["counters"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    sent = answered + len(lost)
    row = {"machine": machine_name(), "checkpoint": a.checkpoint, "model": ckpt.get("model_name"),
           "sentences": len(sentences), "sent": sent, "answered": answered, "lost": len(lost),
           "lost_examples": lost[:5], "clients": a.clients, "beam": a.beam, "threads": a.threads,
           "max_wait_ms": a.max_wait_ms, "batch_sentences": a.batch_sentences, "seconds": round(seconds, 3),
           "sentences_per_s": answered / seconds, "offline_sentences_per_s": len(sentences) / offline_s,
           "p50_ms": 1000 * percentile(latencies, 50), "p90_ms": 1000 * percentile(latencies, 90),
           "p99_ms": 1000 * percentile(latencies, 99), "max_ms": 1000 * max(latencies, default=float("nan")),
           "batches": counters["batches"], "server_exit": proc.returncode}
    row["mean_batch"] = counters["sentences"] / max(counters["batches"], 1)
    os.makedirs(a.out, exist_ok=True)
    cmd = "python benchmarks/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = (f"`dtmt serve` under load: {row['machine']}; {row['model']} ({os.path.relpath(a.checkpoint, ROOT)}), beam "
          f"{a.beam}, {a.threads} threads, batches of up to {a.batch_sentences} sentences, at most {a.max_wait_ms:g} ms "
          f"wait. {a.clients} concurrent clients, one sentence a request, the {a.split} split's sources. "
          f"Command: `{cmd.strip()}`\n\n"
          "| clients | requests sent | answered | lost | sentences/s | offline translate, sentences/s | p50 ms | "
          "p90 ms | p99 ms | max ms | decoding batches (mean size) |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
          f"| {a.clients} | {sent} | {answered} | {len(lost)} | {row['sentences_per_s']:.1f} | "
          f"{row['offline_sentences_per_s']:.1f} | {row['p50_ms']:.0f} | {row['p90_ms']:.0f} | {row['p99_ms']:.0f} | "
          f"{row['max_ms']:.0f} | {row['batches']} ({row['mean_batch']:.1f}) |\n")
    write_report(a.out, "bench_serve", md, row)
    print(md)
    return row


if __name__ == "__main__":
    main()
