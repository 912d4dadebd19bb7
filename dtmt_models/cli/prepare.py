"""`dtmt prepare`: the command line over dtmt_models.data.prepare and dtmt_models.data.binarized (see their
docstrings for what they write).

    dtmt prepare bible --out DIR
    dtmt prepare files --src F --tgt G --out DIR
    dtmt prepare binarize --data DIR --vocab-size 8000
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
from typing import List, Optional

from dtmt_models.atomic import remove_stale_temporaries
from dtmt_models.data import bible, binarized
from dtmt_models.data import corpus as data
from dtmt_models.data.prepare import (SPLITS, check_files_options, check_out_is_a_corpus_or_new, corpus_names,
                                      prepare_files, staged_corpus)
from dtmt_models.errors import (MAX_VOCAB_SIZE, ArgumentParser, UsageError, check_counts, check_input_dir,
                                 check_output_dir, one_line, usable_cpus)
from dtmt_models.models.presets import TRAIN_DEFAULTS
from dtmt_models.run_lock import PREPARE_LOCK_NAME, RunLock, RunLocked
from dtmt_models.signals import give_back, take_signals

# the ranges of the numeric options, checked before any work (contract §6: one line, exit status 2)
MAX_LINES = 1_000_000_000     # --sample and --holdout: more lines than a corpus this reads holds
MAX_SEED = 2 ** 32 - 1        # Python's random takes |seed|: a negative seed would repeat a positive one's draw
CORES = usable_cpus()
MAX_WORKERS = max(16, 4 * CORES)   # more processes than that only cost memory (each holds both vocabularies)


def add_binarize_arguments(p: argparse.ArgumentParser, optional: bool) -> None:
    """The options of the binarized corpus (dtmt_models.data.binarized), shared by the subcommands."""
    g = p.add_argument_group("binarized corpus (what dtmt train reads)")
    g.add_argument("--vocab-size", type=int, default=TRAIN_DEFAULTS["vocab_size"], metavar="N",
                   help=f"SentencePiece pieces per side, 8 to {MAX_VOCAB_SIZE:,} (default: "
                        f"{TRAIN_DEFAULTS['vocab_size']}, the small presets'; dtmt train builds the copy for another "
                        f"size itself when it first needs it)")
    g.add_argument("--vocab-type", choices=("bpe", "unigram"), default="bpe", help="SentencePiece model (default: bpe)")
    g.add_argument("--sample", type=int, default=binarized.DEFAULT_SAMPLE, metavar="N",
                   help=f"training lines per side SentencePiece learns from, drawn at random, 1 to {MAX_LINES:,} "
                        f"(default: {binarized.DEFAULT_SAMPLE:,}; all of them when the corpus has fewer, in order; "
                        f"SentencePiece leaves out lines of more than 4,192 bytes)")
    g.add_argument("--sample-seed", type=int, default=binarized.DEFAULT_SEED, metavar="S",
                   help=f"seed of that draw, 0 to {MAX_SEED} (default: {binarized.DEFAULT_SEED})")
    g.add_argument("--workers", type=int, default=0, metavar="N",
                   help=f"encoding processes, at most {MAX_WORKERS} here (4 per core, or 16 if that is more); "
                        f"default 0: one per core, at most 16")
    if optional:
        g.add_argument("--no-binarize", action="store_true",
                       help="write the text only (dtmt train then binarizes it on its first run)")


def binarize_from_args(args: argparse.Namespace, directory: str, log) -> None:
    if getattr(args, "no_binarize", False):
        return
    binarized.binarize(directory, args.vocab_size, args.vocab_type, sample=args.sample, seed=args.sample_seed,
                       workers=args.workers, log=log)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dtmt prepare", description="Writes a corpus directory for dtmt train and "
                       "dtmt evaluate: the embedded Bible (Spanish -> English) or your own parallel files, "
                       "with the binarized corpus that training reads.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="run `dtmt prepare bible --help`, `dtmt prepare files --help` or `dtmt prepare "
                              "binarize --help` for the options")
    sub = p.add_subparsers(dest="source", metavar="{bible,files,binarize}", required=True)

    b = sub.add_parser("bible", help="the embedded Bible corpus (Spanish -> English)",
                       description="Writes the embedded corpus (contract §5): the Bible, Spanish Reina-Valera 1909 -> "
                                   "English World English Bible, verse-aligned, split by book (test = Nehemiah, Acts; "
                                   "dev = Ruth, Esther, Jonah, Philippians; train = the other books): "
                                   "DIR/{train,dev,test}.{es,en}, DIR/{split}.ref (the verse of each line) and "
                                   "DIR/corpus.json. Needs Debian's sword-text-sparv, sword-text-web and "
                                   "libsword-utils (`bash setup.sh` installs them).")
    b.add_argument("--out", required=True, metavar="DIR", help="output directory (created if needed)")
    add_binarize_arguments(b, optional=True)

    f = sub.add_parser("files", help="validate and copy your own parallel corpus",
                       description="Validates aligned UTF-8 files (one sentence a line, no empty line, the same "
                                   "number of lines on both sides; each problem is reported with file:line) and "
                                   "copies them to DIR/{split}.{lang} with DIR/corpus.json. Dev and test sets come "
                                   "from --dev-*/--test-* files, or are held out of the training files with "
                                   "--holdout N; with neither, the corpus has a train split only (`dtmt train` "
                                   "then runs without validation and early stopping).")
    f.add_argument("--src", required=True, metavar="F", help="training source file")
    f.add_argument("--tgt", required=True, metavar="G", help="training target file")
    f.add_argument("--out", required=True, metavar="DIR", help="output directory (created if needed)")
    f.add_argument("--src-lang", default="es", help="source language code, the files' suffix (default: es)")
    f.add_argument("--tgt-lang", default="en", help="target language code, the files' suffix (default: en)")
    for split in ("dev", "test"):
        f.add_argument(f"--{split}-src", metavar="F", help=f"{split} source file")
        f.add_argument(f"--{split}-tgt", metavar="G", help=f"{split} target file")
    f.add_argument("--holdout", type=int, default=0, metavar="N",
                   help="hold N pairs out of the training files for each of dev and test (those not given as "
                        f"files), at most {MAX_LINES:,}; default 0: no held-out split")
    f.add_argument("--seed", type=int, default=0, metavar="S",
                   help=f"seed of the held-out selection, 0 to {MAX_SEED} (default: 0)")
    add_binarize_arguments(f, optional=True)

    z = sub.add_parser("binarize", help="(re)write the binarized corpus of a prepared directory",
                       description="Trains SentencePiece on a seeded sample of the training text and writes every "
                                   "split's token ids (flat arrays numpy can map) with an index and a manifest, to "
                                   "DIR/bin-<type><size> (what dtmt train reads; see dtmt_models.data.binarized). "
                                   "`dtmt prepare bible` and `files` do this with the default settings; run this "
                                   "for another vocabulary or sample, or after changing the text.")
    z.add_argument("--data", required=True, metavar="DIR", help="a corpus directory written by dtmt prepare")
    add_binarize_arguments(z, optional=False)
    return p


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric option of the subcommand in its range (UsageError naming it, the value and the range)."""
    check_counts(args, (("vocab_size", 8, MAX_VOCAB_SIZE), ("sample", 1, MAX_LINES), ("sample_seed", 0, MAX_SEED),
                        ("workers", 0, MAX_WORKERS, f" ({CORES} cores here)"), ("holdout", 0, MAX_LINES),
                        ("seed", 0, MAX_SEED)))


class Terminated(BaseException):
    """SIGTERM (`timeout`, Slurm, `docker stop`), raised in the main thread as a Ctrl-C is: what prepare made (the
    staged copy, the lock, a folder it created) is removed on the way out. Before, the process died on the spot and
    left them, without a word."""


def _terminate(signum, frame) -> None:
    for child in multiprocessing.active_children():   # (its worker processes, which a pool would wait for)
        child.terminate()
    raise Terminated()


def main(argv: Optional[List[str]] = None) -> int:
    taken = take_signals((signal.SIGTERM,), _terminate)   # (in the main thread; an ignored SIGTERM stays ignored)
    try:
        return _main(argv)
    except Terminated:
        print("dtmt prepare: terminated (SIGTERM)", file=sys.stderr)   # (as Ctrl-C's "interrupted": a corpus put in
        # place whole before the signal was handled says so itself; nothing else of the run stays)
        return 128 + signal.SIGTERM
    finally:
        give_back(taken)


def _main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 1

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    lock, done = None, False   # (the folder written is held until the end: one prepare at a time writes there)
    try:
        check_numbers(args)
        # every option before any work (contract §6), then what an interrupted earlier run left (its process
        # gone), where this one writes
        if args.source == "bible":
            check_output_dir(args.out, "--out")
            check_out_is_a_corpus_or_new(args.out, corpus_names(
                (bible.SRC_LANG, bible.TGT_LANG), [f"{split}.ref" for split in SPLITS] + (
                    [] if args.no_binarize else [os.path.basename(binarized.binarized_path(
                        args.out, args.vocab_type, args.vocab_size))])))
        elif args.source == "files":
            written = [] if args.no_binarize else [binarized.binarized_path(args.out, args.vocab_type,
                                                                            args.vocab_size)]
            checked = check_files_options(args, written)
        else:
            check_input_dir(args.data, "--data", "corpus folder")
            if not os.path.isfile(os.path.join(args.data, data.MANIFEST)):
                raise UsageError(f"--data {args.data}: not a corpus folder written by dtmt prepare (no "
                                 f"{data.MANIFEST})")
        if not getattr(args, "no_binarize", False):   # (the binarized copy it replaces holds only its own files)
            try:
                binarized.check_only_ours(binarized.binarized_path(
                    args.data if args.source == "binarize" else args.out, args.vocab_type, args.vocab_size))
            except data.CorpusError as exc:
                raise UsageError(str(exc)) from None
        option = "--data" if args.source == "binarize" else "--out"
        lock = RunLock(getattr(args, option[2:]), option, "dtmt prepare", PREPARE_LOCK_NAME).acquire()
        for folder in {getattr(args, "out", None), getattr(args, "data", None)} - {None}:
            # (prepare writes its files in a stage folder, moved in whole: no atomic write's file is its own here)
            for path in remove_stale_temporaries(folder, folders_only=True):
                log(f"removed {path} (left by an interrupted run)")
        if args.source == "bible":   # (the text and its binarized copy as a whole, or nothing: staged_corpus)
            with staged_corpus(args.out, (), log) as (stage, say):
                bible.prepare_bible(stage, log=say)
                binarize_from_args(args, stage, say)
        elif args.source == "files":
            inputs = [p for p in (args.src, args.tgt, args.dev_src, args.dev_tgt, args.test_src, args.test_tgt) if p]
            with staged_corpus(args.out, inputs, log) as (stage, say):
                prepare_files(args, stage, log=say, written_dirs=written, checked=checked)
                binarize_from_args(args, stage, say)
        else:
            binarize_from_args(args, args.data, log)
        done = True
    except (UsageError, RunLocked) as exc:   # an option that cannot work: nothing was read or written
        print(f"dtmt prepare {args.source}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except (data.CorpusError, bible.BibleError) as exc:
        print(f"dtmt prepare {args.source}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:   # (numpy's writes name no file: the folder being written, then)
        where = exc.filename or (f"writing {args.data if args.source == 'binarize' else args.out}" if exc.errno
                                 else "")
        print(f"dtmt prepare {args.source}: error: {exc.strerror or exc}{f' ({where})' if where else ''}",
              file=sys.stderr)
        return 1
    finally:
        if lock is not None:   # (a folder that the lock made and nothing else filled goes with a failed prepare)
            lock.release(discard=not done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
