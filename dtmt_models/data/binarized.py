"""The binarized corpus that `dtmt train` reads (contract §5): SentencePiece models trained on a seeded sample of the
training text, and every split's token ids in shards with an index of offsets (raw little-endian arrays that
`np.memmap` maps; training reads the pairs it needs with positioned reads, see BinarizedSplit), so that training
memory does not grow with the corpus.

A prepared corpus directory DIR (dtmt_models.data.corpus) gets one binarized copy per vocabulary setting:

    DIR/bin-<type><size>/          e.g. DIR/bin-bpe4000 (`--vocab-type bpe --vocab-size 4000`)
        binarized.json             the manifest, written last: format, vocabulary settings and sizes, the sample
                                   (size, seed, of how many pairs), the token dtype, and per split the number of
                                   pairs and tokens, the pairs empty after segmentation, the longest pair, each
                                   text file's size, modification time and SHA-1, and the SHA-1 of each of its
                                   four shard files ("shards"); the SHA-1 of the two models ("models")
        src.model, tgt.model       the SentencePiece models (the bytes that go into checkpoints)
        {split}.src.bin            the source token ids of the split, one pair after the other, no separators:
        {split}.tgt.bin            uint16 where the vocabulary has at most 65,536 pieces, else uint32
        {split}.src.idx            int64 offsets into the .bin file, one more than the split has pairs:
        {split}.tgt.idx            pair i is bin[idx[i]:idx[i + 1]]

The shards' checksums are verified whenever a run opens the corpus for training (BinarizedSplit.verify, which
reads every byte anyway to check offsets and ids): a shard whose bytes changed after it was written, within the
vocabulary or not, is refused before the first update. The models' are compared whenever the copy is opened: a
src.model and tgt.model swapped or replaced by others of as many pieces passed every id check, and the run trained
on ids that meant other pieces, without a word. The rule is "every byte, every run" rather than "when size
or time change" because the time says nothing of a bit flipped on the disk; at 5 M pairs (680 MB of shards) the
whole check costs about half a second (docs/design/data.md, "Shard checksums").

`binarize` builds it in a hidden temporary directory that becomes DIR/bin-... by one rename once everything is
written, so an interrupted run leaves nothing a reader would accept (the next run removes the leftover).
Bad text (invalid UTF-8, an empty line, a line-count mismatch) is reported with file and line, as
dtmt_models.data.corpus does for text, before anything is renamed into place.

BPE models are trained on the sample's word counts (`Vocabulary.train_bpe_on_word_counts`: the same model as
from the sample's sentences, without SentencePiece normalising every sentence); unigram on the sentences.

The ids are those of `Vocabulary.encode` on the stripped line (the text pipeline): tests/test_binarized.py holds
them equal. Encoding runs on `workers` processes; each caches the ids of the words it has seen, which is exact
because the models never merge across a space (checked while encoding: a mismatch turns the cache off).
"""
from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process   # (BrokenProcessPool: the submodule is loaded only by a pool otherwise)
import errno
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import re
import shutil
import time
import unicodedata
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dtmt_models.atomic import process_alive
from dtmt_models.data.corpus import (CorpusError, Problems, bounded_lines, corpus_fingerprint, count_mismatch,
                                     decode_file_line, plain_name, read_manifest, read_small_file, scan_file)
from dtmt_models.data.vocabulary import BOS, EOS, PAD, Vocabulary
from dtmt_models.progress import Ticker

FORMAT = 3   # 2: the shards' SHA-1 in the manifest; 3: the models' too (an older copy: the next `dtmt train` rebuilds)
MANIFEST = "binarized.json"
DEFAULT_SAMPLE = 1_000_000   # sentences per side that SentencePiece is trained on
DEFAULT_SEED = 1
CHUNK_LINES = 4096           # pairs per encoding task
STOP_WAIT_S = 5.0            # an interrupted encoding waits this long for the chunks at work, then kills their workers
SIDES = ("src", "tgt")


def binarized_name(vocab_type: str, vocab_size: int) -> str:
    return f"bin-{vocab_type}{vocab_size}"


def binarized_path(corpus_dir: str, vocab_type: str, vocab_size: int, protos: Optional[Sequence[bytes]] = None) -> str:
    """Where the copy lives: DIR/bin-<type><size>, or, for given SentencePiece models (a run resumed on text whose
    own copy has other models), DIR/bin-models-<SHA-1 of the two models>."""
    if protos is not None:
        return os.path.join(corpus_dir, "bin-models-" + hashlib.sha1(b"\0".join(protos)).hexdigest()[:12])
    return os.path.join(corpus_dir, binarized_name(vocab_type, vocab_size))


# the folders binarized_path names: DIR/bin-<type><size>, DIR/bin-models-<12 hex digits>
_COPY_NAME = re.compile(r"bin-(?:[a-z]+\d+|models-[0-9a-f]{12})")


def copy_holding(corpus_dir: str, path: str) -> Optional[str]:
    """The name of `corpus_dir`'s binarized copy (binarized_path's folder, made or to be made) that `path` is or
    lies in, or None. A rebuild replaces that folder whole: no run's folder may be in it."""
    first = os.path.relpath(os.path.realpath(path), os.path.realpath(corpus_dir)).split(os.sep)[0]
    return first if _COPY_NAME.fullmatch(first) else None


_OURS = re.compile(r"(binarized\.json|(src|tgt)\.model|[^.]+\.(src|tgt)\.(bin|idx))")


def check_only_ours(path: str) -> None:
    """CorpusError when the binarized copy `path` is not a folder (a file, a link to nothing), or holds what binarize
    does not write (a run's folder given as dtmt train --out inside it, a user's notes): rebuilding the copy
    replaces the folder whole, so those would go with it (a run inside bin-bpe120 was lost, exit 0). Nothing is
    changed; the message names them."""
    if os.path.lexists(path) and not os.path.isdir(path):   # (prepare removed the earlier corpus's manifest, then
        # failed to put its folder there, "Not a directory" naming its stage; every later run refused the folder)
        raise CorpusError(f"{path} is {'a link to nothing' if os.path.islink(path) else 'a file'}, where dtmt "
                          f"prepare writes the binarized copy's folder; move it aside first")
    try:
        foreign = sorted(name for name in os.listdir(path) if not _OURS.fullmatch(name))
    except (FileNotFoundError, NotADirectoryError):
        return
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise CorpusError(f"{path} holds what dtmt prepare did not write there ({shown}), which rebuilding it "
                          f"would remove; move them out of it first")


def token_dtype(pieces: int) -> np.dtype:
    return np.dtype(np.uint16 if pieces <= 1 << 16 else np.uint32)


# ------------------------------------------------------------------------------------------------ reading
class BinarizedSplit:
    """One split: `len()` pairs; `pair(i)` and `pairs(indices)` give (source ids, target ids) as lists of ints.

    They are read with positioned reads (os.pread) of just the bytes asked for, not through a mapping: a page
    fault on a mapped file maps its neighbours too (about 120 KiB of resident memory per random pair on the
    development machine; docs/design/data.md, "Positioned reads"), so training through a mapping would grow to
    the corpus size over an epoch, while the page cache that reads fill is not the process's memory.
    `memmap(side)` maps the same files for tools that want numpy arrays."""

    def __init__(self, directory: str, split: str, dtype: np.dtype, n: int, shards: Optional[Dict[str, str]] = None):
        """`shards`: the SHA-1 of each file ("src.bin", "src.idx", "tgt.bin", "tgt.idx") as the manifest records
        them, for verify() to compare (None: not compared)."""
        self.n, self.dtype, self.shards = n, np.dtype(dtype), shards
        self._paths = {side: (os.path.join(directory, f"{split}.{side}.bin"),
                              os.path.join(directory, f"{split}.{side}.idx")) for side in SIDES}
        self._fds: List[int] = []
        for path in (p for pair in self._paths.values() for p in pair):
            if not os.path.isfile(path):
                what = "is not a regular file (a folder, a pipe or a device)" if os.path.exists(path) else "is missing"
                raise CorpusError(f"{path} {what}; rebuild the binarized corpus with `dtmt prepare binarize`")
        for side, (_, idx) in self._paths.items():
            if os.path.getsize(idx) != 8 * (n + 1):
                raise CorpusError(f"{directory}: the index of split {split} has {os.path.getsize(idx) // 8 - 1} "
                                  f"pairs, the manifest {n}; rebuild it with `dtmt prepare binarize`")
        self._open()
        for k, side in enumerate(SIDES):
            end = int(np.frombuffer(os.pread(self._fds[2 * k + 1], 8, 8 * n), dtype=np.int64)[0])
            if os.path.getsize(self._paths[side][0]) != end * self.dtype.itemsize:
                raise CorpusError(f"{self._paths[side][0]} is not as long as its index says (truncated?); rebuild "
                                  f"it with `dtmt prepare binarize`")

    def _open(self) -> None:
        self._fds = [os.open(path, os.O_RDONLY) for side in SIDES for path in self._paths[side]]

    def __len__(self) -> int:
        return self.n

    def __del__(self):
        for fd in getattr(self, "_fds", []):
            try:
                os.close(fd)
            except OSError:
                pass

    def memmap(self, side: str) -> Tuple[np.ndarray, np.ndarray]:
        """(ids, offsets) of one side ("src" or "tgt") as read-only numpy memory maps."""
        bin_path, idx_path = self._paths[side]
        return _open_memmap(bin_path, self.dtype), _open_memmap(idx_path, np.int64)

    def lengths(self, dtype=np.uint16, chunk: int = 1 << 20) -> np.ndarray:
        """[N, 2] lengths (source, target) in `dtype`, saturated at its largest value, from the index in chunks."""
        top = np.iinfo(dtype).max
        out = np.empty((self.n, 2), dtype=dtype)
        for s, side in enumerate(SIDES):
            with open(self._paths[side][1], "rb") as f:
                prev = np.fromfile(f, dtype=np.int64, count=1)
                for start in range(0, self.n, chunk):
                    block = np.fromfile(f, dtype=np.int64, count=min(chunk, self.n - start))
                    out[start:start + len(block), s] = np.minimum(np.diff(np.concatenate((prev, block))), top)
                    prev = block[-1:]
        return out

    def verify(self, vocab_sizes: Sequence[int], chunk: int = 1 << 22) -> None:
        """The whole split checked before training reads any of it (issue 71 item 4): each side's offsets start at
        0 and never decrease (so every pair lies inside its file, whose length the last offset is: checked when the
        split opens), every id is below its vocabulary's size and none is a control symbol (PAD, BOS, EOS), and each
        file's SHA-1 is the one recorded when it was written (when the split was opened with `shards`). Read in
        chunks of `chunk` values with plain reads (no mapping: the memory stays flat), vectorised and hashed as
        read: about 0.1 s per 100 MB (the control symbols' test about 0.03 s of it, on a Xeon). CorpusError
        naming the file (and the pair where there is one)."""
        rebuild = "rebuild the binarized corpus with `dtmt prepare binarize`"
        for k, side in enumerate(SIDES):
            bin_path, idx_path = self._paths[side]
            digest = hashlib.sha1()
            with open(idx_path, "rb") as f:
                prev = np.fromfile(f, dtype=np.int64, count=1)
                if len(prev) != 1 or prev[0] != 0:
                    raise CorpusError(f"{idx_path}: the first offset is not 0; {rebuild}")
                digest.update(prev)
                done = 0
                while done < self.n:
                    block = np.fromfile(f, dtype=np.int64, count=min(chunk, self.n - done))
                    joined = np.concatenate((prev, block))
                    falls = joined[1:] < joined[:-1]   # (compared, not subtracted: steps of 2^62 wrap around to
                    if falls.any():                    # the file's length, negative offsets between)
                        raise CorpusError(f"{idx_path}: the offsets decrease at pair {done + int(np.argmax(falls))}"
                                          f" (a corrupt index); {rebuild}")
                    digest.update(block)
                    prev, done = block[-1:], done + len(block)
            self._compare(digest, f"{side}.idx", idx_path, rebuild)
            limit, start, digest = vocab_sizes[k], 0, hashlib.sha1()

            def refused(where: int, what: str, side=side, bin_path=bin_path) -> CorpusError:
                """The error for the id at flat position `where` of the side's file: named by its pair."""
                pair = int(np.searchsorted(self.memmap(side)[1], where, side="right")) - 1
                return CorpusError(f"{bin_path}: pair {pair} holds {what}; {rebuild}")
            with open(bin_path, "rb") as f:
                while True:
                    ids = np.fromfile(f, dtype=self.dtype, count=chunk)
                    if not len(ids):
                        break
                    if int(ids.max()) >= limit:   # (the first such id, by its pair: the message had named the max)
                        where = int(np.argmax(ids >= limit))
                        raise refused(start + where, f"id {int(ids[where])}, beyond the {side} vocabulary's {limit} "
                                      f"(a corrupt or mismatched corpus)")
                    special = (ids == PAD) | (ids == BOS) | (ids == EOS)   # (never a piece of a sentence;
                    if special.any():   # trained on, a pair of PADs was a pair of nothing, silently)
                        where = int(np.argmax(special))
                        raise refused(start + where, f"id {int(ids[where])}, a control symbol (padding, BOS or EOS), "
                                      f"not a piece (a corrupt corpus)")
                    digest.update(ids)
                    start += len(ids)
            self._compare(digest, f"{side}.bin", bin_path, rebuild)

    def _compare(self, digest, name: str, path: str, rebuild: str) -> None:
        if self.shards is not None and digest.hexdigest() != self.shards.get(name):
            raise CorpusError(f"{path}: its bytes are not those written by `dtmt prepare binarize` (SHA-1 "
                              f"{digest.hexdigest()[:12]}, recorded {str(self.shards.get(name))[:12]}: changed or "
                              f"corrupted on disk since); {rebuild}")

    def pair(self, i: int) -> Tuple[List[int], List[int]]:
        if not 0 <= i < self.n:
            raise IndexError(f"pair {i} of a split of {self.n}")
        size = self.dtype.itemsize
        out = []
        for k in (0, 2):
            a, b = np.frombuffer(os.pread(self._fds[k + 1], 16, 8 * i), dtype=np.int64).tolist()
            out.append(np.frombuffer(os.pread(self._fds[k], (b - a) * size, a * size), dtype=self.dtype).tolist())
        return out[0], out[1]

    def pairs(self, indices: Sequence[int]) -> List[Tuple[List[int], List[int]]]:
        return [self.pair(int(i)) for i in indices]


def _open_memmap(path: str, dtype) -> np.ndarray:
    if os.path.getsize(path) == 0:   # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _text_record(rec) -> bool:
    """Whether `rec` is a manifest's record of a text file (what `stale` reads): a file name of the corpus directory
    (no folder), its size, modification time and SHA-1."""
    return (isinstance(rec, dict) and isinstance(rec.get("file"), str) and rec["file"] not in ("", ".", "..")
            and os.path.basename(rec["file"]) == rec["file"] and _count(rec.get("bytes"))
            and isinstance(rec.get("mtime_ns"), int) and isinstance(rec.get("sha1"), str))


class BinarizedCorpus:
    """A binarized corpus directory (DIR/bin-...): its manifest, vocabularies and splits."""

    def __init__(self, path: str):
        self.path = path
        manifest = os.path.join(path, MANIFEST)
        if not os.path.exists(manifest):
            raise CorpusError(f"{path}: not a binarized corpus (no {MANIFEST}); make it with `dtmt prepare binarize`")
        rebuild = "rebuild the binarized corpus with `dtmt prepare binarize`"
        try:
            self.manifest = json.loads(read_small_file(manifest, rebuild).decode("utf-8"))
            if not isinstance(self.manifest, dict):
                raise ValueError("not a JSON object")
        except RecursionError:   # (a crafted file of nested brackets)
            raise CorpusError(f"{manifest}: unreadable (nested too deeply); rebuild it with `dtmt prepare binarize`"
                              ) from None
        except ValueError as exc:
            raise CorpusError(f"{manifest}: unreadable ({exc}); rebuild it with `dtmt prepare binarize`") from None
        if self.manifest.get("format") != FORMAT:
            raise CorpusError(f"{path}: binarized with format {self.manifest.get('format')}, this dtmt reads format "
                              f"{FORMAT}; rebuild it with `dtmt prepare binarize`")
        splits = self.manifest.get("splits")
        # (a missing key had been said as "format 3, this dtmt reads format 3"; a split name is a part of the
        # folder's file names: "../x" had named a file outside it)
        if (self.manifest.get("dtype") not in ("uint16", "uint32") or not isinstance(splits, dict)
                or not all(isinstance(name, str) and plain_name(name) for name in splits)
                or not isinstance(self.manifest.get("languages"), dict) or not all(
                isinstance(v, dict) and _count(v.get("pairs")) and isinstance(v.get("shards"), dict)
                and all(isinstance(v["shards"].get(f"{side}.{ext}"), str) for side in SIDES for ext in ("bin", "idx"))
                and isinstance(v.get("text"), dict) and all(_text_record(v["text"].get(side)) for side in SIDES)
                for v in splits.values())):
            raise CorpusError(f"{manifest}: malformed (dtype uint16 or uint32, languages, splits {{name: {{\"pairs\": "
                              f"count, \"shards\": {{file: SHA-1}}, \"text\": {{side: record}}}}}} expected, the "
                              f"names letters, digits, '-' or '_'); rebuild it with `dtmt prepare binarize`")
        models = self.manifest.get("models")
        if not isinstance(models, dict) or not all(isinstance(models.get(f"{side}.model"), str) for side in SIDES):
            raise CorpusError(f"{manifest}: malformed (models {{file: SHA-1}} expected); rebuild it with `dtmt prepare "
                              f"binarize`")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.protos = []
        for side in SIDES:
            model = os.path.join(path, f"{side}.model")
            self.protos.append(read_small_file(model, rebuild))
            sha1 = hashlib.sha1(self.protos[-1]).hexdigest()
            if sha1 != models[f"{side}.model"]:   # (another model of as many pieces passed every id check)
                raise CorpusError(f"{model}: not the model the shards were encoded with (SHA-1 {sha1[:12]}, recorded "
                                  f"{models[f'{side}.model'][:12]}: replaced or changed since); rebuild the binarized "
                                  f"corpus with `dtmt prepare binarize`")

    def vocabularies(self) -> Tuple[Vocabulary, Vocabulary]:
        """The source and target vocabularies of its SentencePiece models; CorpusError naming the file of one that
        SentencePiece cannot load (it was SentencePiece's own traceback)."""
        from dtmt_models.errors import one_line

        vocabularies = []
        for side, proto in zip(SIDES, self.protos):
            try:
                vocabularies.append(Vocabulary(proto))
            except (RuntimeError, ValueError) as exc:
                raise CorpusError(f"{os.path.join(self.path, f'{side}.model')}: not a SentencePiece model this reads "
                                  f"({one_line(exc)[:100]}); rebuild the binarized corpus with `dtmt prepare "
                                  f"binarize`") from None
        return vocabularies[0], vocabularies[1]

    @property
    def splits(self) -> List[str]:
        return list(self.manifest["splits"])

    def split(self, name: str) -> BinarizedSplit:
        if name not in self.manifest["splits"]:
            raise CorpusError(f"{self.path}: no split {name!r}; splits: {self.splits}")
        info = self.manifest["splits"][name]
        return BinarizedSplit(self.path, name, self.dtype, info["pairs"], info["shards"])

    def stale(self, corpus_dir: str) -> List[str]:
        """What of `corpus_dir` is not what this was made from: its languages or splits (corpus.json), or text files
        whose size or SHA-1 differ (a file whose size and modification time are unchanged is taken as unchanged
        without reading it)."""
        manifest = read_manifest(corpus_dir)
        langs = {"src": manifest["src_lang"], "tgt": manifest["tgt_lang"]}
        if langs != self.manifest["languages"]:
            return [f"the languages, now {langs['src']}-{langs['tgt']}"]
        splits = sorted(s for s in ("train", "dev", "test") if s in manifest.get("counts", {}))
        if splits != sorted(self.manifest["splits"]):
            return [f"the splits, now {', '.join(splits)}"]
        changed, touched = [], False
        for split, info in self.manifest["splits"].items():
            for side in SIDES:
                rec = info["text"][side]
                path = os.path.join(corpus_dir, rec["file"])
                try:
                    st = os.stat(path)
                except OSError:
                    changed.append(rec["file"])
                    continue
                if st.st_size != rec["bytes"]:
                    changed.append(rec["file"])
                elif st.st_mtime_ns != rec["mtime_ns"]:
                    if _file_sha1(path) != rec["sha1"]:
                        changed.append(rec["file"])
                    else:   # the same bytes, touched: remember the new time so that the next check reads nothing
                        rec["mtime_ns"] = st.st_mtime_ns
                        touched = True
        if touched and not changed:
            try:
                from dtmt_models.atomic import atomic_write

                with atomic_write(os.path.join(self.path, MANIFEST)) as f:
                    json.dump(self.manifest, f, indent=2)
                    f.write("\n")
            except OSError:   # a read-only copy: checked by content again next time
                pass
        return changed


def known_train_sha1(corpus_dir: str) -> Optional[str]:
    """The SHA-1 of the training text (as corpus.corpus_fingerprint computes it) from a binarized copy's manifest,
    when the copy is of this corpus's languages and its record of both training files' size and modification
    time matches the files now (the rule BinarizedCorpus.stale trusts too); None when no copy vouches for them,
    and the caller reads the text."""
    try:
        manifest = read_manifest(corpus_dir)
        entries = sorted(e for e in os.listdir(corpus_dir) if e.startswith("bin-"))
    except (OSError, CorpusError):
        return None
    langs = {"src": manifest.get("src_lang"), "tgt": manifest.get("tgt_lang")}
    for entry in entries:
        try:
            copy = BinarizedCorpus(os.path.join(corpus_dir, entry))
            if copy.manifest["languages"] != langs:
                continue
            text = copy.manifest["splits"]["train"]["text"]
            now = [os.stat(os.path.join(corpus_dir, text[side]["file"])) for side in SIDES]
            if all((st.st_size, st.st_mtime_ns) == (text[side]["bytes"], text[side]["mtime_ns"])
                   for side, st in zip(SIDES, now)):
                return copy.manifest["train_sha1"]
        except (OSError, KeyError, TypeError, CorpusError):
            continue
    return None


def fingerprint(corpus_dir: str) -> dict:
    """corpus.corpus_fingerprint of the prepared corpus `corpus_dir`, the training text's SHA-1 taken from a binarized
    copy that vouches for it (known_train_sha1), else read from the text (what dtmt train records and compares)."""
    return corpus_fingerprint(corpus_dir, train_sha1=known_train_sha1(corpus_dir))


class NotBinarized(CorpusError):
    """The binarized copy asked for is missing or out of date; `reason` says which, in a few words, without the
    advice to run `dtmt prepare binarize` that the message carries."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def open_binarized(corpus_dir: str, vocab_type: str, vocab_size: int,
                   protos: Optional[Sequence[bytes]] = None) -> BinarizedCorpus:
    """The binarized copy of `corpus_dir` for this vocabulary (or for these SentencePiece models), checked against
    the text it was made from; NotBinarized if it is missing, out of date or of another format (the message says
    how to make it)."""
    path = binarized_path(corpus_dir, vocab_type, vocab_size, protos)
    command = f"dtmt prepare binarize --data {corpus_dir} --vocab-type {vocab_type} --vocab-size {vocab_size}"
    if not os.path.lexists(os.path.join(path, MANIFEST)):   # (one that is no file: said by BinarizedCorpus)
        reason = f"{corpus_dir} has no binarized corpus for {vocab_type} {vocab_size} yet"
        raise NotBinarized(f"{reason}; make it with `{command}`", reason)
    try:
        corpus = BinarizedCorpus(path)
        for name in corpus.splits:   # every split's files there and of the lengths the manifest says
            corpus.split(name)
    except CorpusError as exc:
        raise NotBinarized(str(exc), str(exc).split(";")[0]) from None
    changed = corpus.stale(corpus_dir)
    if changed:
        reason = f"{path} was made from other text than {corpus_dir} now holds (changed: {'; '.join(changed)})"
        raise NotBinarized(f"{reason}; rebuild it with `{command}`", reason)
    return corpus


# ------------------------------------------------------------------------------------------------ building
def binarize(corpus_dir: str, vocab_size: int, vocab_type: str = "bpe", sample: int = DEFAULT_SAMPLE,
             seed: int = DEFAULT_SEED, workers: int = 0, log: Callable[[str], None] = print,
             protos: Optional[Sequence[bytes]] = None) -> str:
    """Builds DIR/bin-<type><size> from the prepared corpus `corpus_dir` (see the module docstring) and returns its
    path. SentencePiece is trained on `sample` training lines per side, drawn with `seed` (all of them, in order,
    when the corpus has no more); `workers` encoding processes (0: one per core; 1: in this process).
    With `protos` (the two SentencePiece models, e.g. a checkpoint's) nothing is trained: the text is encoded with
    them into binarized_path(..., protos).
    CorpusError on bad text or a vocabulary SentencePiece cannot build; nothing is left behind then."""
    if vocab_type not in ("bpe", "unigram"):
        raise CorpusError(f"--vocab-type must be bpe or unigram, not {vocab_type!r}")
    if vocab_size < 8:
        raise CorpusError(f"--vocab-size must be at least 8, not {vocab_size}")
    if sample < 1:
        raise CorpusError(f"--sample must be at least 1, not {sample}")
    manifest = read_manifest(corpus_dir)
    langs = (manifest["src_lang"], manifest["tgt_lang"])
    splits = [s for s in ("train", "dev", "test") if s in manifest.get("counts", {})]
    if "train" not in splits:
        raise CorpusError(f"{corpus_dir}: the manifest names no train split")
    workers = workers or min(len(os.sched_getaffinity(0)), 16)
    final = binarized_path(corpus_dir, vocab_type, vocab_size, protos)
    check_only_ours(final)   # (before any work; and again as it is replaced)
    _remove_leftovers(corpus_dir, os.path.basename(final))
    tmp = os.path.join(corpus_dir, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    t_start = time.perf_counter()
    try:
        os.makedirs(tmp)
        # 1. every file's line count and checksum, before any long work: a count mismatch is reported at once
        texts: Dict[str, Dict[str, dict]] = {}
        for split in splits:
            paths = [os.path.join(corpus_dir, f"{split}.{lang}") for lang in langs]
            both = hashlib.sha1()   # of the two files one after the other, as corpus.corpus_fingerprint has it
            info = [_scan(p, both) for p in paths]
            if split == "train":
                train_sha1 = both.hexdigest()
            if info[0]["lines"] != info[1]["lines"]:
                raise count_mismatch(paths[0], info[0]["lines"], paths[1], info[1]["lines"])
            if info[0]["lines"] == 0:
                raise CorpusError(f"{paths[0]} and {paths[1]} hold no sentences: a corpus needs at least one pair")
            texts[split] = {side: dict(i, file=os.path.basename(p), path=p) for side, i, p in zip(SIDES, info, paths)}
        n_train = texts["train"]["src"]["lines"]
        # 2. the vocabularies, from a seeded sample of the training lines
        chosen = None if n_train <= sample else sorted(random.Random(seed).sample(range(n_train), sample))
        t0 = time.perf_counter()
        given = protos is not None
        left_out = [0, 0]
        if not given:
            protos, left_out = _train_vocabularies(texts, chosen, vocab_size, vocab_type, workers, corpus_dir)
        protos = list(protos)
        for side, proto in zip(SIDES, protos):
            with open(os.path.join(tmp, f"{side}.model"), "wb") as f:
                f.write(proto)
        pieces = [len(Vocabulary(p)) for p in protos]
        dtype = token_dtype(max(pieces))
        used = 0 if given else n_train if chosen is None else len(chosen)
        if given:
            log(f"vocabularies: the given SentencePiece models, {pieces[0]:,} / {pieces[1]:,} pieces")
        else:
            log(f"vocabularies: SentencePiece {vocab_type} {vocab_size} trained on "
                f"{'the word counts of ' if vocab_type == 'bpe' else ''}{used:,} of {n_train:,} training "
                f"lines per side (seed {seed}) in {time.perf_counter() - t0:.1f}s: {pieces[0]:,} / {pieces[1]:,} "
                f"pieces")
            if any(left_out):   # (the lines sampled are not the lines learnt from: a file of long lines had
                # given a vocabulary of its few short ones, logged as trained on every line)
                log(f"warning: SentencePiece's trainer leaves out a line of more than "
                    f"{SENTENCEPIECE_MAX_SENTENCE_BYTES:,} bytes: the vocabularies were learnt without "
                    + ", ".join(f"{n:,} of the {side} side's {used:,} sampled lines" for side, n in
                                zip(SIDES, left_out) if n)
                    + (" (most of them: is it one sentence a line?)" if 2 * max(left_out) > used else ""))
            short = [f"{side} {n:,}" for side, n in zip(SIDES, pieces) if n < vocab_size]
            if short:   # (BPE stops when the sample's words are whole pieces: the name says the size asked for)
                log(f"warning: --vocab-size {vocab_size:,}: the sample's text gives fewer pieces ({', '.join(short)}); "
                    f"{os.path.basename(final)} holds those")
        # 3. every split's ids, on `workers` processes
        split_info = {}
        for split in splits:
            t0 = time.perf_counter()
            stats = _encode_split(texts[split], tmp, split, protos, dtype, workers,
                                  Ticker(log, f"{split}: encoding", texts[split]["src"]["lines"]))
            split_info[split] = {
                "pairs": stats["pairs"], "tokens": stats["tokens"], "empty_after_segmentation": stats["empty"],
                "longest": stats["longest"], "shards": stats["shards"],
                "text": {side: {k: texts[split][side][k] for k in ("file", "bytes", "mtime_ns", "sha1")}
                         for side in SIDES}}
            dt = time.perf_counter() - t0
            log(f"{split}: {stats['pairs']:,} pairs, {stats['tokens']['src']:,} + {stats['tokens']['tgt']:,} tokens "
                f"in {dt:.1f}s ({stats['pairs'] / max(dt, 1e-9):,.0f} pairs/s, {workers} process(es))"
                + (f"; {stats['empty']:,} pairs with a side empty after segmentation (training skips them)"
                   if stats["empty"] else "")
                + ("" if stats["cache_exact"] else "; the word cache disagreed with SentencePiece and was turned off"))
        record = {"format": FORMAT, "vocab_type": vocab_type, "vocab_size": vocab_size,
                  "pieces": dict(zip(SIDES, pieces)), "languages": dict(zip(SIDES, langs)),
                  "sample": {"size": used, "of": n_train, "seed": seed}, "models_given": given, "dtype": dtype.name,
                  "train_sha1": train_sha1, "splits": split_info,
                  "models": {f"{side}.model": hashlib.sha1(p).hexdigest() for side, p in zip(SIDES, protos)}}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        # 4. into place: one rename (an earlier copy is moved aside first and removed after)
        old = None
        if os.path.exists(final):
            check_only_ours(final)
            old = os.path.join(corpus_dir, f".{os.path.basename(final)}.old-{os.getpid()}")
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError as e:
            # another process (a second `dtmt train` on the same corpus) put the same build into place between
            # the check and the rename: keep it, it was made from the same files with the same settings
            if old is not None or e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isdir(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"{final} was written by another process meanwhile; using it")
            return final
        if old and os.path.islink(old):   # (a link to a folder elsewhere: the link goes, what it points to stays)
            os.remove(old)
        elif old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {final} in {time.perf_counter() - t_start:.1f}s")
    return final


def _train_vocabularies(texts, chosen, vocab_size, vocab_type, workers, corpus_dir) -> Tuple[List[bytes], List[int]]:
    """The two SentencePiece models, a process a side when workers >= 2 (the sample's memory goes with them), and
    per side the number of sampled lines left out as too long (SENTENCEPIECE_MAX_SENTENCE_BYTES)."""
    from dtmt_models.errors import one_line

    jobs = [(texts["train"][side]["path"], chosen, vocab_size, vocab_type) for side in SIDES]
    try:
        if workers < 2:
            trained = [_train_vocabulary(*job) for job in jobs]
        else:
            with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"),
                                                        initializer=_die_with_parent) as pool:
                trained = list(pool.map(_train_vocabulary, *zip(*jobs)))
    except concurrent.futures.process.BrokenProcessPool as exc:
        raise CorpusError(f"a SentencePiece training process died ({one_line(exc)}); out of memory? A smaller "
                          f"--sample needs less") from None
    except _NoShortLine as exc:
        raise CorpusError(f"every sampled line of the training text {os.path.basename(exc.args[0])} is longer "
                          f"than {SENTENCEPIECE_MAX_SENTENCE_BYTES:,} bytes, which SentencePiece's trainer leaves out: "
                          f"no vocabulary can be built (is it one sentence a line?)") from None
    except RuntimeError as exc:   # SentencePiece: e.g. fewer pieces than the text has characters
        said = one_line(exc)
        if "all_chars_count" in said:   # (every sentence of a side is characters SentencePiece drops: U+200B...)
            raise CorpusError(f"{corpus_dir}: a side's training text has no character SentencePiece keeps (only "
                              f"spaces and invisible ones such as U+200B?): no vocabulary can be built") from None
        need = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", said)
        if need:   # (its advice names its own option, not ours)
            raise CorpusError(f"--vocab-size {vocab_size}: too small for the training text of {corpus_dir}: "
                              f"SentencePiece needs at least {need.group(2)} pieces there (one per character the "
                              f"text has, and 4 special ones)") from None
        raise CorpusError(f"--vocab-size {vocab_size}: SentencePiece cannot build a vocabulary of that size "
                          f"from {corpus_dir} ({said})") from None
    return [proto for proto, _ in trained], [left_out for _, left_out in trained]


class _NoShortLine(Exception):
    """Every sampled line of a side (its path, args[0]) is too long for SentencePiece's trainer."""


def _die_with_parent() -> None:
    """A worker process ends when the process that forked it does, even by SIGKILL (Linux's PR_SET_PDEATHSIG), and
    by a SIGTERM of its own (the parent's handler, inherited by the fork, is dtmt prepare's, not the worker's)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _train_vocabulary(path: str, chosen: Optional[List[int]], vocab_size: int,
                      vocab_type: str) -> Tuple[bytes, int]:
    """BPE from the sample's word counts (the same model as from its sentences, faster), unigram from the
    sentences; and the number of sampled lines left out as too long. The model is trained here with SentencePiece's
    own errors (RuntimeError), which _train_vocabularies turns into one line (Vocabulary.train's ValueError had been
    a traceback)."""
    from dtmt_models.data.vocabulary import _train_proto

    lines = _Kept(path, chosen)
    sample = _count_words(lines) if vocab_type == "bpe" else list(lines)   # (read whole: `lines` counted)
    if not lines.kept and lines.left_out:
        raise _NoShortLine(path)
    if vocab_type == "bpe":
        return Vocabulary.train_bpe_on_word_counts(sample, vocab_size).proto, lines.left_out
    return _train_proto(iter(sample), int(vocab_size), vocab_type, 1.0), lines.left_out


# SentencePiece's trainer leaves out a sentence of more bytes than this (its max_sentence_length, at its default)
SENTENCEPIECE_MAX_SENTENCE_BYTES = 4192


class _Kept:
    """The sampled lines (_sample_lines) SentencePiece's trainer keeps, those of at most
    SENTENCEPIECE_MAX_SENTENCE_BYTES, counting those it keeps and those it leaves out (their words, counted, had
    made the model differ from the sentences' in every piece)."""

    def __init__(self, path: str, chosen: Optional[List[int]]):
        self.lines, self.kept, self.left_out = _sample_lines(path, chosen), 0, 0

    def __iter__(self) -> Iterator[str]:
        longest = SENTENCEPIECE_MAX_SENTENCE_BYTES
        for line in self.lines:
            if len(line) * 4 <= longest or len(line.encode("utf-8")) <= longest:
                self.kept += 1
                yield line
            else:
                self.left_out += 1


def _word_counts(path: str, chosen: Optional[List[int]], block: int = 4096) -> collections.Counter:
    """How often each word occurs in the sampled lines SentencePiece's trainer keeps (_Kept), words as
    `Vocabulary.train_bpe_on_word_counts` takes them (split at spaces, tabs and carriage returns; the empty string
    counted too and left out there)."""
    return _count_words(_Kept(path, chosen), block)


def _count_words(lines: Iterable[str], block: int = 4096) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    lines = iter(lines)
    while True:
        part = list(itertools.islice(lines, block))
        if not part:
            return counts
        counts.update(" ".join(part).replace("\t", " ").replace("\r", " ").split(" "))


def _remove_leftovers(corpus_dir: str, name: str) -> None:
    """Removes the temporary or moved-aside directories of earlier runs whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(tmp|old)-(\d+)")
    for entry in os.listdir(corpus_dir):
        m = pattern.fullmatch(entry)
        if m and not _alive(int(m.group(2))):
            shutil.rmtree(os.path.join(corpus_dir, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether the process that left a build folder still runs (this one's own earlier folders count as left)."""
    return pid != os.getpid() and process_alive(pid)


def _file_sha1(path: str) -> str:
    digest = hashlib.sha1()
    scan_file(path, digest)
    return digest.hexdigest()


def _scan(path: str, both) -> dict:
    """Lines (as corpus.read_lines counts them), size, modification time and SHA-1 of a file, in one read; the
    bytes and a closing NUL also go into the digest `both`."""
    digest = hashlib.sha1()
    # the time before the read: a file written during the read then looks touched, and is hashed again
    st = os.stat(path) if os.path.isfile(path) else None
    lines = scan_file(path, digest, both)
    both.update(b"\0")
    return {"lines": lines, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha1": digest.hexdigest()}


def _sample_lines(path: str, chosen: Optional[List[int]]) -> Iterator[str]:
    """The stripped lines at the 0-based line numbers `chosen` (all lines when None); lines that are not valid
    UTF-8 or are empty are left out here (the encoding pass reports them)."""
    wanted = iter(chosen) if chosen is not None else None
    target = next(wanted, None) if wanted is not None else None
    with open(path, "rb") as f:
        for i, raw in enumerate(bounded_lines(f)):
            if wanted is not None:
                if i != target:
                    continue
                target = next(wanted, None)
            text, problem = decode_file_line(raw, path, i + 1)
            if not problem:
                yield text
            if wanted is not None and target is None:
                break


def _read_chunks(src_path: str, tgt_path: str, lines: int) -> Iterator[Tuple[int, List[bytes], List[bytes]]]:
    with open(src_path, "rb") as fs, open(tgt_path, "rb") as ft:
        start, src_lines, tgt_lines = 1, bounded_lines(fs), bounded_lines(ft)
        while True:
            a, b = list(itertools.islice(src_lines, lines)), list(itertools.islice(tgt_lines, lines))
            if not a and not b:
                return
            yield start, a, b
            start += max(len(a), len(b))


def _encode_split(text: Dict[str, dict], out_dir: str, split: str, protos: Sequence[bytes], dtype: np.dtype,
                  workers: int, ticker: Optional[Ticker] = None) -> dict:
    """Encodes one split into out_dir/{split}.{side}.bin/.idx; CorpusError listing the bad lines (up to
    MAX_LISTED, with the total) once the whole split has been read. `ticker` is told the pairs encoded."""
    paths = (text["src"]["path"], text["tgt"]["path"])
    chunks = _read_chunks(*paths, CHUNK_LINES)
    problems = Problems()
    stats = {"pairs": 0, "tokens": {"src": 0, "tgt": 0}, "empty": 0, "longest": {"src": 0, "tgt": 0},
             "cache_exact": True}
    files = [open(os.path.join(out_dir, f"{split}.{s}.bin"), "wb") for s in SIDES]
    idx = [open(os.path.join(out_dir, f"{split}.{s}.idx"), "wb") for s in SIDES]
    offsets = [0, 0]
    digests = {f"{side}.{ext}": hashlib.sha1() for side in SIDES for ext in ("bin", "idx")}
    try:
        for f, side in zip(idx, SIDES):
            np.zeros(1, np.int64).tofile(f)
            digests[f"{side}.idx"].update(np.zeros(1, np.int64))
        for result in _map_chunks(chunks, paths, protos, dtype, workers):
            problems.merge(result["problems"])
            stats["cache_exact"] &= result["cache_exact"]
            if problems:
                continue   # keep reading to count and list them, write nothing more
            for s, side in enumerate(SIDES):
                ids, lens = result["ids"][s], result["lengths"][s]
                ends = offsets[s] + np.cumsum(lens, dtype=np.int64)
                ids.tofile(files[s])
                ends.tofile(idx[s])
                digests[f"{side}.bin"].update(np.ascontiguousarray(ids))
                digests[f"{side}.idx"].update(ends)
                offsets[s] += int(lens.sum())
                stats["tokens"][side] += int(lens.sum())
                if len(lens):
                    stats["longest"][side] = max(stats["longest"][side], int(lens.max()))
            stats["pairs"] += len(result["lengths"][0])
            stats["empty"] += int(((result["lengths"][0] == 0) | (result["lengths"][1] == 0)).sum())
            if ticker is not None:
                ticker.tick(stats["pairs"])
    finally:
        for f in files + idx:
            f.close()
    problems.raise_if_any(f"parallel corpus ({split})")
    stats["shards"] = {name: d.hexdigest() for name, d in digests.items()}
    return stats


def _map_chunks(chunks, paths, protos, dtype, workers):
    """The encoded chunks, in order: in this process, or on `workers` processes with at most 2 x workers chunks
    in flight (memory stays bounded whatever the corpus size)."""
    if workers <= 1:
        encoder = _PairEncoder(protos)
        for chunk in chunks:
            yield encoder.encode_chunk(chunk, paths, dtype)
        return
    # fork: quick, and it does not re-run the main script as spawn does. The children run only this module's
    # Python, numpy (no BLAS) and SentencePiece, none of which waits on a lock that another thread of this process
    # (torch's, gloo's, OpenBLAS's) might have held at the fork.
    ctx = multiprocessing.get_context("fork")
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                  initargs=(tuple(protos),))
    finished, pending = False, collections.deque()   # (a chunk leaves `pending` once its result is in)

    def first():
        result = pending[0].result()
        pending.popleft()
        return result

    try:
        for chunk in chunks:
            pending.append(pool.submit(_encode_in_worker, chunk, paths, dtype))
            if len(pending) >= 2 * workers:
                yield first()
        while pending:
            yield first()
        finished = True
    except concurrent.futures.process.BrokenProcessPool as exc:
        from dtmt_models.errors import one_line

        raise CorpusError(f"an encoding process died ({one_line(exc)}); out of memory? Fewer --workers need "
                          f"less") from None
    finally:   # interrupted, or an error: the chunks not begun are dropped; those at work finish (a worker ended
        # part-way through sending its result had left the pool's reader waiting for the rest for ever), or past
        # STOP_WAIT_S their workers are killed
        if not finished:
            running = [f for f in pending if not f.cancel()]
            if concurrent.futures.wait(running, timeout=STOP_WAIT_S).not_done:
                for child in multiprocessing.active_children():
                    child.kill()
        pool.shutdown(wait=True, cancel_futures=not finished)


_WORKER: Optional["_PairEncoder"] = None


def _init_worker(protos) -> None:
    """An encoding worker: ends with its parent (_die_with_parent) and otherwise when the parent ends the pool, which
    finishes the chunks running: it ignores SIGINT and SIGTERM, which reach the whole process group (Ctrl-C,
    `timeout`, Slurm) and which the parent handles. (A worker ended by SIGTERM part-way through sending a chunk had
    left the pool's reader waiting for the rest for ever: prepare hung, its lock held; one interrupted by SIGINT
    printed its traceback.)"""
    import signal

    global _WORKER
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER = _PairEncoder(protos)


def _encode_in_worker(chunk, paths, dtype):
    return _WORKER.encode_chunk(chunk, paths, dtype)


class _PairEncoder:
    """Validates and encodes chunks of line pairs, one `_CachedEncoder` per side."""

    def __init__(self, protos):
        self.sides = [_CachedEncoder(p) for p in protos]

    def encode_chunk(self, chunk, paths, dtype) -> dict:
        start, raw_src, raw_tgt = chunk
        texts: List[List[str]] = [[], []]
        problems = Problems()
        for s, (raw, path) in enumerate(zip((raw_src, raw_tgt), paths)):
            for i, line in enumerate(raw, start=start):
                text, problem = decode_file_line(line, path, i)
                if problem:
                    problems.add(problem)
                texts[s].append(text)
        if len(raw_src) != len(raw_tgt):   # a file changed while it was read
            problems.add(f"line counts differ: {paths[0]} and {paths[1]} changed while being read")
        if problems:
            return {"problems": problems, "cache_exact": True}
        ids, lengths = zip(*(enc.encode(side, dtype) for enc, side in zip(self.sides, texts)))
        return {"problems": problems, "ids": ids, "lengths": lengths,
                "cache_exact": all(e.exact for e in self.sides)}


class _CachedEncoder:
    """`Vocabulary.encode` over many lines, with the ids of each word cached. The models dtmt trains split on
    whitespace (no piece crosses a space) and normalise with NFKC, so on a line that is NFKC-normal and has no
    whitespace but plain spaces, its ids are its words' ids joined. Other lines go to SentencePiece whole. The
    first lines of every call are also encoded whole and compared; a difference turns the cache off for good."""

    CHECKED = 4            # lines per call compared with SentencePiece's own encoding
    LIMIT = 500_000        # cached words at most (emptied when full: memory stays bounded on any text)

    def __init__(self, proto: bytes):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.exact = True
        self._reset()

    def _reset(self) -> None:
        """An empty cache: word -> its number k; the ids of word k are table[start[k]:start[k] + length[k]]."""
        self.index: Dict[str, int] = {"": 0}
        self.table = np.zeros(0, np.int32)
        self.start = np.zeros(1, np.int64)
        self.length = np.zeros(1, np.int64)

    def _add(self, words: List[str]) -> None:
        encoded = self._whole(words)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        self.start = np.concatenate((self.start, len(self.table) + np.cumsum(lengths) - lengths))
        self.length = np.concatenate((self.length, lengths))
        self.table = np.concatenate((self.table, np.fromiter(itertools.chain.from_iterable(encoded), np.int32,
                                                              count=int(lengths.sum()))))
        self.index.update(zip(words, range(len(self.index), len(self.index) + len(words))))

    def encode(self, lines: Sequence[str], dtype=np.int64) -> Tuple[np.ndarray, np.ndarray]:
        """(all the lines' ids one after the other, each line's number of ids)."""
        if not self.exact:
            return self._flat(self._whole(lines), dtype)
        safe = [line.isprintable() and unicodedata.is_normalized("NFKC", line) for line in lines]
        easy = [line for line, ok in zip(lines, safe) if ok]
        words = " ".join(easy).split(" ") if easy else []   # line after line; a line of k spaces has k + 1 words
        try:
            widx = np.fromiter(map(self.index.__getitem__, words), dtype=np.int64, count=len(words))
        except KeyError:
            missing = set(words).difference(self.index)
            if len(self.index) + len(missing) > self.LIMIT:
                self._reset()
                missing = set(words).difference(self.index)
            self._add(list(missing))
            widx = np.fromiter(map(self.index.__getitem__, words), dtype=np.int64, count=len(words))
        per_word, first = self.length[widx], self.start[widx]
        ends = np.cumsum(per_word)
        ids = self.table[np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - per_word - first, per_word)]
        ids = ids.astype(dtype)
        n_words = np.fromiter((line.count(" ") + 1 for line in easy), dtype=np.int64, count=len(easy))
        lengths = (np.add.reduceat(per_word, np.cumsum(n_words) - n_words) if len(easy)
                   else np.zeros(0, np.int64))
        if len(easy) < len(lines):   # merge the lines SentencePiece encoded whole, in their places
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            hard = iter(self._whole([line for line, ok in zip(lines, safe) if not ok]))
            k, out = 0, []
            for ok in safe:
                if ok:
                    out.append(ids[offsets[k]:offsets[k + 1]].tolist())
                    k += 1
                else:
                    out.append(next(hard))
            ids, lengths = self._flat(out, dtype)
        check = min(self.CHECKED, len(lines))
        if check and self._whole(lines[:check]) != [ids[a - n:a].tolist() for a, n in
                                                    zip(np.cumsum(lengths[:check]), lengths[:check])]:
            self.exact = False
            return self._flat(self._whole(lines), dtype)
        return ids, lengths

    def _whole(self, lines: Sequence[str]) -> List[List[int]]:
        """SentencePiece's own encoding, a call per line (its list form starts a thread pool on every call)."""
        encode = self.sp.encode
        return [encode(line, out_type=int) for line in lines]

    @staticmethod
    def _flat(encoded: List[List[int]], dtype) -> Tuple[np.ndarray, np.ndarray]:
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        return np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum())), lengths
