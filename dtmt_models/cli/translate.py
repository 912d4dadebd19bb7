"""`dtmt translate`: the command line over dtmt_models.decoding.translate (see its docstring for how a list of
sentences is decoded and what the command writes).

    dtmt translate --checkpoint C [FILE ...] [--output F | --output-dir D] [--nbest N]
    dtmt translate -c A -c B [FILE ...]      (an ensemble: see dtmt_models.decoding.ensemble)
"""
from __future__ import annotations

import argparse
import math
import os
import queue
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar

import torch

from dtmt_models.atomic import WriteError, atomic_write
from dtmt_models.decoding.translate import PROG, InputError, input_warnings, translate
from dtmt_models.errors import UsageError, check_input_file, check_output_dir, check_output_file, one_line
from dtmt_models.progress import Progress

T = TypeVar("T")


# ------------------------------------------------------------------------------- command line helpers
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
    return [decode_line(line, name, number) for number, line in enumerate(raw, start=1)]


def decode_line(line: bytes, name: str, number: int) -> str:
    """One input line as text: its line end (\\n, \\r\\n) and, on line 1, a byte-order mark removed. InputError naming
    name:number for invalid UTF-8."""
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name}:{number}: invalid UTF-8 at byte {exc.start} of the line "
                         f"({line[max(0, exc.start - 10):exc.start + 10]!r})") from None
    return text[1:] if number == 1 and text.startswith("\ufeff") else text


def write_atomic(path: str, text: str) -> None:
    """Writes `text` (UTF-8) to `path` atomically (dtmt_models.atomic; WriteError on failure)."""
    with atomic_write(path) as f:
        f.write(text)


def check_device_and_backend(device: str, backend: str) -> torch.device:
    """The torch device for `device`, after checking that it and `backend` can run here (UsageError if not)."""
    import dtmt_kernels as dk
    from dtmt_kernels.backends import resolve_backend

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: {device!r} is not a device (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: use cpu or cuda, got {device!r}")
    try:
        resolve_backend(backend, dev)
    except ValueError as exc:
        raise UsageError(f"--backend {backend}: {one_line(exc)} (available: {dk.available_backends()})") from None
    return dev


def load_for_decoding(checkpoints: Sequence[str], device: torch.device, backend: str):
    """(model, source vocabulary, target vocabulary, the checkpoint dicts) for one checkpoint, or for several an
    Ensemble of their models (decoding/ensemble.py; their vocabularies must be the same); a checkpoint that is
    missing, a directory or not a dtmt checkpoint, and models that cannot form an ensemble, are UsageErrors."""
    from dtmt_models.decoding.ensemble import Ensemble, check_vocabularies
    from dtmt_models.models.checkpoint import load_model

    loaded = []
    for checkpoint in checkpoints:
        check_input_file(checkpoint, "--checkpoint", "checkpoint file")
        try:
            loaded.append(load_model(checkpoint, str(device), backend))
        except (ValueError, KeyError, RuntimeError, OSError, TypeError) as exc:
            message = one_line(exc)   # read_checkpoint's messages start with the path already
            raise UsageError(f"--checkpoint {message}" if message.startswith(f"{checkpoint}: ") else
                             f"--checkpoint {checkpoint}: cannot load it ({message})") from None
    models, src_vocabs, tgt_vocabs, ckpts = (list(x) for x in zip(*loaded))
    if len(models) == 1:
        return models[0], src_vocabs[0], tgt_vocabs[0], ckpts
    try:
        check_vocabularies(list(checkpoints), list(zip(src_vocabs, tgt_vocabs)))
        return Ensemble(models), src_vocabs[0], tgt_vocabs[0], ckpts
    except ValueError as exc:
        raise UsageError(f"ensemble: {one_line(exc)}") from None


def decode_with_report(prog: str, quiet: bool, model, src_vocab, tgt_vocab, sentences: Sequence[str], **kwargs
                       ) -> Tuple[List[List[Tuple[str, float]]], float]:
    """`translate` with progress on stderr, the truncation warning shown as one `prog: warning:` line, and a
    closing summary; returns (results, decoding seconds)."""
    # a bar on a terminal; in a log, a line a minute
    progress = Progress("none" if quiet else "auto", desc=prog, unit="sentence", every=60.0, message_stream=sys.stderr)
    t0 = time.perf_counter()

    def reporter(done: int, total: int) -> None:
        rate = done / max(time.perf_counter() - t0, 1e-9)
        progress.show(done, total, status=f"{rate:.1f} sentences/s",   # the last line: the summary below says it
                      line=f"{prog}: {done:,}/{total:,} sentences ({rate:.1f} sentences/s)" if done < total else None)
    results = reporting_warnings(prog, lambda: translate(model, src_vocab, tgt_vocab, sentences, progress=reporter,
                                                         **kwargs))
    seconds = time.perf_counter() - t0
    noun = "sentence" if len(sentences) == 1 else "sentences"
    progress.close()
    progress.message(f"{prog}: translated {len(sentences):,} {noun} in {seconds:.1f}s "
                     f"({len(sentences) / max(seconds, 1e-9):.1f} sentences/s)")
    return results, seconds


def reporting_warnings(prog: str, call: Callable[[], T], seen: Optional[Set[str]] = None) -> T:
    """call(), each InputWarning it raises shown as one `prog: warning:` line on stderr (once per message when a
    `seen` set is kept across calls); other warnings pass on."""
    result, messages = input_warnings(call)
    for message in messages:
        if seen is None or message not in seen:
            print(f"{prog}: warning: {message}", file=sys.stderr)
            if seen is not None:
                seen.add(message)
    return result


def format_output(results: Iterable[List[Tuple[str, float]]], nbest: bool, start: int = 0) -> str:
    """Plain one-best lines, or Moses n-best lines `index ||| text ||| score` (index from `start`)."""
    out = []
    for index, hyps in enumerate(results, start=start):
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
    g.add_argument("--early-stop", action="store_true",
                   help="end a sentence once it has --beam finished hypotheses (fairseq's and CTranslate2's rule, "
                        "usually fewer steps), instead of once no open hypothesis can still enter the translations "
                        "written (default: the same translations as a search run to the maximum length)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads for decoding (default 0: torch's default, OMP_NUM_THREADS or the cores)")
    g.add_argument("--backend", default="auto", choices=list(BACKEND_NAMES),
                   help="recurrent kernel backend (default auto)")
    g.add_argument("--int8", action="store_true",
                   help="decode with the decoder step's matrices in int8, one scale per row, multiplied by its "
                        "activations quantized the same way (int8 dot products); dtmt, shallow-rnmt, rnnsearch-atr, "
                        "mce and one-level nematus on the CPU")
    g.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")


def run_command(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                errors: Tuple[type, ...] = (InputError,)) -> int:
    """run(args) as a decoding command's main: an error a user can cause is one `prog: message` line on stderr and
    exit status 2 for an option that cannot work (UsageError, SPEC §6), 1 for the others (`errors`: what the data
    or the system refused while working); Ctrl-C `prog: interrupted` and 130."""
    try:
        return run(args)
    except UsageError as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return 2
    except errors as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def check_decoding_arguments(args: argparse.Namespace) -> None:
    """The decoding options' values (UsageError)."""
    for name, low in (("beam", 1), ("max_tokens", 1), ("max_src_len", 1), ("max_len_b", 0), ("threads", 0)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not 0 <= args.max_len_a < float("inf"):   # NaN fails this too
        raise UsageError(f"--max-len-a must be a finite number >= 0, got {args.max_len_a}")
    if args.max_len_a == 0 and args.max_len_b == 0:
        raise UsageError("--max-len-a 0 --max-len-b 0: every translation would be empty; allow at least one token")
    if not math.isfinite(args.alpha):
        raise UsageError(f"--alpha must be a finite number, got {args.alpha}")
    if args.int8 and (args.backend not in ("auto", "cpp") or args.device != "cpu"):
        raise UsageError(f"--int8 decodes with the C++ decoder step on the CPU (--backend auto or cpp, --device cpu), "
                         f"got --backend {args.backend} --device {args.device}")


def use_threads(threads: int) -> None:
    """--threads: decode on this many CPU threads (0 leaves torch's default)."""
    if threads:
        torch.set_num_threads(threads)


def build_decoder(model, int8: bool = False):
    """`model`'s inference decoder, built once for the whole run (int8 weight matrices with --int8), the errors a
    user can cause as UsageError."""
    model.eval()
    try:
        if int8:
            return model.inference_decoder(int8=True)
        return model.inference_decoder() if hasattr(model, "inference_decoder") else model
    except ValueError as exc:
        raise UsageError(f"--int8: {one_line(exc)}") from None


def decoding_kwargs(args: argparse.Namespace, device: torch.device) -> dict:
    return dict(beam=args.beam, alpha=args.alpha, max_tokens=args.max_tokens, max_len_a=args.max_len_a,
                max_len_b=args.max_len_b, device=device, max_src_len=args.max_src_len, early_stop=args.early_stop)


# ------------------------------------------------------------------------------------------ streaming
STREAM_LINES = 1024   # at most this many lines per decoding call when streaming


def stdin_lines() -> Iterator[str]:
    """stdin's lines as they arrive, decoded as read_input decodes them (InputError naming <stdin>:line)."""
    stream = sys.stdin
    buffer = getattr(stream, "buffer", None)
    number = 0
    while True:
        raw = buffer.readline() if buffer is not None else stream.readline().encode("utf-8", "surrogateescape")
        if not raw:
            return
        number += 1
        yield decode_line(raw, "<stdin>", number)


def chunks_as_they_come(lines: Iterator[str], most: int = STREAM_LINES) -> Iterator[List[str]]:
    """The lines in order, grouped: each group holds the lines that arrived while the previous one was being
    decoded (at least one, at most `most`), so an interactive line is translated at once and a piped file in
    full batches. A reader thread pulls the lines; an error it meets is raised after the lines before it."""
    q: "queue.Queue" = queue.Queue(maxsize=4 * most)   # the reader stays at most a few groups ahead
    end = object()

    def read() -> None:
        try:
            for line in lines:
                q.put(line)
            q.put(end)
        except BaseException as exc:   # noqa: BLE001 - handed to the consumer, which raises it
            q.put(exc)

    threading.Thread(target=read, name="dtmt-translate-stdin", daemon=True).start()
    while True:
        group, item = [], q.get()
        while isinstance(item, str):
            group.append(item)
            if len(group) == most:
                break
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
        if group:
            yield group
        if item is end:
            return
        if isinstance(item, BaseException):
            raise item


def stream_stdin(args: argparse.Namespace, model, src_vocab, tgt_vocab, device: torch.device) -> int:
    """Translates stdin to stdout group by group (chunks_as_they_come), writing and flushing each group's lines
    as soon as they are decoded; with --nbest the index counts stdin's lines from 0."""
    kwargs = dict(nbest=args.nbest or 1, decoder=build_decoder(model, args.int8), **decoding_kwargs(args, device))
    seen: Set[str] = set()
    done, t0 = 0, time.perf_counter()
    for group in chunks_as_they_come(stdin_lines()):
        results = reporting_warnings(PROG, lambda: translate(model, src_vocab, tgt_vocab, group, **kwargs), seen)
        try:
            sys.stdout.write(format_output(results, args.nbest is not None, start=done))
            sys.stdout.flush()
        except OSError as exc:
            raise InputError(f"cannot write the output (stdout: {exc.strerror or exc})") from None
        done += len(group)
    if not args.quiet:
        seconds = time.perf_counter() - t0
        print(f"{PROG}: translated {done:,} {'sentence' if done == 1 else 'sentences'} in {seconds:.1f}s "
              f"({done / max(seconds, 1e-9):.1f} sentences/s)", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Translate text files (or stdin) with a dtmt checkpoint, one sentence a line.",
        epilog="Empty input lines give empty output lines. Several inputs are written, in order, to one output "
               "unless --output-dir is given; --nbest indices count the lines of each input from 0. Reading stdin "
               "and writing stdout, it streams: the lines that have arrived are translated and written (in order) "
               "while the next ones are read, so an interactive line is answered at once.")
    p.add_argument("inputs", nargs="*", metavar="FILE", help="UTF-8 input files; none or '-' reads stdin")
    p.add_argument("--checkpoint", "-c", required=True, action="append", metavar="CKPT",
                   help="a checkpoint written by `dtmt train`; repeated (-c A -c B), an ensemble of the models, "
                        "their log-probabilities averaged at each step (they must share the vocabularies)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", help="output file (default stdout), written atomically at the end")
    out.add_argument("--output-dir", help="write each input's translation to DIR/<input basename>.out")
    p.add_argument("--nbest", type=int, default=None, metavar="N",
                   help="write the N best translations per line in Moses format: index ||| text ||| score")
    add_decoding_arguments(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    return run_command(PROG, _run, build_parser().parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    check_decoding_arguments(args)
    nbest = args.nbest
    if nbest is not None and not 1 <= nbest <= args.beam:
        raise UsageError(f"--nbest must be between 1 and --beam ({args.beam}), got {nbest}")
    inputs = args.inputs or ["-"]
    if inputs.count("-") > 1:
        raise UsageError("stdin ('-') can be read only once")
    for path in inputs:
        if path != "-":
            check_input_file(path, noun="input file")
    targets: List[Optional[str]] = [args.output] * len(inputs)
    if args.output_dir:
        names = ["stdin.out" if path == "-" else os.path.basename(path) + ".out" for path in inputs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise UsageError(f"--output-dir: several inputs would write {clash[0]}; translate them separately")
        check_output_dir(args.output_dir, "--output-dir")
        targets = [os.path.join(args.output_dir, n) for n in names]
        for target, path in zip(targets, inputs):
            check_output_file(target, f"--output-dir {args.output_dir}", inputs,
                              what=f"the translation of {'stdin' if path == '-' else path}")
    elif args.output:
        check_output_file(args.output, "--output", inputs)
    use_threads(args.threads)
    device = check_device_and_backend(args.device, args.backend)
    if inputs == ["-"] and not args.output and not args.output_dir:   # stdin to stdout: line groups as they come
        model, src_vocab, tgt_vocab, _ = load_for_decoding(args.checkpoint, device, args.backend)
        return stream_stdin(args, model, src_vocab, tgt_vocab, device)
    texts = [read_input(path) for path in inputs]            # every input before any decoding
    model, src_vocab, tgt_vocab, _ = load_for_decoding(args.checkpoint, device, args.backend)

    sentences = [line for lines in texts for line in lines]
    results, _ = decode_with_report(PROG, args.quiet, model, src_vocab, tgt_vocab, sentences, nbest=nbest or 1,
                                    decoder=build_decoder(model, args.int8), **decoding_kwargs(args, device))
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
