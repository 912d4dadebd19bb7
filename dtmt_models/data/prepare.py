"""`dtmt prepare`: writes a corpus directory for `dtmt train` / `dtmt evaluate` (SPEC §5, §6).

    dtmt prepare bible --out DIR
        the embedded Bible, Spanish (Reina-Valera 1909) -> English (World English Bible), from Debian's SWORD
        modules: DIR/{train,dev,test}.{es,en}, DIR/{split}.ref, DIR/corpus.json (see dtmt_models.data.bible)
    dtmt prepare files --src F --tgt G --out DIR [--src-lang es --tgt-lang en]
                       [--dev-src F --dev-tgt G] [--test-src F --test-tgt G] [--holdout N --seed S]
        validates your aligned files (UTF-8, no empty line, same line counts; every problem is reported with
        file:line) and copies them to DIR/{split}.{lang} with the manifest

A prepared directory holds a split per pair of files `{split}.{src_lang}` / `{split}.{tgt_lang}` and the manifest
corpus.json (dtmt_models.data.corpus). Over-long pairs are not removed here: training filters them after subword
segmentation and reports how many.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from dtmt_models.data import bible
from dtmt_models.data import corpus as data

SPLITS = ("train", "dev", "test")
_LANG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def holdout_split(pairs: Sequence[Tuple[str, str]], n: int, splits: Sequence[str], seed: int
                  ) -> Dict[str, List[Tuple[str, str]]]:
    """Moves n pairs per split in `splits` out of `pairs`, chosen at random with `seed` (deterministic); every
    part keeps the original order. Returns {"train": rest, split: held-out pairs, ...}."""
    need = n * len(splits)
    if n < 0:
        raise data.CorpusError(f"--holdout must be >= 0, not {n}")
    if need >= len(pairs):
        raise data.CorpusError(f"--holdout {n} asks for {need} held-out pairs but the training files have only "
                               f"{len(pairs)} (at least one must stay for training)")
    chosen = random.Random(seed).sample(range(len(pairs)), need)
    out: Dict[str, List[Tuple[str, str]]] = {}
    taken = set()
    for i, split in enumerate(splits):
        picked = sorted(chosen[i * n:(i + 1) * n])
        out[split] = [pairs[j] for j in picked]
        taken.update(picked)
    out["train"] = [p for j, p in enumerate(pairs) if j not in taken]
    return out


def prepare_files(args: argparse.Namespace, log=print) -> Dict[str, int]:
    """Validates and copies a user corpus (the `files` subcommand); raises data.CorpusError on bad input."""
    for lang in (args.src_lang, args.tgt_lang):
        if not _LANG_RE.fullmatch(lang) or lang in ("ref", "json", "tmp"):
            raise data.CorpusError(f"bad language code {lang!r}: use letters, digits, '-' or '_' (e.g. es, en)")
    if args.src_lang == args.tgt_lang:
        raise data.CorpusError(f"--src-lang and --tgt-lang are both {args.src_lang!r}; they name the files, so they "
                               f"must differ")
    files = {"train": (args.src, args.tgt)}
    for split in ("dev", "test"):
        src, tgt = getattr(args, f"{split}_src"), getattr(args, f"{split}_tgt")
        if (src is None) != (tgt is None):
            raise data.CorpusError(f"--{split}-src and --{split}-tgt go together (only one was given)")
        if src is not None:
            files[split] = (src, tgt)
    held = [split for split in ("dev", "test") if split not in files]
    if args.holdout and not held:
        raise data.CorpusError("--holdout: dev and test files are both given, there is nothing to hold out")

    corpus = {}
    for split, (src, tgt) in files.items():
        corpus[split] = data.read_parallel(src, tgt)
        log(f"{split}: {src} + {tgt}: {len(corpus[split]):,} pairs, valid")
    if args.holdout:
        corpus.update(holdout_split(corpus["train"], args.holdout, held, args.seed))
        log(f"held out {args.holdout:,} pairs each for {' and '.join(held)} (seed {args.seed})")

    os.makedirs(args.out, exist_ok=True)
    langs = (args.src_lang, args.tgt_lang)
    inputs = {os.path.realpath(p) for pair in files.values() for p in pair}
    for split in SPLITS:
        paths = [os.path.join(args.out, f"{split}.{lang}") for lang in langs]
        if split in corpus:
            data.write_parallel(corpus[split], *paths)
        else:  # a split of an earlier corpus in the same directory would otherwise be read as this one's
            for path in paths:
                if not os.path.exists(path):
                    continue
                if os.path.realpath(path) in inputs:
                    log(f"warning: {path} is one of your input files, so it stays, but dtmt train and evaluate "
                        f"will read it as the {split} split of {args.out}; better use another --out")
                else:
                    os.remove(path)
                    log(f"removed {path} (left from an earlier corpus; this one has no {split} split)")
    counts = {split: len(corpus[split]) for split in SPLITS if split in corpus}
    sources = {split: [os.path.abspath(p) for p in files[split]] for split in files}
    data.write_manifest(args.out, args.src_lang, args.tgt_lang, counts, origin="files", sources=sources,
                        holdout=args.holdout, seed=args.seed if args.holdout else None)
    log(f"wrote {args.out}: " + ", ".join(f"{split} {n:,}" for split, n in counts.items()) + " pairs")
    return counts
