"""Scoring translations: corpus BLEU and chrF with sacrebleu, BLEU by source length, and `dtmt evaluate`.

    corpus_scores(hyps, refs, tgt_lang)             -> {"bleu", "chrf", signatures, BLEU details}
    bleu_by_length(sources, hyps, refs, bounds, tgt_lang=tgt_lang) -> [LengthBucket(label, sentences, bleu), ...]
    plot_bleu_by_length(rows, path, title)          -> the PNG's path (None without matplotlib)
    dtmt evaluate --checkpoint C --data DIR [--split test] [--out-dir D]
    dtmt evaluate --checkpoint C --src F --ref G
    dtmt evaluate --hyp H (--data DIR [--split S] | --src F --ref G)      scores existing translations

Scores are sacrebleu's defaults on detokenised text for the target language (BLEU: 13a tokenisation, `zh` for
Chinese, `ja-mecab` / `ko-mecab` for Japanese / Korean where sacrebleu's extras are installed, else `char` with a
warning; mixed case, exponential smoothing; chrF: character 6-grams, beta 2), one reference, and come with
sacrebleu's signature strings so a number can be reproduced. BLEU by length follows the papers' length figures: the
test sentences are grouped by source length in whitespace words ("1-10", "11-20", ..., "51+"; a sentence of 0 words
counts in the first bucket) and each group gets its own corpus BLEU; an empty group is reported with 0 sentences
and BLEU None (it is left out of the plot).

The command line writes to its output directory (default: next to the checkpoint, `<checkpoint stem>.<split>/`;
with --hyp and no checkpoint, next to the hypothesis file, `<hyp stem>.<split>/`; the "split" of --src/--ref
is the source file's name without its extension): `hyp.txt` (not in --hyp mode, which scores the given file
in place), `scores.json` (scores, signatures, buckets, settings, decoding time and speed),
`bleu_by_length.csv` and `bleu_by_length.png`, and prints a short table on stdout. Errors a user can cause are
one line on stderr, with exit status 2 for what the options name and 1 for what is found in the data, as in
`dtmt translate`.
"""
from __future__ import annotations

import csv
import io
import warnings
from typing import List, NamedTuple, Optional, Sequence

from dtmt_models.plotting import figure, save

PROG = "dtmt evaluate"
DEFAULT_BOUNDS = (10, 20, 30, 40, 50)


# ------------------------------------------------------------------------------------------- scores
def _check_aligned(hyps: Sequence[str], refs: Sequence[str], what: str) -> None:
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError(f"{what}: pass lists of sentences, not single strings")
    if len(hyps) != len(refs):
        raise ValueError(f"{what}: {len(hyps)} hypotheses but {len(refs)} references")


def bleu_metric(tgt_lang: Optional[str] = None):
    """sacrebleu's BLEU for text of the target language `tgt_lang` (an ISO code, or None: 13a), as `sacrebleu -l
    xx-LANG` scores it: its tokenizer for zh, ja and ko (13a scored Chinese as one word a sentence: BLEU 0 where
    sacrebleu gave 80). Where the Japanese or Korean tokenizer's extras are not installed, character tokenisation,
    with a warning naming the install (the signature says which ran)."""
    from sacrebleu.metrics import BLEU

    lang = (tgt_lang or "").split("-")[0].split("_")[0].lower()
    try:
        return BLEU(trg_lang=lang)
    except RuntimeError:   # (sacrebleu's ja-mecab / ko-mecab without their packages)
        warnings.warn(f"BLEU of {tgt_lang} text: sacrebleu's {lang}-mecab tokenizer needs `pip install "
                      f"sacrebleu[{lang}]`; scored with character tokenisation (tok:char) instead", UserWarning)
        return BLEU(tokenize="char")


def corpus_scores(hyps: Sequence[str], refs: Sequence[str], tgt_lang: Optional[str] = None) -> dict:
    """Corpus BLEU and chrF (sacrebleu defaults for the target language `tgt_lang`, bleu_metric; detokenised text,
    one reference per sentence): {"bleu", "chrf", "bleu_signature", "chrf_signature", "sentences", "bleu_detail":
    {precisions, bp, ratio, hyp_len, ref_len}}. Raises ValueError for an empty corpus or unequal lengths."""
    from sacrebleu.metrics import CHRF

    _check_aligned(hyps, refs, "corpus_scores")
    if not hyps:
        raise ValueError("corpus_scores: no sentences to score")
    hyps, refs = list(hyps), list(refs)
    scorer, chrf_metric = bleu_metric(tgt_lang), CHRF()
    bleu = scorer.corpus_score(hyps, [refs])
    chrf = chrf_metric.corpus_score(hyps, [refs])
    return {
        "bleu": float(bleu.score),
        "chrf": float(chrf.score),
        "bleu_signature": str(scorer.get_signature()),
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
                   bounds: Sequence[int] = DEFAULT_BOUNDS, src_tokens: Optional[Sequence[int]] = None,
                   tgt_lang: Optional[str] = None) -> List[LengthBucket]:
    """Corpus BLEU of the sentences grouped by source length: one LengthBucket per bucket, in order.
    Lengths are whitespace words of `sources`, or `src_tokens` (one length per sentence) when given; BLEU is
    bleu_metric(tgt_lang)'s."""
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
    rows, scorer = [], None
    for label, members in zip(bucket_labels(bounds), groups):
        score = None
        if members:
            scorer = scorer or bleu_metric(tgt_lang)
            score = float(scorer.corpus_score([hyps[i] for i in members], [[refs[i] for i in members]]).score)
        rows.append(LengthBucket(label, len(members), score))
    return rows


def plot_bleu_by_length(rows: Sequence[LengthBucket], path: str, title: str) -> Optional[str]:
    """A bar chart of BLEU per length bucket (sentence counts on the bars) written to the PNG `path`
    atomically. Returns the path, or None with a warning when matplotlib is not installed."""
    fig = figure(6.4, 4.0, what="the BLEU-by-length plot")
    if fig is None:
        return None
    rows = [LengthBucket(*r) for r in rows]
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
    return save(fig, path, dpi=110)


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
