"""The sanitizer run is of the csrc/ there is (issue 71 item 2).

`.ci/sanitize` builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer and runs the kernel tests
and the op fuzz against it; it takes longer than CI allows beside the suite, so it runs wherever csrc/ changes and,
when it passes, records the SHA-1 of csrc/ it tested in `.ci/sanitize.passed` (with the date, machine and test
summary). This test fails when csrc/ is not what the record says was tested: run `bash .ci/sanitize`.

    python tests/test_sanitize_record.py --write "SUMMARY"     (what .ci/sanitize does after its tests pass)
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, ".ci", "sanitize.passed")


def csrc_digest() -> str:
    """SHA-1 over the csrc/ files that the CPU build compiles (all but the CUDA sources, *.cu and *.cuh, which the
    sanitized build does not compile): each one's path (relative, '/'-separated) and bytes, in sorted order."""
    digest = hashlib.sha1()
    base = os.path.join(ROOT, "csrc")
    paths = sorted(os.path.relpath(os.path.join(folder, name), base).replace(os.sep, "/")
                   for folder, _, names in os.walk(base) for name in names if not name.endswith((".cu", ".cuh")))
    for rel in paths:
        with open(os.path.join(base, rel), "rb") as f:
            data = f.read()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def test_the_sanitizer_ran_on_this_csrc():
    with open(RECORD, encoding="utf-8") as f:
        record = json.load(f)
    assert record["csrc_sha1"] == csrc_digest(), (
        f"csrc/ changed since the last sanitizer run ({record['date']}, {record['machine']}): run `bash .ci/sanitize`,"
        f" which records a passing run in .ci/sanitize.passed")
    assert " passed" in record["tests"] and " failed" not in record["tests"], record


def write(summary: str) -> None:
    import torch

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    record = {"csrc_sha1": csrc_digest(), "date": datetime.date.today().isoformat(),
              "machine": f"{model}, {os.cpu_count()} cores, {platform.machine()}", "torch": torch.__version__,
              "tests": summary}
    with open(RECORD, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    print(f"sanitize: recorded {RECORD} ({summary})")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit(__doc__)
    write(sys.argv[2])
