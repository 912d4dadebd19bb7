"""Scoring translations: corpus BLEU and chrF with sacrebleu, BLEU by source length, and `dtmt evaluate`.

    corpus_scores(hyps, refs)                       -> {"bleu", "chrf", signatures, BLEU details}
    bleu_by_length(sources, hyps, refs, bounds)     -> [LengthBucket(label, sentences, bleu), ...]
    plot_bleu_by_length(rows, path, title)          -> the PNG's path (None without matplotlib)
    dtmt evaluate --checkpoint C --data DIR [--split test] [--out-dir D]
    dtmt evaluate --checkpoint C --src F --ref G
    dtmt evaluate --hyp H (--data DIR [--split S] | --src F --ref G)      scores existing translations

Scores are sacrebleu's defaults on detokenised text (BLEU: 13a tokenisation, mixed case, exponential
smoothing; chrF: character 6-grams, beta 2), one reference, and come with sacrebleu's signature strings so
a number can be reproduced. BLEU by length follows the papers' length figures: the test sentences are
grouped by source length in whitespace words ("1-10", "11-20", ..., "51+"; a sentence of 0 words counts in
the first bucket) and each group gets its own corpus BLEU; an empty group is reported with 0 sentences and
BLEU None (it is left out of the plot).

The command line writes to its output directory (default: next to the checkpoint, `<checkpoint stem>.<split>/`;
with --hyp and no checkpoint, next to the hypothesis file, `<hyp stem>.<split>/`; the "split" of --src/--ref
is the source file's name without its extension): `hyp.txt` (not in --hyp mode, which scores the given file
in place), `scores.json` (scores, signatures, buckets, settings, decoding time and speed),
`bleu_by_length.csv` and `bleu_by_length.png`, and prints a short table on stdout. Errors a user can cause are
one line on stderr and exit status 1, as in `dtmt translate`.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import warnings
from typing import List, NamedTuple, Optional, Sequence

from .atomic import WriteError, atomic_path
from .data import CorpusError, corpus_paths, read_lines, read_parallel
from .errors import one_line
from .translate import (InputError, OnceAction, add_decoding_arguments, check_decoding_arguments,
                        check_device_and_backend, decode_with_report, decoding_kwargs, load_for_decoding,
                        write_atomic)

PROG = "dtmt evaluate"
DEFAULT_BOUNDS = (10, 20, 30, 40, 50)


# ------------------------------------------------------------------------------------------- scores
def _check_aligned(hyps: Sequence[str], refs: Sequence[str], what: str) -> None:
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError(f"{what}: pass lists of sentences, not single strings")
    if len(hyps) != len(refs):
        raise ValueError(f"{what}: {len(hyps)} hypotheses but {len(refs)} references")


def corpus_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict:
    """Corpus BLEU and chrF (sacrebleu defaults, detokenised text, one reference per sentence):
    {"bleu", "chrf", "bleu_signature", "chrf_signature", "sentences", "bleu_detail": {precisions, bp, ratio,
    hyp_len, ref_len}}. Raises ValueError for an empty corpus or unequal lengths."""
    from sacrebleu.metrics import BLEU, CHRF

    _check_aligned(hyps, refs, "corpus_scores")
    if not hyps:
        raise ValueError("corpus_scores: no sentences to score")
    hyps, refs = list(hyps), list(refs)
    bleu_metric, chrf_metric = BLEU(), CHRF()
    bleu = bleu_metric.corpus_score(hyps, [refs])
    chrf = chrf_metric.corpus_score(hyps, [refs])
    return {
        "bleu": float(bleu.score),
        "chrf": float(chrf.score),
        "bleu_signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
        "sentences": len(hyps),
        "bleu_detail": {"precisions": [float(p) for p in bleu.precisions], "bp": float(bleu.bp),
                        "ratio": float(bleu.ratio), "hyp_len": int(bleu.sys_len), "ref_len": int(bleu.ref_len)},
    }


class LengthBucket(NamedTuple):
    label: str              # "1-10", "11-20", ..., "51+"
    sentences: int
    bleu: Optional[float]   # None for an empty bucket


def bucket_labels(bounds: Sequence[int] = DEFAULT_BOUNDS) -> List[str]:
    """["1-10", "11-20", ..., "51+"] for bounds (10, 20, 30, 40, 50)."""
    labels, low = [], 1
    for high in bounds:
        labels.append(f"{low}-{high}" if high > low else f"{high}")
        low = high + 1
    return labels + [f"{low}+"]


def bucket_index(length: int, bounds: Sequence[int]) -> int:
    """The bucket of a sentence of `length` words: the first bound it does not exceed, else the last bucket."""
    for i, high in enumerate(bounds):
        if length <= high:
            return i
    return len(bounds)


def bleu_by_length(sources: Sequence[str], hyps: Sequence[str], refs: Sequence[str],
                   bounds: Sequence[int] = DEFAULT_BOUNDS, src_tokens: Optional[Sequence[int]] = None
                   ) -> List[LengthBucket]:
    """Corpus BLEU of the sentences grouped by source length: one LengthBucket per bucket, in order.
    Lengths are whitespace words of `sources`, or `src_tokens` (one length per sentence) when given."""
    from sacrebleu.metrics import BLEU

    bounds = [int(b) for b in bounds]
    if not bounds or bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must be increasing positive integers, got {list(bounds)}")
    _check_aligned(hyps, refs, "bleu_by_length")
    lengths = [len(s.split()) for s in sources] if src_tokens is None else [int(n) for n in src_tokens]
    if len(lengths) != len(hyps):
        raise ValueError(f"bleu_by_length: {len(lengths)} source lengths but {len(hyps)} hypotheses")
    groups: List[List[int]] = [[] for _ in range(len(bounds) + 1)]
    for i, n in enumerate(lengths):
        groups[bucket_index(n, bounds)].append(i)
    rows = []
    for label, members in zip(bucket_labels(bounds), groups):
        score = None
        if members:
            score = float(BLEU().corpus_score([hyps[i] for i in members], [[refs[i] for i in members]]).score)
        rows.append(LengthBucket(label, len(members), score))
    return rows


def plot_bleu_by_length(rows: Sequence[LengthBucket], path: str, title: str) -> Optional[str]:
    """A bar chart of BLEU per length bucket (sentence counts on the bars) written to the PNG `path`
    atomically. Returns the path, or None with a warning when matplotlib is not installed. Uses the Agg
    canvas directly, so it neither needs a display nor changes pyplot's global backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed: the BLEU-by-length plot is skipped", RuntimeWarning,
                      stacklevel=2)
        return None
    rows = [LengthBucket(*r) for r in rows]
    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(rows)))
    heights = [r.bleu if r.bleu is not None else 0.0 for r in rows]
    bars = ax.bar(xs, heights, color="tab:blue", width=0.7)
    top = max(heights + [1.0])
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01 * top, f"n={r.sentences}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels([r.label for r in rows])
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("source sentence length (words)")
    ax.set_ylabel("BLEU")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path


def rows_to_csv(rows: Sequence[LengthBucket]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["bucket", "sentences", "bleu"])
    for r in rows:
        writer.writerow([r.label, r.sentences, "" if r.bleu is None else f"{r.bleu:.2f}"])
    return buf.getvalue()


def format_table(scores: dict, rows: Sequence[LengthBucket]) -> str:
    lines = [f"BLEU {scores['bleu']:.2f}   chrF {scores['chrf']:.2f}   ({scores['sentences']:,} sentences)",
             f"  BLEU: {scores['bleu_signature']}", f"  chrF: {scores['chrf_signature']}", "",
             f"{'length':>8s} {'sentences':>10s} {'BLEU':>7s}"]
    for r in rows:
        lines.append(f"{r.label:>8s} {r.sentences:>10,d} {'-' if r.bleu is None else format(r.bleu, '.2f'):>7s}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Translate a test set with a checkpoint (or take existing translations with "
                               "--hyp) and score it: BLEU, chrF and BLEU by source length.")
    p.add_argument("--checkpoint", "-c", action=OnceAction, help="a checkpoint written by `dtmt train` (not needed with --hyp)")
    p.add_argument("--data", help="a corpus directory written by `dtmt prepare`")
    p.add_argument("--split", default="test", help="the split of --data to score (default test)")
    p.add_argument("--src", help="source file (with --ref, instead of --data)")
    p.add_argument("--ref", help="reference file, aligned with --src")
    p.add_argument("--hyp", help="score this translation file instead of decoding")
    p.add_argument("--out-dir", help="where the results go (default: next to the checkpoint, <stem>.<split>/)")
    p.add_argument("--bounds", default=",".join(map(str, DEFAULT_BOUNDS)),
                   help="upper bounds of the length buckets, in words (default 10,20,30,40,50)")
    add_decoding_arguments(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (InputError, CorpusError) as exc:
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _parse_bounds(text: str) -> List[int]:
    try:
        bounds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--bounds: expected comma-separated integers, got {text!r}") from None
    if not bounds or bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise InputError(f"--bounds: expected increasing positive integers, got {text!r}")
    return bounds


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]


def _run(args: argparse.Namespace) -> int:
    check_decoding_arguments(args)
    bounds = _parse_bounds(args.bounds)
    if args.data and (args.src or args.ref):
        raise InputError("give either --data (with --split) or --src and --ref, not both")
    if args.data:
        src_path, ref_path = corpus_paths(args.data, args.split)
        label = args.split
    elif args.src and args.ref:
        src_path, ref_path = args.src, args.ref
        label = _stem(args.src)
    else:
        raise InputError("say what to score: --data DIR [--split test], or --src F --ref G")
    if not args.hyp and not args.checkpoint:
        raise InputError("--checkpoint is required (or give --hyp to score an existing translation)")
    pairs = read_parallel(src_path, ref_path)
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    if not pairs:
        raise InputError(f"{src_path}: no sentences to score")

    anchor = args.checkpoint if args.checkpoint else args.hyp
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(anchor)), f"{_stem(anchor)}.{label}")
    settings = {"data": args.data, "split": args.split if args.data else None, "src": src_path, "ref": ref_path,
                "checkpoint": args.checkpoint, "bounds": bounds}
    decode = None
    if args.hyp:
        hyps = read_lines(args.hyp, allow_empty=True)
        if len(hyps) != len(refs):
            raise InputError(f"{args.hyp} has {len(hyps)} lines but {ref_path} has {len(refs)}; they must be aligned")
        settings["hyp"] = args.hyp
    else:
        device = check_device_and_backend(args.device, args.backend)
        model, src_vocab, tgt_vocab, ckpt = load_for_decoding(args.checkpoint, device, args.backend)
        kwargs = decoding_kwargs(args, device)
        results, seconds = decode_with_report(PROG, args.quiet, model, src_vocab, tgt_vocab, sources, **kwargs)
        hyps = [r[0][0] if r else "" for r in results]
        settings.update(model_name=ckpt.get("model_name"), model_options=ckpt.get("model_options"),
                        **{k: (str(v) if k == "device" else v) for k, v in kwargs.items()}, backend=args.backend)
        decode = {"seconds": round(seconds, 3), "sentences_per_s": len(sources) / max(seconds, 1e-9),
                  "src_words_per_s": sum(len(s.split()) for s in sources) / max(seconds, 1e-9),
                  "hyp_words_per_s": sum(len(h.split()) for h in hyps) / max(seconds, 1e-9)}

    scores = corpus_scores(hyps, refs)
    rows = bleu_by_length(sources, hyps, refs, bounds)
    report = {**scores, "by_length": [r._asdict() for r in rows], "settings": settings, "decode": decode,
              "hyp_file": os.path.abspath(args.hyp) if args.hyp else os.path.join(os.path.abspath(out_dir), "hyp.txt")}
    try:
        if not args.hyp:
            write_atomic(os.path.join(out_dir, "hyp.txt"), "".join(h + "\n" for h in hyps))
        write_atomic(os.path.join(out_dir, "scores.json"), json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        write_atomic(os.path.join(out_dir, "bleu_by_length.csv"), rows_to_csv(rows))
        title = f"{settings.get('model_name') or _stem(anchor)}: BLEU by source length ({label})"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plot = plot_bleu_by_length(rows, os.path.join(out_dir, "bleu_by_length.png"), title)
        for w in caught:
            print(f"{PROG}: warning: {w.message}", file=sys.stderr)
    except WriteError as exc:
        raise InputError(str(exc)) from None
    except OSError as exc:
        raise InputError(f"cannot write the results to {out_dir} ({exc.strerror or exc})") from None

    print(format_table(scores, rows))
    if decode is not None:
        print(f"decoding: {decode['seconds']:.1f}s, {decode['sentences_per_s']:.1f} sentences/s, "
              f"{decode['hyp_words_per_s']:.0f} words/s")
    written = (["hyp.txt"] if not args.hyp else []) + ["scores.json", "bleu_by_length.csv"] + (["bleu_by_length.png"]
                                                                                                if plot else [])
    print(f"wrote {out_dir}{os.sep}{{{','.join(written)}}}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
