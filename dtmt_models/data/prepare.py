"""`dtmt prepare`: writes a corpus directory for `dtmt train` / `dtmt evaluate` (contract §5, §6).

    dtmt prepare bible --out DIR
        the embedded Bible, Spanish (Reina-Valera 1909) -> English (World English Bible), from Debian's SWORD
        modules: DIR/{train,dev,test}.{es,en}, DIR/{split}.ref, DIR/corpus.json (see dtmt_models.data.bible)
    dtmt prepare files --src F --tgt G --out DIR [--src-lang es --tgt-lang en]
                       [--dev-src F --dev-tgt G] [--test-src F --test-tgt G] [--holdout N --seed S]
        validates your aligned files (UTF-8, no empty line, same line counts; every problem is reported with
        file:line) and copies them to DIR/{split}.{lang} with the manifest

A prepared directory holds a split per pair of files `{split}.{src_lang}` / `{split}.{tgt_lang}` and the manifest
corpus.json (dtmt_models.data.corpus); the command line then adds the binarized corpus DIR/bin-<type><size>
(dtmt_models.data.binarized, `dtmt prepare binarize`). Over-long pairs are not removed here: training filters them after subword
segmentation and reports how many.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import threading
from typing import Dict, List, Optional, Sequence

from dtmt_models.atomic import atomic_write, temporary_pid
from dtmt_models.data import corpus as data
from dtmt_models.errors import UsageError, check_input_file, check_output_dir, check_output_file, refuse
from dtmt_models.progress import Ticker

SPLITS = ("train", "dev", "test")


def holdout_indices(n: int, holdout: int, splits: Sequence[str], seed: int) -> Dict[int, str]:
    """Which of n training pairs (0-based) move to which split: `holdout` pairs per split in `splits`, chosen at
    random with `seed` (deterministic). CorpusError when at least one pair would not stay for training."""
    need = holdout * len(splits)
    if holdout < 0:
        raise data.CorpusError(f"--holdout {holdout}: must be an integer >= 0")
    if need >= n:
        raise data.CorpusError(f"--holdout {holdout} asks for {need} held-out pairs but the training files have only "
                               f"{n} (at least one must stay for training)")
    chosen = random.Random(seed).sample(range(n), need)
    return {j: split for i, split in enumerate(splits) for j in chosen[i * holdout:(i + 1) * holdout]}


def prepare_files(args: argparse.Namespace, into: str, log=print, written_dirs: Sequence[str] = (),
                  checked: Optional[tuple] = None) -> Dict[str, int]:
    """Validates and copies a user corpus (the `files` subcommand) into the folder `into` (new or empty: the
    command line's staged_corpus folder, which becomes --out's corpus once everything has worked), streaming: memory
    does not grow with the files. Raises UsageError for options that cannot work (checked first: nothing is read or
    written) and data.CorpusError for bad input. `written_dirs`: folders the caller replaces afterwards (the
    binarized copy); an input inside one is refused like an input that is one of the files written. `checked`:
    check_files_options's answer where the caller made those checks (the command line, before it cleared what an
    interrupted run left in --out, which they read)."""
    files, held = checked if checked is not None else check_files_options(args, written_dirs)
    for warning in _inputs_given_twice(files):
        log(warning)
    return _write_files(args, files, held, log, into)


def _inputs_given_twice(files: Dict[str, tuple]) -> List[str]:
    """Warnings for one file given twice (taken without a word): a split's source and target (it translates a text
    into itself), a dev or test file that is the training file (its scores then say nothing of new text), or a test
    file that is the dev file."""
    def option(split, side):
        return f"--{side}" if split == "train" else f"--{split}-{side}"
    out = []
    for split, (src, tgt) in files.items():
        if os.path.samefile(src, tgt):
            out.append(f"warning: {option(split, 'src')} and {option(split, 'tgt')} are one file ({src}): the "
                       f"{split} split translates a text into itself")
    for split in ("dev", "test"):
        for i, side in enumerate(("src", "tgt")):
            if split in files and os.path.samefile(files[split][i], files["train"][i]):
                out.append(f"warning: {option(split, side)} is {option('train', side)} ({files[split][i]}): the "
                           f"{split} split is training text, whose scores say nothing of new text")
    for i, side in enumerate(("src", "tgt")):
        if "dev" in files and "test" in files and os.path.samefile(files["dev"][i], files["test"][i]):
            out.append(f"warning: {option('test', side)} is {option('dev', side)} ({files['test'][i]}): the test "
                       f"split is the text the best checkpoint was chosen on, whose scores flatter it")
    return out


def check_files_options(args: argparse.Namespace, written_dirs: Sequence[str] = ()):
    """The checks of prepare_files, before any work: UsageError for an option that cannot work, including an
    input that the corpus written to --out would overwrite or remove (contract §6: no input is ever overwritten).
    Returns ({split: (src, tgt)} of the files given, [the splits held out of the training files])."""
    for option in ("src_lang", "tgt_lang"):
        lang = getattr(args, option)
        if not data.plain_name(lang):
            raise UsageError(f"--{option.replace('_', '-')} {lang!r}: not a language code; use letters, digits, '-' "
                             f"or '_' (e.g. es, en)")
        if lang in ("ref", "json", "tmp"):   # (train.ref: the embedded corpus's verse references)
            raise UsageError(f"--{option.replace('_', '-')} {lang!r}: a suffix dtmt prepare keeps for its own files; "
                             f"give another code")
    if args.src_lang == args.tgt_lang:
        raise UsageError(f"--src-lang and --tgt-lang are both {args.src_lang!r}; they name the files, so they "
                         f"must differ")
    if args.src_lang.lower() == args.tgt_lang.lower():
        raise UsageError(f"--src-lang {args.src_lang} and --tgt-lang {args.tgt_lang} differ only in case: "
                         f"train.{args.src_lang} and train.{args.tgt_lang} are one file on macOS and Windows; give "
                         f"codes that differ in letters")
    files = {"train": (args.src, args.tgt)}
    for split in ("dev", "test"):
        src, tgt = getattr(args, f"{split}_src"), getattr(args, f"{split}_tgt")
        if (src is None) != (tgt is None):
            raise UsageError(f"--{split}-src and --{split}-tgt go together (only one was given)")
        if src is not None:
            files[split] = (src, tgt)
    for split, pair in files.items():
        for side, path in zip(("src", "tgt"), pair):
            option = f"--{side}" if split == "train" else f"--{split}-{side}"
            check_input_file(path, option)
            if not os.path.isfile(path):   # (each input is read twice: its lines counted, then copied)
                raise UsageError(f"{option} {path}: not a regular file (a pipe or a device); prepare reads each "
                                 f"input twice, to count its lines and then to copy them: write it to a file first")
    check_output_dir(args.out, "--out")
    held = [split for split in ("dev", "test") if split not in files]
    if args.holdout < 0:
        raise refuse("--holdout", args.holdout, "an integer >= 0")
    if args.holdout and not held:
        raise UsageError("--holdout: dev and test files are both given, there is nothing to hold out")
    splits = list(files) + (held if args.holdout else [])
    _check_inputs_survive(args, files, splits, written_dirs)
    check_out_is_a_corpus_or_new(args.out, corpus_names((args.src_lang, args.tgt_lang),
                                                        [os.path.basename(d) for d in written_dirs]),
                                 [p for pair in files.values() for p in pair], splits)
    return files, held


def check_out_is_a_corpus_or_new(out: str, names: Sequence[str], inputs: Sequence[str] = (),
                                 splits: Sequence[str] = SPLITS) -> None:
    """UsageError when the folder --out holds any of `names` (what prepare writes, replaces or removes there; not
    `inputs`, the files given to read, which it never touches) that no manifest of a prepared corpus accounts for:
    those are someone's own files, not an earlier corpus's, and prepare never overwrites or removes them (a folder
    that held e.g. the user's own train.es and test.es lost both, exit 0; so did one holding a corpus of other
    languages or splits beside them, or a stage left by a killed run). An earlier corpus's files are those its
    manifest names, or those a stage's names (a run killed while it moved its corpus into place: the manifest
    there not yet moved); the next run replaces them. Beside a corpus, only the files of the `splits` this run
    writes are in its way (it removes only what a manifest names); other names (the binarized copies' folders) are
    checked where they are written."""
    if not os.path.isdir(out):
        return
    kept = {os.path.realpath(p) for p in inputs}
    present = [name for name in names if os.path.lexists(os.path.join(out, name))
               and os.path.realpath(os.path.join(out, name)) not in kept]
    if not present:
        return
    owned, manifests = set(), 0
    for folder in [out] + [os.path.join(out, n) for n in os.listdir(out) if data.PREPARE_STAGE.fullmatch(n)]:
        with contextlib.suppress(data.CorpusError, KeyError, TypeError):
            owned |= _manifest_names(data.read_manifest(folder))
            manifests += 1
    foreign = [name for name in present if name not in owned and (not manifests or name.split(".")[0] in splits)]
    if not foreign:
        return
    listed = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
    them = "it" if len(foreign) == 1 else "them"
    what = (f"but is not a corpus of dtmt prepare (no readable {data.MANIFEST})" if not manifests else
            f"beside a corpus of dtmt prepare, whose {data.MANIFEST} does not name {them}")
    raise UsageError(f"--out {out}: holds {listed} {what}; prepare would overwrite or remove {them}: use a new or "
                     f"empty folder")


def _manifest_names(manifest: dict) -> set:
    """The names of a prepared corpus's files its manifest accounts for: every split's text of both languages,
    the references (the Bible's), the manifest."""
    langs = (manifest["src_lang"], manifest["tgt_lang"])
    names = {data.MANIFEST} | {f"{split}.{lang}" for split in manifest["counts"] for lang in langs}
    references = manifest.get("references")
    if isinstance(references, dict):
        names |= {name for name in references.values() if isinstance(name, str)}
    return names


def corpus_names(langs: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
    """The names prepare writes or removes in --out for languages `langs`: every split's files, the manifest and
    `extra` (the binarized copy's folder, the Bible's references)."""
    return [f"{split}.{lang}" for split in SPLITS for lang in langs] + [data.MANIFEST, *extra]


def _check_inputs_survive(args: argparse.Namespace, files: Dict[str, tuple], splits: Sequence[str],
                          written_dirs: Sequence[str]) -> None:
    """UsageError naming the option when an input is a file this corpus writes into --out (DIR/{split}.{lang} of
    the splits written, the manifest; the same file through a symlink or a hard link too), lies in a folder that
    is replaced (the binarized copy), or is named like a temporary file an interrupted run left there (removed
    before writing)."""
    outputs = [(os.path.join(args.out, f"{split}.{lang}"), f"the {split} split's {side} file")
               for split in splits for side, lang in (("source", args.src_lang), ("target", args.tgt_lang))]
    outputs.append((os.path.join(args.out, data.MANIFEST), "the corpus manifest"))
    for path, what in outputs:
        check_output_file(path, "--out", what=what)   # a folder in the way of a file written
    out_real = os.path.realpath(args.out)
    replaced = [os.path.realpath(d) for d in written_dirs]
    for split, pair in files.items():
        for side, source in zip(("src", "tgt"), pair):
            option = f"--{side}" if split == "train" else f"--{split}-{side}"
            clash = None
            for path, what in outputs:
                if os.path.exists(path) and os.path.exists(source) and os.path.samefile(source, path):
                    clash = f"it is {path}, {what} that prepare writes"
            real = os.path.realpath(source)
            for folder in replaced:
                if real.startswith(folder + os.sep):
                    clash = f"it lies in {folder}, the binarized corpus that prepare replaces"
            if os.path.dirname(real) == out_real and temporary_pid(os.path.basename(real)) is not None:
                clash = "it is named like a temporary file that an interrupted run left there, which prepare removes"
            if clash:
                raise UsageError(f"{option} {source}: an input that --out {args.out} would overwrite ({clash}); "
                                 f"use another --out")


def _write_files(args: argparse.Namespace, files: Dict[str, tuple], held: Sequence[str], log,
                 into: str) -> Dict[str, int]:
    where: Dict[int, str] = {}
    if args.holdout:
        n = data.scan_file(args.src)
        where = holdout_indices(n, args.holdout, held, args.seed)
    outputs = list(files) + (list(held) if args.holdout else [])

    langs = (args.src_lang, args.tgt_lang)
    counts = {split: 0 for split in SPLITS if split in outputs}
    with contextlib.ExitStack() as stack:   # every output is a temporary file until all inputs have been read
        writers = {split: [stack.enter_context(atomic_write(os.path.join(into, f"{split}.{lang}")))
                           for lang in langs] for split in counts}
        # the dev and test files first (small: a problem there had been found after the whole training text was
        # copied), their errors naming their options
        for split, (src, tgt) in sorted(files.items(), key=lambda item: item[0] == "train"):
            before = dict(counts)
            returns = 0   # pairs with a carriage return inside a line (old Mac line ends make a file one line)
            ticker = Ticker(log, f"{split}: copying", unit="pairs copied")
            try:
                for j, (s, t) in enumerate(data.iter_parallel(src, tgt)):
                    dest = where.get(j, "train") if split == "train" else split
                    writers[dest][0].write(s + "\n")
                    writers[dest][1].write(t + "\n")
                    counts[dest] += 1
                    returns += "\r" in s or "\r" in t
                    if not (j + 1) & 0xFFFF:
                        ticker.tick(j + 1)
            except data.CorpusError as exc:
                if split == "train":
                    raise
                raise data.CorpusError(f"--{split}-src / --{split}-tgt: {exc}") from None
            pairs = sum(counts.values()) - sum(before.values())
            mac = [path for path in (src, tgt) if returns and pairs == 1 and _old_mac(path)]
            if mac:   # (a file of \r line ends is one line: two such files, of any counts of \r lines, were one
                # pair, "valid", exit 0)
                raise data.CorpusError(f"{mac[0]}: one line holding carriage returns (\\r) and no line feed: a file "
                                       f"of old Mac line ends, which prepare splits at \\n only; convert them first "
                                       f"(tr '\\r' '\\n')")
            log(f"{split}: {src} + {tgt}: {pairs:,} pairs, valid")
            if returns:   # (taken without a word: a file of \r line ends was one pair)
                log(f"warning: {split}: {returns:,} pairs hold a carriage return (\\r) inside a line, read as a "
                    f"space; a file with old Mac line ends (\\r alone) is one line to prepare: convert them to \\n "
                    f"first (tr '\\r' '\\n')")
    if args.holdout:
        log(f"held out {args.holdout:,} pairs each for {' and '.join(held)} (seed {args.seed})")
    # (a path's bytes that are not UTF-8, as \xff: the manifest is UTF-8 JSON; its write was a traceback)
    sources = {split: [os.path.abspath(p).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                       for p in files[split]] for split in files}
    data.write_manifest(into, args.src_lang, args.tgt_lang, counts, origin="files", sources=sources,
                        holdout=args.holdout, seed=args.seed if args.holdout else None)
    return counts


_STAGE = ".prepare.tmp-{pid}"   # (data.PREPARE_STAGE; a name remove_stale_temporaries takes once its process is gone)


@contextlib.contextmanager
def staged_corpus(out: str, inputs: Sequence[str], log):
    """A corpus written as a whole or not at all: yields (stage, say), a new folder inside `out` to write the corpus
    and its binarized copy into, and `log` with the stage's path shown as `out`'s. When the block ends without an
    error, the stage's files and folders replace their namesakes in `out` (the manifest last, after the old one is
    removed first: a kill between two renames leaves a folder that train and binarize refuse, not mixed text), and
    the splits of an earlier corpus there that the new one lacks are removed, except `inputs` (files given to read).
    When it fails (bad text, a vocabulary SentencePiece cannot build, Ctrl-C), `out` is as it was: an earlier
    corpus there stays whole (one was replaced by text the failed run had written, exit 1), and a folder made for
    this one goes. An error's message names `out`, not the stage."""
    made = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    stage = os.path.join(out, _STAGE.format(pid=os.getpid()))
    shown = out.rstrip(os.sep) or out   # (--out c1/: c1/bin-bpe40, not c1//bin-bpe40)
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)

    def say(message: str) -> None:
        log(message.replace(stage, shown))

    try:
        try:
            yield stage, say
        except data.CorpusError as exc:
            raise data.CorpusError(str(exc).replace(stage, shown)) from None
        except OSError as exc:   # (a full disk, a folder that cannot be written: named as --out's)
            if isinstance(exc.filename, str):   # (only then: an OSError given a filename of None, even None, says
                exc.filename = exc.filename.replace(stage, shown)   # "[Errno None] None: None" of itself)
            exc.args = tuple(a.replace(stage, shown) if isinstance(a, str) else a for a in exc.args)
            raise
        _commit(stage, out, {os.path.realpath(p) for p in inputs}, say)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made:   # (a failure: nothing of this corpus may stay, the folder made for it goes if nothing else is in it)
            with contextlib.suppress(OSError):
                os.rmdir(out)


def _old_mac(path: str) -> bool:
    """Whether the file (of one line) holds a carriage return and no line feed: old Mac line ends. A one-line file
    ended by \\n whose line holds a \\r is text with a \\r in it (said in a warning, read as a space)."""
    with open(path, "rb") as f:
        head = f.read(data.MAX_LINE_BYTES + 2)
    return b"\r" in head and b"\n" not in head


def _commit(stage: str, out: str, inputs: set, log) -> None:
    """staged_corpus's end: the stage's corpus into `out` (see there). It runs with SIGINT and SIGTERM held back (a
    Ctrl-C then ends the command after it, not between two renames); an earlier binarized copy moved aside is
    removed after the manifest is in place. Removed: the files of the earlier corpus's splits (its manifest's
    languages and splits) and its verse references (its manifest's `references`, files of `out`) that the new one
    does not write, never an input."""
    manifest = data.read_manifest(stage)
    counts = manifest["counts"]
    written = set(os.listdir(stage))
    stale = []
    with contextlib.suppress(data.CorpusError):
        old = data.read_manifest(out)
        stale = [(name, f"this one has no {split} split" if split not in counts else
                  "this one is of other languages") for split in old["counts"]
                 for lang in (old["src_lang"], old["tgt_lang"]) for name in [f"{split}.{lang}"] if name not in written]
        references = old.get("references")   # (the Bible's verse references, {split}.ref: they had stayed beside
        if isinstance(references, dict):     # another corpus's splits, without a word)
            stale += [(name, "this one has no verse references") for name in references.values()
                      if isinstance(name, str) and name == os.path.basename(name) and name not in written
                      and name not in (".", "..")]
    # SIGINT and SIGTERM held back by handlers that note them, given back after (Python runs handlers in the main
    # thread whichever thread the signal reaches; a pthread_sigmask of this thread let one reach another: the
    # interrupt came between the renames)
    received: List[int] = []
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    asides, done = [], False
    try:   # (all of it held back: a Ctrl-C between the renames and the removals left the earlier corpus's split
        # files beside the new one, and said "interrupted" of a corpus replaced)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, data.MANIFEST))
        for name in sorted(written, key=lambda n: n == data.MANIFEST):   # (the manifest last)
            source, target = os.path.join(stage, name), os.path.join(out, name)
            if os.path.isdir(source) and os.path.isdir(target):   # an earlier binarized copy: aside, removed after
                aside = os.path.join(out, f".{name}.tmp-{os.getpid()}")
                os.rename(target, aside)
                asides.append(aside)
                os.rename(source, target)
            else:
                os.replace(source, target)
        for aside in asides:   # (a link to a folder elsewhere: the link goes, what it points to stays)
            if os.path.islink(aside):
                os.remove(aside)
            else:
                shutil.rmtree(aside, ignore_errors=True)
        for name, why in stale:   # a split of the earlier corpus would otherwise be read as this one's
            path = os.path.join(out, name)
            if not os.path.isfile(path):
                continue
            if os.path.realpath(path) in inputs:
                log(f"note: {path} is one of your input files, so it stays ({why}: dtmt train and evaluate do not "
                    f"read it)")
            else:
                os.remove(path)
                log(f"removed {path} (left from an earlier corpus; {why})")
        log(f"wrote {out.rstrip(os.sep) or out}: " + ", ".join(f"{split} {n:,}" for split, n in counts.items())
            + " pairs")
        done = True
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if received:   # (handled now as it would have been: KeyboardInterrupt for a Ctrl-C)
            if done:
                log(f"note: the interrupt came as {out.rstrip(os.sep) or out} was put in place: it is written whole")
            signal.raise_signal(received[0])
