"""`dtmt evaluate`: the command line over dtmt_models.decoding.evaluate (see its docstring for the scores and
what the command writes).

    dtmt evaluate --checkpoint C --data DIR [--split test] [--out-dir D]
    dtmt evaluate -c A -c B --data DIR      (an ensemble: see dtmt_models.decoding.ensemble)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import List, Optional

import torch

from dtmt_models.atomic import WriteError, atomic_paths
from dtmt_models.cli.common import (
    add_decoding_arguments,
    check_decoding_arguments,
    decoding_options_given,
    check_device_and_backend,
    decode_with_report,
    build_decoder,
    decoding_kwargs,
    load_for_decoding,
    reporting_warnings,
    run_command,
    use_threads,
)
from dtmt_models.data.corpus import (CorpusError, corpus_paths, read_lines, read_manifest, read_parallel,
                                     read_stream_lines)
from dtmt_models.decoding.evaluate import (
    DEFAULT_BOUNDS,
    PROG,
    bleu_by_length,
    corpus_scores,
    format_table,
    plot_bleu_by_length,
    rows_to_csv,
)
from dtmt_models.decoding.beam_search import NonFiniteScores
from dtmt_models.decoding.translate import InputError
from dtmt_models.errors import (ArgumentParser, UsageError, check_input_file, check_output_dir, check_output_file,
                                 one_line, shown)


def _same_file(a: str, b: str) -> bool:
    """Whether the paths name one file (False where either is missing, or b is "-")."""
    try:
        return b != "-" and os.path.samefile(a, b)
    except OSError:
        return False


def _written_by_a_run(out_dir: str) -> bool:
    """Whether the results folder's scores.json (read before this run writes its own) is of a model's run (it
    decoded) that scored the folder's hyp.txt: the file that run wrote."""
    try:
        with open(os.path.join(out_dir, "scores.json"), encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return False
    # (by its name: a results folder moved or copied with its files keeps its scores.json's path of the old place)
    return (isinstance(report, dict) and isinstance(report.get("decode"), dict)
            and isinstance(report.get("hyp_file"), str) and os.path.basename(report["hyp_file"]) == "hyp.txt")


def _languages(ckpt: dict):
    """A checkpoint's (source, target) languages as a pair, or None where it names none (a crafted value, an int
    say, was a TypeError's traceback: not read)."""
    langs = ckpt.get("langs")
    return tuple(langs) if isinstance(langs, (list, tuple)) and len(langs) == 2 else None


# --------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG, description="Translate a test set with a checkpoint (or take existing translations with "
                               "--hyp) and score it: BLEU, chrF and BLEU by source length.")
    p.add_argument("--checkpoint", "-c", action="append", metavar="CKPT",
                   help="a checkpoint written by `dtmt train` (none with --hyp); repeated, an ensemble")
    p.add_argument("--data", help="a corpus directory written by `dtmt prepare`")
    p.add_argument("--split", default=None, help="the split of --data to score (default test)")
    p.add_argument("--src", help="source file (with --ref, instead of --data)")
    p.add_argument("--ref", help="reference file, aligned with --src")
    p.add_argument("--hyp", help="score this translation file instead of decoding (- or a pipe: read as a stream)")
    p.add_argument("--out-dir", help="where the results go (default: next to the checkpoint, <stem>.<split>/; for an "
                        "ensemble next to the first, <dir>-<stem>+<dir>-<stem>.<split>/; with --hyp alone, next to the "
                        "hypothesis file, <hyp stem>.<split>/)")
    p.add_argument("--tgt-lang", metavar="LANG",
                   help="the references' language, which picks sacrebleu's BLEU tokenizer as its -l does (zh, ja "
                        "and ko have their own; default: --data's target language, else the checkpoint's, else 13a)")
    p.add_argument("--bounds", default=",".join(map(str, DEFAULT_BOUNDS)),
                   help="upper bounds of the length buckets, in words (default 10,20,30,40,50)")
    add_decoding_arguments(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # which decoding options the command line names (with --hyp each is refused, a default's value as well)
    args.decoding_given = decoding_options_given(parser, argv)
    return run_command(PROG, _run, args, errors=(InputError, CorpusError, NonFiniteScores))


def _parse_bounds(text: str) -> List[int]:
    try:
        bounds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--bounds: expected comma-separated integers, got {text!r}") from None
    if not bounds or bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise UsageError(f"--bounds: expected increasing positive integers, got {text!r}")
    return bounds


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]


def _run(args: argparse.Namespace) -> int:
    if args.hyp and args.decoding_given:   # nothing is decoded: an option of how to decode would do nothing
        raise UsageError(f"--hyp scores a translation already made, and nothing is decoded: leave out "
                         f"{', '.join(args.decoding_given)}")
    if args.hyp and args.checkpoint:   # (the scores went into the checkpoint's results folder, recorded as its
        # model's, beside that model's own hyp.txt)
        raise UsageError(f"--hyp scores a translation already made, and no model is used: leave out --checkpoint "
                         f"{' '.join(args.checkpoint)} (name the results folder with --out-dir)")
    check_decoding_arguments(args)
    if args.hyp == "-" and sys.stdin is None:   # (started with stdin closed, `<&-`: an AttributeError's traceback)
        raise UsageError("--hyp - reads stdin, which is closed; name the file of translations")
    if sys.stdout is None:   # (`>&-`: the results were written, then an AttributeError's traceback, exit 1)
        raise UsageError("stdout is closed; the scores are printed there (run with > FILE to keep them)")
    bounds = _parse_bounds(args.bounds)
    if args.data and (args.src or args.ref):
        raise UsageError("give either --data (with --split) or --src and --ref, not both")
    if args.split is not None and not args.data:   # (it was ignored: the files given were scored)
        raise UsageError(f"--split {args.split}: a split of --data; with --src and --ref the files given are scored")
    if args.data:
        args.split = args.split or "test"
        try:
            src_path, ref_path = corpus_paths(args.data, args.split)
        except CorpusError as exc:
            raise UsageError(f"--data {args.data} --split {args.split}: {one_line(exc)}") from None
        label = args.split
    elif args.src and args.ref:
        src_path, ref_path = args.src, args.ref
        for path, option in ((src_path, "--src"), (ref_path, "--ref")):
            check_input_file(path, option)
            if not os.path.isfile(path):   # (a pipe, <(...): "parallel corpus: 1 problem(s)", naming no option)
                raise UsageError(f"{option} {path}: not a regular file (a pipe or a device); give a file (--hyp "
                                 f"alone may be a pipe)")
        label = _stem(args.src)
    elif args.src or args.ref:   # (one of the pair: named, rather than the general advice)
        given, lacking = ("--src", "--ref") if args.src else ("--ref", "--src")
        raise UsageError(f"{given} needs {lacking} beside it (or give --data DIR [--split test] instead)")
    else:
        raise UsageError("say what to score: --data DIR [--split test], or --src F --ref G"
                         + (" (--hyp needs the source beside it, for BLEU by source length)" if args.hyp else ""))
    if not args.hyp and not args.checkpoint:
        raise UsageError("--checkpoint is required (or give --hyp to score an existing translation)")
    if args.hyp and not args.out_dir and (args.hyp == "-" or os.path.exists(args.hyp)
                                          and not os.path.isfile(args.hyp)):   # (the results go beside the
        # hypothesis file by default: /dev/stdin.s/ was made, or /dev/fd/63.s/ failed after the scoring)
        raise UsageError(f"--hyp {args.hyp} reads {'standard input' if args.hyp == '-' else 'a pipe or a device'}, "
                         f"which has no folder for the results: give --out-dir")
    if args.hyp and args.hyp != "-":
        check_input_file(args.hyp, "--hyp")
    # (an empty line is a sentence: translate gives it an empty translation, as sacrebleu and the other toolkits
    # score it; such a test set was refused)
    pairs = read_parallel(src_path, ref_path, allow_empty=True)
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    if not pairs:
        raise InputError(f"{src_path}: no sentences to score")
    listed = read_manifest(args.data)["counts"].get(args.split) if args.data else len(pairs)
    if listed != len(pairs):   # (files changed by hand since dtmt prepare: scored as they are, said so)
        print(f"{PROG}: warning: {args.data}: its corpus.json lists {listed:,} {args.split} pairs, its files hold "
              f"{len(pairs):,}; scored on the files", file=sys.stderr)

    anchor = args.checkpoint[0] if args.checkpoint else args.hyp
    if args.checkpoint and len(args.checkpoint) > 1:   # an ensemble: <dir>-<stem>+<dir>-<stem> (often all best.pt)
        stem = "+".join(f"{os.path.basename(os.path.dirname(os.path.abspath(c)))}-{_stem(c)}" for c in args.checkpoint)
    else:
        stem = _stem(anchor)
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(anchor)), f"{stem}.{label}")
    # before the decoding, not after it
    check_output_dir(out_dir, "--out-dir" if args.out_dir else "the results folder (default; set it with --out-dir)")
    # no result file may be one of the inputs (--src D/hyp.txt --out-dir D replaced the source with its translation)
    inputs = [src_path, ref_path, *(args.checkpoint or []), *([args.hyp] if args.hyp else [])]
    folder = "--out-dir" if args.out_dir else "the results folder"   # (how the messages name it)
    for name in (() if args.hyp else ("hyp.txt",)) + ("scores.json", "bleu_by_length.csv", "bleu_by_length.png"):
        check_output_file(os.path.join(out_dir, name), folder, inputs)
    # --hyp writes no hyp.txt: a model's run's hyp.txt in the folder would stand beside scores of other translations,
    # and removing it lost that run's translations (a review's: hyp.txt post-processed into another file and scored
    # into the same folder had its original deleted without a word). Refused instead; a hyp.txt no model's run wrote
    # (by the folder's scores.json), or that is an input (the file scored in place), is the user's and stays.
    stale = os.path.join(out_dir, "hyp.txt")
    if (args.hyp and os.path.lexists(stale) and not any(_same_file(stale, p) for p in inputs)
            and _written_by_a_run(out_dir)):
        raise UsageError(f"{folder} {out_dir} holds hyp.txt, the "
                         f"translations a model's run scored there; the scores of --hyp {args.hyp} would replace "
                         f"theirs beside it: give another --out-dir (or move {stale} away first)")
    one = args.checkpoint is not None and len(args.checkpoint) == 1
    settings = {"data": args.data, "split": args.split if args.data else None, "src": src_path, "ref": ref_path,
                "checkpoint": args.checkpoint[0] if one else args.checkpoint, "bounds": bounds}
    decode = None
    if args.hyp:
        if args.hyp == "-" or not os.path.isfile(args.hyp):   # standard input, a pipe (<(...), /dev/stdin)
            with contextlib.ExitStack() as stack:
                stream = sys.stdin.buffer if args.hyp == "-" else stack.enter_context(open(args.hyp, "rb"))
                hyps = read_stream_lines(stream, "<stdin>" if args.hyp == "-" else args.hyp, allow_empty=True)
        else:
            hyps = read_lines(args.hyp, allow_empty=True)
        if len(hyps) != len(refs):
            raise InputError(f"{'stdin' if args.hyp == '-' else args.hyp} has {len(hyps)} lines but {ref_path} has "
                             f"{len(refs)}; they must be aligned")
        settings["hyp"] = args.hyp
    else:
        use_threads(args.threads, "dtmt evaluate")
        device = check_device_and_backend(args.device, args.backend)
        model, src_vocab, tgt_vocab, ckpts = load_for_decoding(args.checkpoint, device, args.backend)
        if args.data:   # a model of another language pair would be scored, exit 0, on sentences it cannot translate
            manifest = read_manifest(args.data)
            corpus = (manifest.get("src_lang"), manifest.get("tgt_lang"))
            for path, ckpt in zip(args.checkpoint, ckpts):
                langs = _languages(ckpt)
                if langs is not None and langs != corpus:
                    raise UsageError(f"--checkpoint {path} translates {langs[0]} to {langs[1]}, but --data "
                                     f"{args.data} is {corpus[0]} to {corpus[1]}")
        else:   # --src / --ref named by language (dtmt prepare's test.es, test.en): swapped files were scored silently
            langs = _languages(ckpts[0])
            ends = tuple(os.path.splitext(p)[1][1:].lower() for p in (src_path, ref_path))
            named = langs is not None and all(isinstance(x, str) for x in langs)
            pair = tuple(x.lower() for x in langs) if named else ()
            # (files named by language: one of them ends in one of the pair's codes; .src / .ref / .txt are not)
            if named and any(e in pair for e in ends) and ends != pair:
                print(f"{PROG}: warning: --checkpoint {args.checkpoint[0]} translates {langs[0]} to {langs[1]}, but "
                      f"--src and --ref end in .{ends[0]} and .{ends[1]}; do they hold its languages?",
                      file=sys.stderr)
        kwargs = decoding_kwargs(args, device)
        decoder = build_decoder(model, args.int8, args.amp)
        results, seconds = decode_with_report(PROG, args.quiet, model, src_vocab, tgt_vocab, sources,
                                              decoder=decoder, where=lambda i: f"{src_path}:{i + 1}", **kwargs)
        hyps = [r[0][0] if r else "" for r in results]
        names, options = [c.get("model_name") for c in ckpts], [c.get("model_options") for c in ckpts]
        settings.update(model_name=names[0] if one else "+".join(map(str, names)),
                        model_options=options[0] if one else options,
                        **{k: (str(v) if k == "device" else v) for k, v in kwargs.items()}, backend=args.backend,
                        int8=args.int8, amp=args.amp, threads=torch.get_num_threads())
        if kwargs["penalty"] != "gnmt":   # (alpha is the GNMT penalty's: unused)
            settings["alpha"] = None
        decode = {"seconds": round(seconds, 3), "sentences_per_s": len(sources) / max(seconds, 1e-9),
                  "src_words_per_s": sum(len(s.split()) for s in sources) / max(seconds, 1e-9),
                  "hyp_words_per_s": sum(len(h.split()) for h in hyps) / max(seconds, 1e-9)}

    tgt_lang = args.tgt_lang or (read_manifest(args.data).get("tgt_lang") if args.data else None)
    if tgt_lang is None and not args.hyp:   # (the checkpoint's target language, where it says one)
        langs = _languages(ckpts[0])
        tgt_lang = langs[1] if langs is not None and isinstance(langs[1], str) else None
    settings["tgt_lang"] = tgt_lang
    scores, rows = reporting_warnings(PROG, lambda: (corpus_scores(hyps, refs, tgt_lang),
                                                     bleu_by_length(sources, hyps, refs, bounds, tgt_lang=tgt_lang)),
                                      seen=set(), category=UserWarning)
    report = {**scores, "by_length": [r._asdict() for r in rows], "settings": settings, "decode": decode,
              "hyp_file": (("<stdin>" if args.hyp == "-" else os.path.abspath(args.hyp)) if args.hyp
                           else os.path.join(os.path.abspath(out_dir), "hyp.txt"))}
    # (a file name of bytes that are not UTF-8 was a traceback, in the JSON, the plot's title and the last line)
    text = shown(json.dumps(report, indent=2, ensure_ascii=False))
    title = shown(f"{settings.get('model_name') or ('stdin' if anchor == '-' else _stem(anchor))}: BLEU by source "
                  f"length ({label})")
    png = os.path.join(out_dir, "bleu_by_length.png")
    try:
        # the results as one set: each written to a temporary file first, and all renamed into place only once every
        # one is written (a failure midway had left this run's hyp.txt beside the scores.json of the run before)
        contents = ([] if args.hyp else [("hyp.txt", "".join(h + "\n" for h in hyps))]) + [
            ("scores.json", text + "\n"), ("bleu_by_length.csv", rows_to_csv(rows))]
        names = [name for name, _ in contents] + ["bleu_by_length.png"]
        with atomic_paths([os.path.join(out_dir, name) for name in names], [""] * len(contents) + [".png"],
                          through_link=True) as temps:
            for tmp, (_, content) in zip(temps, contents):
                with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                    f.write(content)
                    f.flush()
                    os.fsync(f.fileno())
            plot = reporting_warnings(PROG, lambda: plot_bleu_by_length(rows, temps[-1], title), category=Warning)
        if plot is None and os.path.lexists(png):   # (no matplotlib now: the earlier run's plot would stay beside
            os.remove(png)                            # these scores)
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
    print(shown(f"wrote {out_dir}{os.sep}{{{','.join(written)}}}"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
