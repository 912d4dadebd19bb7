"""Translation with a trained checkpoint: the library call the trainer uses for dev BLEU, and `dtmt translate`.

    translate(model, src_vocab, tgt_vocab, sentences, beam=4, ...)   -> per sentence, its n-best (text, score)
    translate_best(model, src_vocab, tgt_vocab, sentences, ...)      -> the one-best strings
    dtmt translate --checkpoint C [FILE ...] [--output F | --output-dir D] [--nbest N]

How a list of sentences is decoded:
  * each line is segmented with the source SentencePiece model; a line with no subwords (empty or only
    whitespace) translates to the empty string without reaching the model (the encoders need >= 1 token);
  * a source longer than `max_src_len` subwords is cut to that length (counted, and reported once with a
    `TruncationWarning`) instead of failing or exhausting memory;
  * the sources are sorted by length (longest first, so an out-of-memory shows up at once) and cut into
    batches whose padded size, sentences x longest source, stays within `max_tokens` (a single longer source
    forms a batch of its own);
  * every batch goes through `beam_search` with the model in eval mode under `torch.no_grad()` (not
    `torch.inference_mode()`: tensors it creates can never re-enter autograd, which custom autograd
    Functions and callers that train afterwards, like the trainer's validation, must not have to care
    about); the model's train/eval mode is restored afterwards;
  * the results are put back in input order and detokenised with the target SentencePiece model.
Beam search treats every sentence of a batch independently, so the output does not depend on max_tokens.

The command line reads every input first (so a bad file fails before any decoding), decodes all their lines
together, and writes each output atomically (a temporary file renamed into place). Several inputs go to one
output (stdout or --output) in input order, or with --output-dir to `D/<input basename>.out` each. With
--nbest N the output is in Moses n-best format, `index ||| translation ||| score`, the index counting the
lines of each input from 0 and the score the length-normalised log-probability that ranks the beam.
Errors a user can cause (missing or foreign checkpoint, unreadable input, invalid UTF-8, with file:line,
unavailable backend or device) are one line on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from .atomic import WriteError, atomic_write
from .beam_search import beam_search
from .errors import one_line
from .vocabulary import UNK, Vocabulary

PROG = "dtmt translate"
Progress = Callable[[int, int], None]


class InputWarning(UserWarning):
    """Something about the sources that the user should know; `dtmt translate` shows it as one line."""


class TruncationWarning(InputWarning):
    """Some sources were longer than `max_src_len` subwords and were cut."""


class UnknownPiecesWarning(InputWarning):
    """Some sources are mostly pieces the source vocabulary does not know: the model can only guess at them."""


class InputError(Exception):
    """A problem with the command line's inputs or settings; the message is shown as is, on one line."""


# ------------------------------------------------------------------------------------------- library
def length_batches(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Indices of `lengths`, longest first, cut into batches of at most `max_tokens` padded source tokens
    (number of sentences x longest length); a source longer than max_tokens is a batch by itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])    # stable: ties keep the input order
    batches: List[List[int]] = []
    current: List[int] = []
    longest = 0
    for i in order:
        if current and max(longest, lengths[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    return batches


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def translate(model: torch.nn.Module, src_vocab: Vocabulary, tgt_vocab: Vocabulary, sentences: Sequence[str],
              beam: int = 4, alpha: float = 0.6, nbest: int = 1, max_tokens: int = 2000, max_len_a: float = 2.0,
              max_len_b: int = 10, device=None, progress: Optional[Progress] = None,
              max_src_len: Optional[int] = 250) -> List[List[Tuple[str, float]]]:
    """Translates `sentences` (plain text, one sentence each); returns for every sentence, in input order, its
    up to `nbest` best (translation, length-normalised log-probability) pairs, best first.

    An empty or whitespace-only sentence gives [("", 0.0)]. `device` is where the batches go (None: the
    model's device; the model itself is not moved). `progress(done, total)` is called after every batch with
    the number of sentences finished. `max_src_len` (None: no limit) cuts longer sources, with one
    `TruncationWarning` per call; sources of which more than half the pieces are unknown to the source
    vocabulary give one `UnknownPiecesWarning` per call (the model would otherwise invent a fluent sentence
    without a word of notice)."""
    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam, got beam={beam}, nbest={nbest}")
    if max_src_len is not None and max_src_len < 1:
        raise ValueError(f"max_src_len must be >= 1 or None, got {max_src_len}")
    if isinstance(sentences, str):
        raise TypeError("translate: `sentences` must be a sequence of strings, not one string")
    device = _model_device(model) if device is None else torch.device(device)
    total = len(sentences)
    results: List[List[Tuple[str, float]]] = [[("", 0.0)] for _ in range(total)]
    ids: List[List[int]] = []
    todo: List[int] = []                        # positions of the sentences that reach the model
    truncated = 0
    unknown: List[int] = []                     # (1-based) numbers of mostly-unknown sources
    boundary = src_vocab.sp.piece_to_id("\u2581")
    for i, text in enumerate(sentences):
        tokens = src_vocab.encode(text) if text.strip() else []
        if not tokens:
            continue
        pieces = [t for t in tokens if t != boundary]  # a bare word boundary says nothing about the words
        if 2 * sum(t == UNK for t in pieces) > len(pieces):
            unknown.append(i + 1)
        if max_src_len is not None and len(tokens) > max_src_len:
            tokens = tokens[:max_src_len]
            truncated += 1
        todo.append(i)
        ids.append(tokens)
    if truncated:
        warnings.warn(f"{truncated} of {total} source sentence(s) had more than {max_src_len} subwords and were "
                      f"truncated to {max_src_len}", TruncationWarning, stacklevel=2)
    if unknown:
        shown = ", ".join(map(str, unknown[:5])) + (", ..." if len(unknown) > 5 else "")
        warnings.warn(f"{len(unknown)} of {total} source sentence(s) are mostly pieces unknown to the model's "
                      f"source vocabulary (sentence {shown}): their translations are guesses, not translations",
                      UnknownPiecesWarning, stacklevel=2)
    done = total - len(todo)
    if progress is not None:
        progress(done, total)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # built once for every batch (the weights do not change here); a duck-typed model decodes as it is
            decoder = model.inference_decoder() if ids and hasattr(model, "inference_decoder") else model
            for batch in length_batches([len(t) for t in ids], max_tokens):
                width = max(len(ids[j]) for j in batch)
                src = torch.zeros(len(batch), width, dtype=torch.long)     # PAD = 0
                for row, j in enumerate(batch):
                    src[row, :len(ids[j])] = torch.tensor(ids[j], dtype=torch.long)
                lengths = torch.tensor([len(ids[j]) for j in batch], dtype=torch.long)
                hyps = beam_search(decoder, src.to(device), lengths.to(device), beam=beam, alpha=alpha, nbest=nbest,
                                   max_len_a=max_len_a, max_len_b=max_len_b)
                for j, sentence_hyps in zip(batch, hyps):
                    results[todo[j]] = [(tgt_vocab.decode(h.tokens), float(h.score)) for h in sentence_hyps]
                done += len(batch)
                if progress is not None:
                    progress(done, total)
    finally:
        model.train(was_training)
    return results


def translate_best(model: torch.nn.Module, src_vocab: Vocabulary, tgt_vocab: Vocabulary,
                   sentences: Sequence[str], **kwargs) -> List[str]:
    """The one-best translation of every sentence, in input order (keyword arguments as `translate`, without
    nbest)."""
    if "nbest" in kwargs:
        raise TypeError("translate_best: nbest is always 1")
    return [hyps[0][0] if hyps else "" for hyps in translate(model, src_vocab, tgt_vocab, sentences, **kwargs)]


# ------------------------------------------------------------------------------- command line helpers
class ProgressReporter:
    """Progress on stderr: on a terminal, one line rewritten in place (at most 5 times a second); otherwise
    (a redirected log) a line every `every` seconds, so long runs show life without flooding the log."""

    def __init__(self, prog: str, enabled: bool = True, every: float = 60.0, stream=None):
        self.prog, self.enabled, self.every = prog, enabled, every
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.start = self.last = time.perf_counter()
        self.dirty = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < (0.2 if self.tty else self.every) and done < total:
            return
        if not self.tty and done >= total:
            return                                   # the closing summary says it
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        text = f"{self.prog}: {done:,}/{total:,} sentences ({rate:.1f} sentences/s)"
        if self.tty:
            self.stream.write("\r" + text)
            self.dirty = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self, message: Optional[str] = None) -> None:
        if not self.enabled:
            return
        if self.dirty:
            self.stream.write("\n")
            self.dirty = False
        if message:
            self.stream.write(f"{self.prog}: {message}\n")
        self.stream.flush()


def read_input(path: str) -> List[str]:
    """The lines of a UTF-8 input ('-': stdin), line ends and a leading byte-order mark removed; empty lines
    are kept (they translate to empty lines). Raises InputError naming file:line for invalid UTF-8."""
    if path == "-":
        name, stream = "<stdin>", sys.stdin
        buffer = getattr(stream, "buffer", None)
        data = buffer.read() if buffer is not None else stream.read().encode("utf-8", "surrogateescape")
    else:
        name = path
        if os.path.isdir(path):
            raise InputError(f"{path}: is a directory, not an input file")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    raw = data.split(b"\n")
    if raw[-1] == b"":
        raw.pop()
    lines = []
    for number, line in enumerate(raw, start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{name}:{number}: invalid UTF-8 at byte {exc.start} of the line "
                             f"({line[max(0, exc.start - 10):exc.start + 10]!r})") from None
        if number == 1 and text.startswith("\ufeff"):
            text = text[1:]
        lines.append(text)
    return lines


def write_atomic(path: str, text: str) -> None:
    """Writes `text` (UTF-8) to `path` atomically (dtmt_models.atomic; WriteError on failure)."""
    with atomic_write(path) as f:
        f.write(text)


def check_device_and_backend(device: str, backend: str) -> torch.device:
    """The torch device for `device`, after checking that it and `backend` can run here (InputError if not)."""
    import dtmt_kernels as dk
    from dtmt_kernels.backends import resolve_backend

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"--device: {device!r} is not a device (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"--device: use cpu or cuda, got {device!r}")
    try:
        resolve_backend(backend, dev)
    except ValueError as exc:
        raise InputError(f"--backend {backend}: {one_line(exc)} (available: {dk.available_backends()})") from None
    return dev


def load_for_decoding(checkpoint: str, device: torch.device, backend: str):
    """load_model with the errors a user can cause turned into InputError."""
    from .checkpoint import load_model

    if not os.path.isfile(checkpoint):
        raise InputError(f"checkpoint {checkpoint!r} does not exist")
    try:
        return load_model(checkpoint, str(device), backend)
    except (ValueError, KeyError, RuntimeError, OSError, TypeError) as exc:
        raise InputError(f"{checkpoint}: cannot load the checkpoint ({one_line(exc)})") from None


def decode_with_report(prog: str, quiet: bool, model, src_vocab, tgt_vocab, sentences: Sequence[str], **kwargs
                       ) -> Tuple[List[List[Tuple[str, float]]], float]:
    """`translate` with progress on stderr, the truncation warning shown as one `prog: warning:` line, and a
    closing summary; returns (results, decoding seconds)."""
    reporter = ProgressReporter(prog, enabled=not quiet)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InputWarning)
        results = translate(model, src_vocab, tgt_vocab, sentences, progress=reporter, **kwargs)
    seconds = time.perf_counter() - t0
    for w in caught:
        if issubclass(w.category, InputWarning):
            print(f"{prog}: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    noun = "sentence" if len(sentences) == 1 else "sentences"
    reporter.close(f"translated {len(sentences):,} {noun} in {seconds:.1f}s "
                   f"({len(sentences) / max(seconds, 1e-9):.1f} sentences/s)")
    return results, seconds


def format_output(results: Iterable[List[Tuple[str, float]]], nbest: bool) -> str:
    """Plain one-best lines, or Moses n-best lines `index ||| text ||| score` (index from 0)."""
    out = []
    for index, hyps in enumerate(results):
        if nbest:
            for text, score in hyps:
                out.append(f"{index} ||| {_single_line(text)} ||| {score:.6f}")
        else:
            out.append(_single_line(hyps[0][0] if hyps else ""))
    return "".join(line + "\n" for line in out)


def _single_line(text: str) -> str:
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `dtmt translate` and `dtmt evaluate` share."""
    from dtmt_kernels.backends import BACKEND_NAMES

    g = parser.add_argument_group("decoding")
    g.add_argument("--beam", type=int, default=4, help="beam size (1: greedy; default 4)")
    g.add_argument("--alpha", type=float, default=0.6,
                   help="length penalty exponent, ((5+|y|)/6)^alpha (default 0.6; 0: raw log-probability)")
    g.add_argument("--max-tokens", type=int, default=2000,
                   help="source subwords per batch, padding included (default 2000)")
    g.add_argument("--max-src-len", type=int, default=250,
                   help="longer sources are truncated to this many subwords, with a warning (default 250)")
    g.add_argument("--max-len-a", type=float, default=2.0,
                   help="maximum output length = a * source length + b (default a=2.0)")
    g.add_argument("--max-len-b", type=int, default=10, help="see --max-len-a (default b=10)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    g.add_argument("--backend", default="auto", choices=list(BACKEND_NAMES),
                   help="recurrent kernel backend (default auto)")
    g.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")


class OnceAction(argparse.Action):
    """An option that may be given once: a repeat is an error, not a silent "the last one wins"."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}); "
                         f"give one checkpoint (ensembles are not supported)")
        setattr(namespace, self.dest, values)


def check_decoding_arguments(args: argparse.Namespace) -> None:
    for name, low in (("beam", 1), ("max_tokens", 1), ("max_src_len", 1), ("max_len_b", 0)):
        if getattr(args, name) < low:
            raise InputError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not 0 <= args.max_len_a < float("inf"):   # NaN fails this too
        raise InputError(f"--max-len-a must be a finite number >= 0, got {args.max_len_a}")
    if not math.isfinite(args.alpha):
        raise InputError(f"--alpha must be a finite number, got {args.alpha}")


def decoding_kwargs(args: argparse.Namespace, device: torch.device) -> dict:
    return dict(beam=args.beam, alpha=args.alpha, max_tokens=args.max_tokens, max_len_a=args.max_len_a,
                max_len_b=args.max_len_b, device=device, max_src_len=args.max_src_len)


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Translate text files (or stdin) with a dtmt checkpoint, one sentence a line.",
        epilog="Empty input lines give empty output lines. Several inputs are written, in order, to one output "
               "unless --output-dir is given; --nbest indices count the lines of each input from 0.")
    p.add_argument("inputs", nargs="*", metavar="FILE", help="UTF-8 input files; none or '-' reads stdin")
    p.add_argument("--checkpoint", "-c", required=True, action=OnceAction, help="a checkpoint written by `dtmt train`")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", help="output file (default stdout), written atomically at the end")
    out.add_argument("--output-dir", help="write each input's translation to DIR/<input basename>.out")
    p.add_argument("--nbest", type=int, default=None, metavar="N",
                   help="write the N best translations per line in Moses format: index ||| text ||| score")
    add_decoding_arguments(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except InputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    check_decoding_arguments(args)
    nbest = args.nbest
    if nbest is not None and not 1 <= nbest <= args.beam:
        raise InputError(f"--nbest must be between 1 and --beam ({args.beam}), got {nbest}")
    inputs = args.inputs or ["-"]
    if inputs.count("-") > 1:
        raise InputError("stdin ('-') can be read only once")
    targets: List[Optional[str]] = [args.output] * len(inputs)
    if args.output_dir:
        names = ["stdin.out" if path == "-" else os.path.basename(path) + ".out" for path in inputs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise InputError(f"--output-dir: several inputs would write {clash[0]}; translate them separately")
        targets = [os.path.join(args.output_dir, n) for n in names]
    device = check_device_and_backend(args.device, args.backend)
    texts = [read_input(path) for path in inputs]            # every input before any decoding
    model, src_vocab, tgt_vocab, _ = load_for_decoding(args.checkpoint, device, args.backend)

    sentences = [line for lines in texts for line in lines]
    results, _ = decode_with_report(PROG, args.quiet, model, src_vocab, tgt_vocab, sentences,
                                    nbest=nbest or 1, **decoding_kwargs(args, device))
    pieces, start = [], 0
    for lines in texts:
        pieces.append(format_output(results[start:start + len(lines)], nbest is not None))
        start += len(lines)
    try:
        if args.output_dir:
            for target, text in zip(targets, pieces):
                write_atomic(target, text)
        elif args.output:
            write_atomic(args.output, "".join(pieces))
        else:
            sys.stdout.write("".join(pieces))
            sys.stdout.flush()
    except WriteError as exc:
        raise InputError(str(exc)) from None
    except OSError as exc:   # stdout
        raise InputError(f"cannot write the output ({exc.filename or 'stdout'}: {exc.strerror or exc})") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
