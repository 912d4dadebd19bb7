"""`dtmt translate`: the command line over dtmt_models.decoding.translate (see its docstring for how a list of
sentences is decoded and what the command writes).

    dtmt translate --checkpoint C [FILE ...] [--output F | --output-dir D] [--nbest N]
    dtmt translate -c A -c B [FILE ...]      (an ensemble: see dtmt_models.decoding.ensemble)
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from typing import Iterable, Iterator, List, Optional, Set, Tuple

import torch

from dtmt_models.atomic import WriteError, atomic_paths, atomic_write, is_stream
from dtmt_models.cli.common import (add_decoding_arguments, build_decoder, check_decoding_arguments,
                                    check_device_and_backend, decode_with_report, decoding_kwargs, load_for_decoding,
                                    reporting_warnings, run_command, use_threads)
from dtmt_models.data.corpus import MAX_LINE_BYTES
from dtmt_models.decoding.translate import PROG, InputError, translate
from dtmt_models.errors import (ArgumentParser, UsageError, check_input_file, check_not_a_checkpoint,
                                 check_output_dir, check_output_file, stdin_is)


# ------------------------------------------------------------------------------- command line helpers
# an input line longer than MAX_LINE_BYTES is refused: no text has one, a device (/dev/zero) does (as in corpus files)


def read_input(path: str) -> List[str]:
    """The lines of a UTF-8 input ('-': stdin), line ends and a leading byte-order mark removed; empty lines
    are kept (they translate to empty lines). Raises InputError naming file:line for invalid UTF-8 or a line of more
    than MAX_LINE_BYTES (a stream without line ends is not read without end: memory stays bounded by the text)."""
    if path == "-":
        return list(_decoded_lines(_stdin_bytes(), "<stdin>"))
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory, not an input file")
    try:
        with open(path, "rb") as f:
            return list(_decoded_lines(f, path))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None


class _encoded:
    """A text stream read as UTF-8 bytes (surrogate escapes kept, so invalid input is reported as such): for a
    stdin replaced by one without a byte buffer."""

    def __init__(self, stream):
        self.stream = stream

    def readline(self, limit: int = -1) -> bytes:
        return self.stream.readline(limit).encode("utf-8", "surrogateescape")


def _decoded_lines(stream, name: str) -> Iterator[str]:
    """The lines of a byte stream as decode_line decodes them, read one at a time (InputError naming name:line)."""
    for number, raw in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 3), b""), start=1):
        if len(raw) > MAX_LINE_BYTES and len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:   # (its line end not counted)
            raise InputError(f"{name}:{number}: a line of more than {MAX_LINE_BYTES:,} bytes; is it a text file?")
        yield decode_line(raw, name, number)


def decode_line(line: bytes, name: str, number: int) -> str:
    """One input line as text: its line end (\\n, \\r\\n) and, on line 1, a byte-order mark removed. InputError naming
    name:number for invalid UTF-8 or a NUL byte (as the corpus readers refuse it: UTF-16 read as bytes was translated
    into more lines than its text has, exit 0)."""
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name}:{number}: invalid UTF-8 at byte {exc.start} of the line "
                         f"({line[max(0, exc.start - 10):exc.start + 10]!r})") from None
    if "\x00" in text:
        raise InputError(f"{name}:{number}: a NUL byte at byte {line.index(0)} of the line; is it a text file in "
                         f"UTF-8 (not UTF-16)?")
    return text[1:] if number == 1 and text.startswith("\ufeff") else text


def format_output(results: Iterable[List[Tuple[str, float]]], nbest: bool, start: int = 0) -> str:
    """Plain one-best lines, or Moses n-best lines `index ||| text ||| F0= score ||| score` (index from `start`; its
    four fields as Moses and Marian write them: the features, here the one score, then the total)."""
    out = []
    for index, hyps in enumerate(results, start=start):
        if nbest:
            for text, score in hyps:
                out.append(f"{index} ||| {_single_line(text)} ||| F0= {score:.6f} ||| {score:.6f}")
        else:
            out.append(_single_line(hyps[0][0] if hyps else ""))
    return "".join(line + "\n" for line in out)


def _single_line(text: str) -> str:
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


# ------------------------------------------------------------------------------------------ streaming
STREAM_LINES = 1024   # at most this many lines per decoding call when streaming


def write_stdout(text: str, piece: int = 1 << 16) -> None:
    """text to stdout in UTF-8, as the files -o writes (a stdout of another encoding, PYTHONIOENCODING=ascii or a
    C locale, had raised UnicodeEncodeError's traceback at the first non-ASCII piece, '⁇' included, and written
    nothing), flushed, in pieces of at most `piece` bytes. In one write, a reader that left part-way (`| head -c
    10`) took a partial write that Python reported as whole: the rest was dropped and the status was 0. A piece's
    write after the reader left raises BrokenPipeError, which dtmt's main turns into a writer's status; another
    OSError (a full disk) is InputError. A stdout without bytes beneath (an embedding program's) takes the text."""
    try:
        out = getattr(sys.stdout, "buffer", None)
        if out is None:
            for i in range(0, len(text), piece):
                sys.stdout.write(text[i:i + piece])
            sys.stdout.flush()
            return
        sys.stdout.flush()   # (what was written to it as text goes first)
        data = text.encode("utf-8")
        for i in range(0, len(data), piece):
            out.write(data[i:i + piece])
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise InputError(f"cannot write the output (stdout: {exc.strerror or exc})") from None


def stdin_lines() -> Iterator[str]:
    """stdin's lines as they arrive, decoded as read_input decodes them (InputError naming <stdin>:line).

    Read through a reader of its own on a duplicate of stdin's descriptor, not sys.stdin.buffer: chunks_as_they_come
    reads in a daemon thread, which waits for the next line holding its reader's lock, and at interpreter shutdown
    (Ctrl-C, an error, a reader of stdout gone, while stdin was still open) Python took sys.stdin's lock to close it
    and aborted ("Fatal Python error: _enter_buffered_busy", exit 134). A reader nobody else touches is left alone;
    it is not closed (its thread may still wait in it) and does not see what a caller in the same process read ahead
    through sys.stdin before (the command itself reads nothing before)."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):   # (a stream without a descriptor: a test's, an embedding's)
        fd = None
    return _decoded_lines(open(os.dup(fd), "rb") if fd is not None else _stdin_bytes(), "<stdin>")


def _stdin_bytes():
    """sys.stdin as a byte stream: its buffer, or for a stdin replaced by one without a byte buffer, its text
    encoded."""
    return sys.stdin.buffer if getattr(sys.stdin, "buffer", None) is not None else _encoded(sys.stdin)


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
    kwargs = dict(nbest=args.nbest or 1, decoder=build_decoder(model, args.int8, args.amp),
                  **decoding_kwargs(args, device))
    seen: Set[str] = set()
    done, t0 = 0, time.perf_counter()
    for group in chunks_as_they_come(stdin_lines()):
        results = reporting_warnings(PROG, lambda: translate(model, src_vocab, tgt_vocab, group, **kwargs,
                                                             where=lambda i: f"<stdin>:{done + i + 1}"), seen)
        write_stdout(format_output(results, args.nbest is not None, start=done))
        done += len(group)
    if not args.quiet:
        seconds = time.perf_counter() - t0
        print(f"{PROG}: translated {done:,} {'sentence' if done == 1 else 'sentences'} in {seconds:.1f}s "
              f"({done / max(seconds, 1e-9):.1f} sentences/s)", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG, description="Translate text files (or stdin) with a dtmt checkpoint, one sentence a line.",
        epilog="Empty input lines give empty output lines. Several inputs are written, in order, to one output "
               "unless --output-dir is given; --nbest indices count the lines of an output from 0 (several inputs "
               "into one output: on from one input to the next, as one stream; --output-dir: each file from 0). "
               "Reading stdin "
               "and writing stdout, it streams: the lines that have arrived are translated and written (in order) "
               "while the next ones are read, so an interactive line is answered at once.")
    p.add_argument("inputs", nargs="*", metavar="FILE", help="UTF-8 input files; none or '-' reads stdin")
    p.add_argument("--checkpoint", "-c", required=True, action="append", metavar="CKPT",
                   help="a checkpoint written by `dtmt train`; repeated (-c A -c B), an ensemble of the models, "
                        "their log-probabilities averaged at each step (they must share the vocabularies)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", help="output file (default, or '-': stdout), written atomically at the end")
    out.add_argument("--output-dir", help="write each input's translation to DIR/<input basename>.out")
    p.add_argument("--nbest", type=int, default=None, metavar="N",
                   help="write the N best translations per line in Moses format: index ||| text ||| F0= score "
                        "||| score")
    add_decoding_arguments(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    return run_command(PROG, _run, build_parser().parse_args(argv))


def _typed() -> bool:
    """Whether standard input is a terminal (a person types the sentences)."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):   # (closed)
        return False


def _run(args: argparse.Namespace) -> int:
    check_decoding_arguments(args)
    nbest = args.nbest
    if nbest is not None and not 1 <= nbest <= args.beam:
        raise UsageError(f"--nbest must be between 1 and --beam ({args.beam}), got {nbest}")
    inputs = args.inputs or ["-"]
    if inputs.count("-") + sum(stdin_is(p, regular=False) for p in inputs if p != "-") > 1:   # (/dev/stdin beside
        raise UsageError("stdin ('-') can be read only once")                                 # '-': it read empty)
    if "-" in inputs and sys.stdin is None:   # (started with stdin closed: `dtmt translate -c C <&-`)
        raise UsageError("no input file given and stdin is closed; name the files to translate")
    for path in inputs:
        if path != "-":
            check_input_file(path, noun="input file")
    if args.output == "-":   # stdout, as '-' is stdin among the inputs (it wrote a file named '-')
        args.output = None
    targets: List[Optional[str]] = [args.output] * len(inputs)
    if args.output_dir:
        names = ["stdin.out" if path == "-" else os.path.basename(path) + ".out" for path in inputs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise UsageError(f"--output-dir: several inputs would write {clash[0]}; translate them separately")
        check_output_dir(args.output_dir, "--output-dir")
        targets = [os.path.join(args.output_dir, n) for n in names]
        for target, path in zip(targets, inputs):
            check_output_file(target, f"--output-dir {args.output_dir}", [*inputs, *args.checkpoint],
                              what=f"the translation of {'stdin' if path == '-' else path}")
            check_not_a_checkpoint(target, f"--output-dir {args.output_dir}:")
    elif args.output:
        check_output_file(args.output, "--output", [*inputs, *args.checkpoint])   # (nor a checkpoint it reads)
        check_not_a_checkpoint(args.output, "--output")   # (nor any other)
    elif sys.stdout is None:   # (started with stdout closed, `>&-`: all was decoded, then an AttributeError)
        raise UsageError("no --output given and stdout is closed; name a file to write with -o")
    use_threads(args.threads, "dtmt translate")
    device = check_device_and_backend(args.device, args.backend)
    if inputs == ["-"] and not args.output and not args.output_dir:   # stdin to stdout: line groups as they come
        model, src_vocab, tgt_vocab, _ = load_for_decoding(args.checkpoint, device, args.backend)
        if _typed():   # (it waited without a word, as if it hung; fairseq-interactive asks for a sentence)
            print(f"{PROG}: type a sentence a line (Ctrl-D ends)", file=sys.stderr, flush=True)
        return stream_stdin(args, model, src_vocab, tgt_vocab, device)
    if "-" in inputs and _typed():   # (-o FILE or --output-dir with typed lines: as quiet as the stream had been)
        print(f"{PROG}: type the sentences, a line each (Ctrl-D ends; they are translated then)", file=sys.stderr,
              flush=True)
    texts = [read_input(path) for path in inputs]            # every input before any decoding
    model, src_vocab, tgt_vocab, _ = load_for_decoding(args.checkpoint, device, args.backend)

    sentences = [line for lines in texts for line in lines]
    # each sentence named as file:line in the warnings and errors (they had counted the inputs as one list)
    places = [(path if path != "-" else "<stdin>", n) for path, lines in zip(inputs, texts)
              for n in range(1, len(lines) + 1)]
    results, _ = decode_with_report(PROG, args.quiet, model, src_vocab, tgt_vocab, sentences, nbest=nbest or 1,
                                    decoder=build_decoder(model, args.int8, args.amp),
                                    where=lambda i: "{}:{}".format(*places[i]), **decoding_kwargs(args, device))
    # --nbest's indices count an output's lines: several inputs into one output, one stream (they had restarted at 0
    # at each input, so a merged n-best file had every index several times: a reranker could not tell them apart)
    pieces, start = [], 0
    for lines in texts:
        pieces.append(format_output(results[start:start + len(lines)], nbest is not None,
                                    start=0 if args.output_dir else start))
        start += len(lines)
    if not (args.output_dir or args.output):
        write_stdout("".join(pieces))
        return 0
    if not args.output_dir:
        try:
            with atomic_write(args.output, through_link=True) as f:
                f.write("".join(pieces))
        except WriteError as exc:
            raise InputError(str(exc)) from None
        return 0
    write_output_set(list(zip(targets, pieces)))
    return 0


def write_output_set(outputs: List[Tuple[str, str]]) -> None:
    """--output-dir's (path, text) outputs, UTF-8: the files as one set (atomic.atomic_paths: each written whole and
    closed, then all renamed into place; a failure midway had left the first ones, said as "nothing written"), then
    any that is a device or a FIFO written in place, one after the other (held open together, a reader of two FIFOs
    in turn waited for ever). InputError naming the file that failed."""
    streaming = [is_stream(path) for path, _ in outputs]
    files = [output for output, stream in zip(outputs, streaming) if not stream]
    streams = [output for output, stream in zip(outputs, streaming) if stream]
    try:
        with atomic_paths([path for path, _ in files], through_link=True) as temps:
            for tmp, (path, text) in zip(temps, files):
                try:
                    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                        f.write(text)
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as exc:   # (named here: atomic_paths knows only the set)
                    raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from None
    except WriteError as exc:
        raise InputError(f"{exc} (none of --output-dir's files was written; any earlier versions are intact)"
                         ) from None
    try:
        for path, text in streams:
            with atomic_write(path, through_link=True) as f:
                f.write(text)
    except WriteError as exc:
        raise InputError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
