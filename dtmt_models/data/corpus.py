"""Parallel corpora: reading and validating two aligned UTF-8 text files, one sentence a line (contract §5).

Bad input is reported, never dropped silently: a line-count mismatch, invalid UTF-8 or an empty line raises
`CorpusError` naming the file and the line numbers. Over-long pairs are filtered later, after subword
segmentation, with the count returned to the caller (see `filter_by_length`).
"""
from __future__ import annotations

import itertools
import os
import re
import stat
from typing import Iterator, List, Optional, Sequence, Tuple

from dtmt_models.atomic import atomic_write

MAX_LISTED = 10
MAX_LINE_BYTES = 16 << 20   # a longer line is refused (no sentence has one; encoding one took ~28 bytes a byte)
LINE_READ = MAX_LINE_BYTES + 5   # a line's bytes read at most: a longer cut is a line decode_file_line refuses
# (line 1's byte-order mark and a \r\n besides MAX_LINE_BYTES: a line of MAX_LINE_BYTES is read whole)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")   # a language or split name (plain_name)
BOM = b"\xef\xbb\xbf"   # the UTF-8 byte-order mark; not part of a file's first line


class CorpusError(ValueError):
    """A corpus file is malformed; the message lists the file, the line numbers and the reasons."""


class Problems:
    """The problems found in a corpus: all counted, the first MAX_LISTED kept, raised as one CorpusError
    ("WHAT: N problem(s)" and the list, "... and K more" for the rest). Picklable, so that workers can return
    theirs and the caller `merge` them in order."""

    def __init__(self):
        self.count = 0
        self.listed: List[str] = []

    def add(self, problem: str) -> None:
        self.count += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append(problem)

    def merge(self, other: "Problems") -> None:
        self.count += other.count
        self.listed.extend(other.listed[:max(MAX_LISTED - len(self.listed), 0)])

    def __bool__(self) -> bool:
        return self.count > 0

    def raise_if_any(self, what: str) -> None:
        if self.count:
            more = f"\n  ... and {self.count - len(self.listed)} more" if self.count > len(self.listed) else ""
            raise CorpusError(f"{what}: {self.count} problem(s)\n  " + "\n  ".join(self.listed) + more)


def _check_regular_file(path: str) -> None:
    """CorpusError unless `path` is a regular file (read whole: a device such as /dev/zero never ends)."""
    if not os.path.isfile(path):
        raise CorpusError(f"{path}: {'not a regular file' if os.path.exists(path) else 'no such file'}")


MAX_SMALL_FILE_BYTES = 256 << 20   # a manifest or a SentencePiece model (a few MB at most)


def read_small_file(path: str, fix: str) -> bytes:
    """The bytes of a small file of a prepared corpus (a manifest, a SentencePiece model). CorpusError naming it,
    with `fix` after, where it cannot be opened, is not a regular file (a FIFO there had hung `dtmt train` before
    its first line, a link to /dev/zero read until memory ran out) or holds more than MAX_SMALL_FILE_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # (a FIFO's open waits for a writer without it)
    except OSError as exc:
        raise CorpusError(f"{path}: {exc.strerror or exc}; {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorpusError(f"{path}: not a regular file (a folder, a pipe or a device); {fix}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_SMALL_FILE_BYTES + 1)
    if len(data) > MAX_SMALL_FILE_BYTES:
        raise CorpusError(f"{path}: more than {MAX_SMALL_FILE_BYTES:,} bytes, not a file dtmt prepare wrote; {fix}")
    return data


def scan_file(path: str, *digests) -> int:
    """The number of lines `read_lines` would return (a final newline makes no extra line), counted without
    decoding in blocks of 1 MiB; every block also goes into each of `digests` (hashlib objects)."""
    _check_regular_file(path)
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            for digest in digests:
                digest.update(block)
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def read_stream_lines(stream, name: str, allow_empty: bool = False) -> List[str]:
    """read_lines of a binary stream (standard input, a pipe) named `name` in messages: read a line at a time, each
    bounded (a device that never ends, /dev/zero, is refused at its first MAX_LINE_BYTES)."""
    lines, problems = [], Problems()
    for lineno in itertools.count(1):
        raw = stream.readline(LINE_READ)
        if not raw:
            break
        text, problem = decode_file_line(raw, name, lineno, allow_empty)
        lines.append(text)
        if problem:
            problems.add(problem)
            if len(raw) > MAX_LINE_BYTES:   # (not a text file: no more of it is read)
                break
    problems.raise_if_any(name)
    return lines


def bounded_lines(f) -> Iterator[bytes]:
    """The lines of a regular file open in binary mode, as iterating it gives them, each cut at LINE_READ bytes: the
    rest of a longer line is read in pieces and skipped, so memory stays bounded and the lines after it keep their
    numbers (a file of old Mac line ends, \\r alone, is one line; 2 GB of it had been read whole before the bound
    refused it)."""
    while True:
        raw = f.readline(LINE_READ)
        if not raw:
            return
        if len(raw) == LINE_READ and not raw.endswith(b"\n"):
            for rest in iter(lambda: f.readline(LINE_READ), b""):
                if rest.endswith(b"\n"):
                    break
        yield raw


def read_lines(path: str, allow_empty: bool = False) -> List[str]:
    """The lines of a UTF-8 text file (without line ends; a final newline does not make an extra line; a
    byte-order mark at the start of the file is not part of the first line)."""
    _check_regular_file(path)
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(BOM):   # as some editors on Windows write
        data = data[3:]
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    lines, problems = [], Problems()
    for i, line in enumerate(raw, start=1):
        text, problem = decode_line(line, path, i, allow_empty)
        if problem:
            problems.add(problem)
        lines.append(text)
    problems.raise_if_any(path)
    return lines


def decode_line(line: bytes, path: str, lineno: int, allow_empty: bool = False) -> Tuple[str, Optional[str]]:
    """One line of a corpus file (its bytes without the line feed; a final carriage return is dropped): the text,
    stripped, and what is wrong with it (invalid UTF-8, a NUL byte, more than MAX_LINE_BYTES, or empty unless
    allow_empty) naming file and line, or None.
    The one rule for lines, shared by `read_lines`, `iter_parallel` and the binarizer."""
    if line.endswith(b"\r"):
        line = line[:-1]
    if len(line) > MAX_LINE_BYTES:   # (dtmt translate's bound: a 50 MB line took 1.4 GB to encode, 1 GB one all memory)
        why = ("with carriage returns (\\r) in it: old Mac line ends? convert them first (tr '\\r' '\\n')"
               if b"\r" in line else "is it a text file?")
        return "", f"{path}:{lineno}: a line of more than {MAX_LINE_BYTES:,} bytes; {why}"
    try:
        text = line.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        near = line[max(0, exc.start - 10):exc.start + 10]
        return "", f"{path}:{lineno}: invalid UTF-8 at byte {exc.start} ({near!r})"
    if not allow_empty and not text:
        return text, f"{path}:{lineno}: empty line"
    if "\x00" in text:   # (valid UTF-8, but no text has it: a binary file, or UTF-16 read as bytes)
        at = line.index(0)
        return text, f"{path}:{lineno}: a NUL byte at byte {at}; is it a text file in UTF-8 (not UTF-16)?"
    return text, None


def decode_file_line(raw: bytes, path: str, lineno: int, allow_empty: bool = False) -> Tuple[str, Optional[str]]:
    """`decode_line` of a line as iterating a binary file gives it: with its line feed, and, on line 1, maybe the
    byte-order mark."""
    if lineno == 1 and raw.startswith(BOM):
        raw = raw[3:]
    return decode_line(raw[:-1] if raw.endswith(b"\n") else raw, path, lineno, allow_empty)


def count_mismatch(src_path: str, n_src: int, tgt_path: str, n_tgt: int) -> CorpusError:
    """The error for two sides of different lengths, naming the first line of the longer one without a partner."""
    longer = src_path if n_src > n_tgt else tgt_path
    return CorpusError(f"line counts differ: {src_path} has {n_src} lines, {tgt_path} has {n_tgt} ({longer} line "
                       f"{min(n_src, n_tgt) + 1} has no counterpart); the files must be aligned one sentence per line")


def iter_parallel(src_path: str, tgt_path: str) -> Iterator[Tuple[str, str]]:
    """The aligned (source, target) pairs of two files, read line by line (memory does not grow with the files).
    The counts are checked first; the bad lines are collected while reading and raised as one CorpusError after
    the last pair, so a caller writing the pairs out must discard what it wrote when it gets one."""
    paths = (src_path, tgt_path)
    states = [_file_state(p) for p in paths]
    counts = [scan_file(p) for p in paths]
    if counts[0] != counts[1]:
        raise count_mismatch(src_path, counts[0], tgt_path, counts[1])
    if counts[0] == 0:
        raise CorpusError(f"{src_path} and {tgt_path} hold no sentences: a corpus needs at least one pair")
    problems = Problems()
    read = 0
    with open(src_path, "rb") as fs, open(tgt_path, "rb") as ft:
        for i, (a, b) in enumerate(zip(bounded_lines(fs), bounded_lines(ft)), start=1):
            read = i
            texts = []
            for path, line in ((src_path, a), (tgt_path, b)):
                text, problem = decode_file_line(line, path, i)
                if problem:
                    problems.add(problem)
                texts.append(text)
            if not problems:
                yield texts[0], texts[1]
    # a file shortened, grown or replaced after it was counted: zip stopped at the shorter one, and the pairs from
    # the change on were cut or misaligned, with nothing said
    for path, state, count in zip(paths, states, counts):
        if _file_state(path) != state or read != count:
            raise CorpusError(f"{path} changed while it was read ({count:,} lines when counted, {read:,} pairs read); "
                              f"read it again once it is complete")
    problems.raise_if_any("parallel corpus")


def _file_state(path: str) -> Tuple[int, int, int]:
    """What changes when a file is shortened, grown or replaced: its device, inode and size. (Not its time, which a
    `touch` or a backup tool changes alone; a rewrite of the same size in place, while read, goes unseen.)"""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size


def read_parallel(src_path: str, tgt_path: str, allow_empty: bool = False) -> List[Tuple[str, str]]:
    """Aligned (source, target) pairs; raises CorpusError on any malformed line (an empty one too, unless
    `allow_empty`: a test set to score may hold some) or a count mismatch."""
    problems = Problems()
    sides = []
    for path in (src_path, tgt_path):
        try:
            sides.append(read_lines(path, allow_empty=allow_empty))
        except CorpusError as exc:
            problems.add(str(exc))
    problems.raise_if_any("parallel corpus")
    src, tgt = sides
    if not src and not tgt:
        raise CorpusError(f"{src_path} and {tgt_path} hold no sentences: a corpus needs at least one pair")
    if len(src) != len(tgt):
        raise count_mismatch(src_path, len(src), tgt_path, len(tgt))
    return list(zip(src, tgt))


def write_parallel(pairs: Sequence[Tuple[str, str]], src_path: str, tgt_path: str) -> None:
    """Writes aligned files atomically (a temporary file renamed into place)."""
    for path, side in ((src_path, 0), (tgt_path, 1)):
        with atomic_write(path) as f:
            for pair in pairs:
                if "\n" in pair[side]:
                    raise CorpusError(f"{path}: a sentence contains a line break: {pair[side][:60]!r}")
                f.write(pair[side] + "\n")


def filter_by_length(pairs: Sequence[Tuple[List[int], List[int]]], max_len: int):
    """Keeps the pairs whose two sides have at most max_len tokens; returns (kept, number dropped)."""
    kept = [p for p in pairs if len(p[0]) <= max_len and len(p[1]) <= max_len]
    return kept, len(pairs) - len(kept)


# ------------------------------------------------------------------------------------ prepared corpora
# A prepared corpus is a directory with {split}.{src_lang} / {split}.{tgt_lang} files (split: train, dev,
# test) and a manifest, corpus.json, naming the two languages, the line counts and where the text came from.
MANIFEST = "corpus.json"
# the folder dtmt prepare writes a corpus into before moving it into place (data.prepare.staged_corpus), by its pid
PREPARE_STAGE = re.compile(r"\.prepare\.tmp-\d+")


def write_manifest(directory: str, src_lang: str, tgt_lang: str, counts: dict, origin: str, **extra) -> str:
    import json

    path = os.path.join(directory, MANIFEST)
    with atomic_write(path) as f:
        json.dump({"src_lang": src_lang, "tgt_lang": tgt_lang, "counts": counts, "origin": origin, **extra},
                  f, indent=2, ensure_ascii=False)
        f.write("\n")
    return path


def read_manifest(directory: str) -> dict:
    """The manifest of a prepared corpus; a clear error when `directory` was not made by `dtmt prepare`."""
    import json

    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):   # (a folder that is not there is named as such: a typo, more often than not)
        missing = ("" if os.path.isdir(directory) else f" ({directory} is a file, not a folder)"
                   if os.path.lexists(directory) else f" (there is no folder {directory})")
        raise CorpusError(f"{directory}: no {MANIFEST}; make the corpus with `dtmt prepare bible --out {directory}` "
                          f"or `dtmt prepare files --src F --tgt G --out {directory}`{missing}")
    try:
        manifest = json.loads(read_small_file(path, "make the corpus again with `dtmt prepare`").decode("utf-8"))
    except RecursionError:   # (a crafted file of nested brackets)
        raise CorpusError(f"{path}: unreadable (nested too deeply); make the corpus again with `dtmt prepare`"
                          ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{path}: unreadable ({exc}); make the corpus again with `dtmt prepare`") from None
    counts = manifest.get("counts") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or not all(isinstance(manifest.get(k), str) for k in ("src_lang", "tgt_lang"))
            or not isinstance(counts, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in counts.items())):
        raise CorpusError(f"{path}: malformed (src_lang and tgt_lang strings and counts {{split: pairs}} expected); "
                          f"make the corpus again with `dtmt prepare`")
    # the languages and splits name the files {split}.{lang} of the folder, which prepare replaces or removes: a
    # crafted "../x" split had a file outside the folder removed (and train or evaluate read one)
    odd = [name for name in (manifest["src_lang"], manifest["tgt_lang"], *counts) if not plain_name(name)]
    if odd:
        raise CorpusError(f"{path}: {odd[0]!r} names no file of the folder (a language or split name must be letters, "
                          f"digits, '-' or '_'); make the corpus again with `dtmt prepare`")
    return manifest


def plain_name(name: str) -> bool:
    """Whether `name` may be a language or split name: a part of the folder's file names {split}.{lang}, which dtmt
    prepare writes and removes (its --src-lang / --tgt-lang take these only)."""
    return NAME_RE.fullmatch(name) is not None


def corpus_fingerprint(directory: str, train_sha1: Optional[str] = None) -> dict:
    """What identifies a prepared corpus: its languages, its split sizes and the SHA-1 of its training files, the
    two one after the other, each followed by a NUL, and of its dev files likewise where it has a dev split
    (`dtmt train --resume` compares it with the run's; the dev set's, because best.pt is chosen on it).
    `train_sha1`, when the caller knows it (binarized.known_train_sha1), saves reading the files.
    CorpusError if `directory` is not a prepared corpus."""
    import hashlib

    def sha1(split: str) -> str:
        digest = hashlib.sha1()
        for path in corpus_paths(directory, split):
            scan_file(path, digest)
            digest.update(b"\0")
        return digest.hexdigest()

    manifest = read_manifest(directory)
    found = {"languages": f"{manifest['src_lang']}-{manifest['tgt_lang']}", "counts": manifest["counts"],
             "train_sha1": train_sha1 if train_sha1 is not None else sha1("train")}
    if "dev" in manifest["counts"]:
        found["dev_sha1"] = sha1("dev")
    return found


def corpus_paths(directory: str, split: str) -> Tuple[str, str]:
    """(source file, target file) of a split of a prepared corpus."""
    m = read_manifest(directory)
    src, tgt = (os.path.join(directory, f"{split}.{m[k]}") for k in ("src_lang", "tgt_lang"))
    if split not in m.get("counts", {}):
        raise CorpusError(f"{directory}: no split {split!r}; splits: {sorted(m.get('counts', {}))}")
    for path in (src, tgt):   # (a missing target was read_parallel's "1 problem(s)", exit 1, after the source's)
        if not os.path.isfile(path):
            raise CorpusError(f"{path}: {'not a regular file' if os.path.exists(path) else 'no such file'} (the "
                              f"corpus lists a {split} split)")
    return src, tgt
