"""Parallel corpora: reading and validating two aligned UTF-8 text files, one sentence a line (SPEC §5).

Bad input is reported, never dropped silently: a line-count mismatch, invalid UTF-8 or an empty line raises
`CorpusError` naming the file and the line numbers. Over-long pairs are filtered later, after subword
segmentation, with the count returned to the caller (see `filter_by_length`).
"""
from __future__ import annotations

import os
from typing import List, Sequence, Tuple

MAX_LISTED = 10


class CorpusError(ValueError):
    """A corpus file is malformed; the message lists the file, the line numbers and the reasons."""


def _report(problems: List[str], what: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise CorpusError(f"{what}: {len(problems)} problem(s)\n  {shown}{more}")


def read_lines(path: str, allow_empty: bool = False) -> List[str]:
    """The lines of a UTF-8 text file (without line ends; a final newline does not make an extra line)."""
    if not os.path.isfile(path):
        raise CorpusError(f"{path}: no such file")
    with open(path, "rb") as f:
        data = f.read()
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    lines, problems = [], []
    for i, line in enumerate(raw, start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{path}:{i}: invalid UTF-8 at byte {exc.start} ({line[max(0, exc.start - 10):exc.start + 10]!r})")
            continue
        if not allow_empty and not text.strip():
            problems.append(f"{path}:{i}: empty line")
        lines.append(text.strip())
    _report(problems, path)
    return lines


def read_parallel(src_path: str, tgt_path: str) -> List[Tuple[str, str]]:
    """Aligned (source, target) pairs; raises CorpusError on any malformed line or a count mismatch."""
    problems = []
    sides = []
    for path in (src_path, tgt_path):
        try:
            sides.append(read_lines(path))
        except CorpusError as exc:
            problems.append(str(exc))
    _report(problems, "parallel corpus")
    src, tgt = sides
    if len(src) != len(tgt):
        raise CorpusError(f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}; "
                          f"the files must be aligned one sentence per line")
    return list(zip(src, tgt))


def write_parallel(pairs: Sequence[Tuple[str, str]], src_path: str, tgt_path: str) -> None:
    """Writes aligned files atomically (a temporary file renamed into place)."""
    for path, side in ((src_path, 0), (tgt_path, 1)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for pair in pairs:
                if "\n" in pair[side]:
                    raise CorpusError(f"{path}: a sentence contains a line break: {pair[side][:60]!r}")
                f.write(pair[side] + "\n")
        os.replace(tmp, path)


def filter_by_length(pairs: Sequence[Tuple[List[int], List[int]]], max_len: int):
    """Keeps the pairs whose two sides have at most max_len tokens; returns (kept, number dropped)."""
    kept = [p for p in pairs if len(p[0]) <= max_len and len(p[1]) <= max_len]
    return kept, len(pairs) - len(kept)
