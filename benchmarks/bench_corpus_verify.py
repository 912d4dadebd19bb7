"""What `dtmt train` pays to check its corpus before the first update (issue 71 item 4): BinarizedSplit.verify over a
synthetic split of --pairs pairs (ids uniform below --vocab, 1-59 a side, uint16 as the binarizer stores them):
offsets, ids and each file's SHA-1 against the one recorded.

    python benchmarks/bench_corpus_verify.py [--pairs 5000000] [--rounds 3]

Reports the split's bytes and the fastest and slowest of --rounds verifications (the files just written: the page
cache is warm; a cold cache adds the disk's read time for the same bytes). The split is written to a temporary
folder and removed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None) -> dict:
    import numpy as np

    from bench_cells import machine_name
    from dtmt_models.data.binarized import SIDES, BinarizedSplit

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5_000_000)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench_corpus_verify_")
    try:
        rng = np.random.default_rng(0)
        size, shards = 0, {}
        for side in SIDES:
            offsets = np.concatenate(([0], np.cumsum(rng.integers(1, 60, a.pairs)))).astype(np.int64)
            ids = rng.integers(0, a.vocab, int(offsets[-1]), dtype=np.uint16)
            for ext, array in (("idx", offsets), ("bin", ids)):
                array.tofile(os.path.join(folder, f"train.{side}.{ext}"))
                shards[f"{side}.{ext}"] = hashlib.sha1(array).hexdigest()
            size += offsets.nbytes + ids.nbytes
            del ids
        split = BinarizedSplit(folder, "train", np.uint16, a.pairs, shards)
        seconds = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            split.verify((a.vocab, a.vocab))
            seconds.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    row = {"machine": machine_name(threads=False), "pairs": a.pairs, "bytes": size, "seconds_min": min(seconds),
           "seconds_max": max(seconds)}
    print(f"{machine_name(threads=False)}; `python benchmarks/bench_corpus_verify.py --pairs {a.pairs} --rounds "
          f"{a.rounds}`: {a.pairs:,} pairs, {size / 1e6:,.0f} MB of ids and offsets, verified in "
          f"{min(seconds):.2f}-{max(seconds):.2f} s (page cache warm)")
    return row


if __name__ == "__main__":
    main()
