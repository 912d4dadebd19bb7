"""`dtmt bench NAME [options]`: runs benchmarks/bench_NAME.py (cells, train, decode, quality) with its options.

The benchmark scripts live in the repository's benchmarks/ directory (they are scripts, not part of the
installed package), so this works from a source checkout or an editable install.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # dtmt_models/cli/ -> the checkout
BENCH_DIR = os.path.join(ROOT, "benchmarks")


def available() -> List[str]:
    if not os.path.isdir(BENCH_DIR):
        return []
    return sorted(f[len("bench_"):-3] for f in os.listdir(BENCH_DIR) if f.startswith("bench_") and f.endswith(".py"))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dtmt bench NAME [options]   (dtmt bench NAME --help for its options)\n"
              f"benchmarks: {', '.join(names) if names else f'none found (expected them in {BENCH_DIR})'}")
        return 0
    name = argv[0]
    if name not in names:
        print(f"dtmt bench: no benchmark {name!r}; choose one of {names} "
              f"(run from a source checkout: the scripts are in benchmarks/)", file=sys.stderr)
        return 2
    old = sys.argv
    sys.argv = [f"dtmt bench {name}", *argv[1:]]
    try:
        runpy.run_path(os.path.join(BENCH_DIR, f"bench_{name}.py"), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = old
    return 0
