"""How the package turns an exception from a library (torch, SentencePiece, the OS) into its own one-line
messages, and the commands' usage errors (UsageError: exit status 2) with the checks of the numbers an option
takes and of the files and folders it names, made before any work."""
from __future__ import annotations

import argparse
import contextlib
import math
import numbers
import os
import stat
import sys
from typing import Iterator, List, Optional, Sequence


# The largest values the commands take for a count (steps, tokens, lengths, vocabulary sizes: what the C++ ops and
# SentencePiece hold in an int32) and for a number of threads (each a thread of the process: 100,000 crashed it).
MAX_COUNT = 2 ** 31 - 1
MAX_THREADS = 1024
# SentencePiece pieces per side: it reads the size as an int32, but a unigram model asked for 2^31 - 1 pieces of a
# small corpus ran past two minutes where 1,000,000 took half a second; the papers use at most 90,000
MAX_VOCAB_SIZE = 1_000_000


class _Diagnostics:
    """A command's stderr (`diagnostics_never_fail`): writes go to the stream it stands for; one that fails there (the
    reader of a pipe gone, a full disk, a closed descriptor) is dropped. Everything else is the stream's."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            return len(text)
        except ValueError as exc:   # (a closed file's; an encoding's error is the caller's to see)
            if getattr(self.stream, "closed", False) and not isinstance(exc, UnicodeError):
                return len(text)
            raise

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def __getattr__(self, name):   # (isatty, fileno, encoding, buffer: the stream's)
        return getattr(self.stream, name)


@contextlib.contextmanager
def diagnostics_never_fail() -> Iterator[None]:
    """Within it, sys.stderr drops what it cannot write instead of raising: a warning, a progress line or a summary
    on a stderr whose reader left (`2>&1 | grep -m1 listening`, a dead log pipe, 2>/dev/full) had cost a command its
    output (translate wrote nothing, exit 1 or 141) or its shutdown (serve ignored SIGTERM: the stop was scheduled
    after a log line that raised)."""
    if sys.stderr is None or isinstance(sys.stderr, _Diagnostics):
        yield
        return
    stream, sys.stderr = sys.stderr, _Diagnostics(sys.stderr)
    try:
        yield
    finally:
        if isinstance(sys.stderr, _Diagnostics) and sys.stderr.stream is stream:   # (unless replaced meanwhile)
            sys.stderr = stream


# what the allocators say when memory runs out: the CPU's (a RuntimeError: torch raises no OutOfMemoryError there),
# the OS's, CUDA's outside the caching allocator
OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "Cannot allocate memory", "CUDA error: out of memory")


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says memory ran out (MemoryError, torch's OutOfMemoryError, or an allocator's RuntimeError:
    OUT_OF_MEMORY_TEXTS), which a command says in one line instead of a traceback."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or isinstance(exc, RuntimeError) and any(text in str(exc) for text in OUT_OF_MEMORY_TEXTS))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_warning(threads: Optional[int]) -> Optional[str]:
    """The warning for --threads above the CPUs this process may use (they take turns on the same cores: slower,
    not faster; 1,024 on 2 cores had been taken silently), or None."""
    cpus = usable_cpus()
    if not threads or threads <= cpus:
        return None
    return (f"warning: --threads {threads} is more than the {cpus} CPU{'s' if cpus > 1 else ''} this process may use: "
            f"the threads take turns on them (slower, not faster)")


# The longest message one_line gives: a message that quotes a value (a model option from a file, a line of input)
# is cut in the middle past it, so that a small file cannot print megabytes
MAX_MESSAGE = 2000


def cut(text: str) -> str:
    """`text` cut in the middle past MAX_MESSAGE characters (its two ends kept)."""
    if len(text) <= MAX_MESSAGE:
        return text
    half = MAX_MESSAGE // 2
    return f"{text[:half]} ... ({len(text) - 2 * half:,} characters cut) ... {text[-half:]}"


def shown(text: str) -> str:
    """`text` with the bytes of a file name that are not UTF-8 (kept by Python as lone surrogates) as U+FFFD: what
    a JSON file, a plot or stdout can hold (they refused the surrogates with a traceback)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its lines joined with " | "; the type's name if it has none), cut in the
    middle past MAX_MESSAGE characters."""
    return cut(" | ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__)


def did_you_mean(word, choices) -> str:
    """" (did you mean 'X'?)" for the choice closest to a mistyped `word` (difflib's, case ignored), "" where none
    is close: for the errors that name a thing by its name (a model, an option, a preset)."""
    import difflib

    if not isinstance(word, str):
        return ""
    choices = [str(c) for c in choices]
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.75)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """The commands' argparse parser: an error in the command line (an unknown option, a value of the wrong type, a
    missing argument) is one line, `dtmt <command>: message`, and exit status 2, as the commands' own checks are
    (contract §6), instead of argparse's usage text before it; `--help` prints the usage as before. Subcommands'
    parsers (add_subparsers) are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (--help: the options)\n")

    def _print_message(self, message: str, file=None) -> None:
        """argparse's, without swallowing an OSError: a --help past the buffer on a full disk (`> /dev/full`) was
        lost with exit status 0; the error reaches `dtmt`'s one line and status 1. (A closed stream, None, is
        still nothing to write to.)"""
        if message:
            try:
                (file or sys.stderr).write(message)
            except AttributeError:
                pass

    def _get_values(self, action, arg_strings):
        """argparse's, refusing an empty value given on the command line (`--out ""`, an unset shell variable's
        `--out "$OUT"`), which no option takes: a path of "" had been the current folder or the option's default
        (`dtmt train --out ""` wrote runs/dtmt), or an error naming no option. (An option's own constant, as
        --resume's without a value, is not a value given.)"""
        if "" in arg_strings and action.nargs not in (argparse.PARSER, argparse.REMAINDER):   # (a subcommand's
            # strings are its parser's to read)
            name = max(action.option_strings, key=len) if action.option_strings else action.metavar or action.dest
            self.error(f"{name}: an empty value (an unset variable?)")
        return super()._get_values(action, arg_strings)


def command_line_values(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> dict:
    """dest -> value of the options that the command line `argv` gives, whatever their values (`--beam 4` is given
    though 4 is the default), as `parser` parses them (None: sys.argv[1:]); a required option may be missing (it
    comes from elsewhere, as a --config file's). `parser` is left as it was."""
    saved = [(action, action.default, action.required) for action in parser._actions]
    try:   # parsed again with every default suppressed: the namespace holds only what the command line sets
        for action, _, _ in saved:
            action.default, action.required = argparse.SUPPRESS, False
        return vars(parser.parse_args(argv))
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required


def check_device_present(device, who: str) -> None:
    """ValueError `who: device 'cuda:1': this machine has N CUDA devices` where the torch.device `device` is a CUDA
    device this process cannot use (torch's own error was an AssertionError, "Torch not compiled with CUDA enabled",
    or came only after the work before it), or of a type dtmt does not run on (mps, xla)."""
    import torch

    if device.type not in ("cpu", "cuda", "meta"):   # (mps, xla: torch's RuntimeError "not linked with support")
        raise ValueError(f"{who}: device {str(device)!r}: dtmt runs on the CPU or a CUDA device")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{who}: device {str(device)!r}: this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA devices")


class UsageError(ValueError):
    """A command-line option, its value or a file it names that cannot work, found before any work is done: a
    command prints it as one line and exits with status 2 (contract §6), as argparse does for its own errors. Problems
    found in the data itself while working (a line that is not UTF-8, files of different lengths) are not this:
    those exit with status 1 (dtmt train, which checks its whole corpus before it trains, gives 2 for those too)."""


def refuse(option: str, value, allowed: str) -> UsageError:
    """The commands' one form for an option's value out of its range: `--option VALUE: must be ALLOWED` (the
    value as the command read it, a whole float as the integer typed: `--read-timeout 0`, not `0.0`; then what it
    may be)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return UsageError(f"{option} {value}: must be {allowed}")


def check_count(option: str, value: Optional[int], low: int, high: int, note: str = "") -> None:
    """An integer option in [low, high] (None: not given): else UsageError `--option VALUE: must be an integer in
    [LOW, HIGH]` and `note` (why the bound, what 0 means)."""
    # (a float passed: ServeSettings(max_tokens=2000.0) was accepted, then every request refused by translate())
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                              or not low <= value <= high):
        raise refuse(option, value, f"an integer in [{low:,}, {high:,}]{note}")


def check_counts(args: argparse.Namespace, ranges) -> None:
    """check_count on each (dest, low, high[, note]) of `ranges`, the option `--dest` with dashes read from argparse's
    `args` (a dest the command lacks: not given)."""
    for dest, low, high, *note in ranges:
        check_count("--" + dest.replace("_", "-"), getattr(args, dest, None), low, high, *note)


def check_finite(option: str, value: Optional[float], low: Optional[float] = None, high: float = math.inf,
                 above: bool = False, note: str = "") -> None:
    """A real option (None: not given), finite (NaN fails), >= low (> low with `above`; low None: any) and <= high:
    else UsageError `--option VALUE: must be a finite number >= LOW` (and `<= HIGH` where high is finite)."""
    if value is None:
        return
    if math.isfinite(value) and (low is None or (low < value if above else low <= value)) and value <= high:
        return
    bounds = ([] if low is None else [f"{'>' if above else '>='} {low:g}"]) + \
        ([f"<= {high:,g}"] if math.isfinite(high) else [])
    raise refuse(option, value, " ".join(["a finite number", " and ".join(bounds)]).strip() + note)


def check_input_file(path: str, option: str = "", noun: str = "file") -> None:
    """A file a command will read, named by `option` (empty for a positional argument): UsageError, before any
    work, if it is a directory or does not exist ("--src F: is a directory, not a file"; noun "checkpoint file":
    "... not a checkpoint file"). A named pipe or a device (/dev/stdin, `<(zcat x.gz)`) is a file here."""
    where = f"{option} {path}" if option else path
    if os.path.isdir(path):
        raise UsageError(f"{where}: is a directory, not {'an' if noun[0] in 'aeiou' else 'a'} {noun}")
    if not os.path.exists(path):
        raise UsageError(f"{where}: no such {noun}")


def check_input_dir(path: str, option: str, noun: str) -> None:
    """A folder a command will read, named by `option`: UsageError, before any work, if it is a file ("--run R: is
    a file, not a run folder") or does not exist ("... no such folder")."""
    if not os.path.isdir(path):
        raise UsageError(f"{option} {path}: " + (f"is a file, not a {noun}" if os.path.exists(path) else
                                                 "no such folder"))


def check_output_file(path: str, option: str, inputs: Sequence[str] = (), what: Optional[str] = None) -> None:
    """An output file named by `option` that is a folder, lies under a file, or is one of the `inputs` (it would be
    overwritten), or whose folder (the nearest one that exists on its way) cannot be written: UsageError, before any
    work. (Missing folders on its way are made when it is written.)"""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; give a file name" if what is None else
                         f"{option}: {path}, where {what} would go, is a directory")
    device = os.path.exists(path) and not os.path.isfile(path)   # (-o /dev/null: written in place, no folder needed)
    # a link is written through (atomic's through_link): the folder written is its target's
    written = os.path.realpath(path) if os.path.islink(path) and not device else path
    _check_folder_on_the_way(os.path.dirname(os.path.abspath(written)), option, path, writable=not device)
    name = os.path.basename(os.path.abspath(path))
    if not device and len(os.fsencode(name)) > _name_max(os.path.dirname(os.path.abspath(path))):
        raise UsageError(f"{option} {path}: the file name is longer than the "
                         f"{_name_max(os.path.dirname(os.path.abspath(path)))} bytes a name may have here")
    for source in inputs:
        if source == "-":   # (standard input redirected from the output's file: `translate -o f < f` emptied it)
            if stdin_is(path):
                raise UsageError(f"{option} {path}: is also the input (standard input reads it); the output would "
                                 f"overwrite it")
        elif os.path.exists(source) and os.path.exists(path) and os.path.samefile(source, path):
            raise UsageError(f"{option} {path}: is also an input ({source}); the output would overwrite it")


def stdin_is(path: str, regular: bool = True) -> bool:
    """Whether standard input reads `path`: its regular file, redirected with `<` (`regular`), or else its stream
    (/dev/stdin, /dev/fd/0 or the FIFO itself of a pipe, a FIFO or a terminal: read once, where a regular file is
    read anew by each name). False where stdin is closed or `path` is not there."""
    try:
        seen = os.fstat(0)
        return stat.S_ISREG(seen.st_mode) == regular and os.path.samestat(seen, os.stat(path))
    except (OSError, ValueError):
        return False


def check_not_a_checkpoint(path: str, option: str) -> None:
    """A text output named by `option` whose existing file is a checkpoint (a zip archive, as torch.save writes
    one): UsageError, before any work. `dtmt translate -c runA/best.pt -o runB/best.pt` replaced runB's model with
    text, exit 0; a run's last.pt lost its training state so."""
    if not os.path.isfile(path):   # (absent; or a FIFO, whose opening would wait for a writer)
        return
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:   # (not readable: the write itself says what is wrong)
        return
    if head == b"PK\x03\x04":
        raise UsageError(f"{option} {path}: is a checkpoint (a zip archive); the text output would replace it: "
                         f"give another name")


def _name_max(folder: str) -> int:
    """The longest file name (bytes) the file system of the existing `folder` (or its nearest existing parent) takes."""
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_output_dir(path: str, option: str) -> None:
    """An output folder named by `option` (or a phrase for a default one) that is a file, lies under one, or cannot
    be written (it or the nearest folder on its way that exists): UsageError, before any work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{option} {path}: exists and is not a directory")
    _check_folder_on_the_way(os.path.abspath(path), option, path)


def _check_folder_on_the_way(folder: str, option: str, path: str, writable: bool = True) -> None:
    while not os.path.exists(folder):   # the nearest existing folder on the way must be a folder
        if os.path.islink(folder):   # (a link to nothing: making the folder failed with "File exists")
            raise UsageError(f"{option} {path}: {folder} is a symbolic link to {os.readlink(folder)}, which does not "
                             f"exist")
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        name = os.path.basename(folder)   # (a folder to be made: a name the file system takes, before any work)
        if len(os.fsencode(name)) > _name_max(parent):
            raise UsageError(f"{option} {path}: the folder name {cut(name)[:60]}... is longer than the "
                             f"{_name_max(parent)} bytes a name may have here")
        folder = parent
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: {folder} is a file, not a directory")
    # (an output goes to a temporary file in its folder, then replaces the file: a folder that cannot be written
    # refused the result only after all the work, translate's decoding of a whole file among it)
    if writable and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: {folder} cannot be written (no permission, or a read-only file system)")
