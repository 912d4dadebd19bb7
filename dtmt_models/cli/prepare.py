"""`dtmt prepare`: the command line over dtmt_models.data.prepare (see its docstring for what it writes).

    dtmt prepare bible --out DIR
    dtmt prepare files --src F --tgt G --out DIR
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import List, Optional

from dtmt_models.data import bible
from dtmt_models.data import corpus as data
from dtmt_models.data.prepare import prepare_files

SPLITS = ("train", "dev", "test")
_LANG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmt prepare", description="Writes a corpus directory for dtmt train and "
                                "dtmt evaluate: the embedded Bible (Spanish -> English) or your own parallel files.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="run `dtmt prepare bible --help` or `dtmt prepare files --help` for the options")
    sub = p.add_subparsers(dest="source", metavar="{bible,files}", required=True)

    b = sub.add_parser("bible", help="the embedded Bible corpus (Spanish -> English)",
                       description="Writes the embedded corpus (SPEC §5): the Bible, Spanish Reina-Valera 1909 -> "
                                   "English World English Bible, verse-aligned, split by book (test = Nehemiah, Acts; "
                                   "dev = Ruth, Esther, Jonah, Philippians; train = the other books): "
                                   "DIR/{train,dev,test}.{es,en}, DIR/{split}.ref (the verse of each line) and "
                                   "DIR/corpus.json. Needs Debian's sword-text-sparv, sword-text-web and "
                                   "libsword-utils (`bash setup.sh` installs them).")
    b.add_argument("--out", required=True, metavar="DIR", help="output directory (created if needed)")

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
                        "files); default 0: no held-out split")
    f.add_argument("--seed", type=int, default=0, help="seed of the held-out selection (default: 0)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 1

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        if args.source == "bible":
            bible.prepare_bible(args.out, log=log)
        else:
            prepare_files(args, log=log)
    except (data.CorpusError, bible.BibleError, OSError) as exc:
        print(f"dtmt prepare {args.source}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
