"""How the package turns an exception from a library (torch, SentencePiece, the OS) into its own one-line
messages."""
from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its lines joined with " | "; the type's name if it has none)."""
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


class UsageError(ValueError):
    """A command-line option, its value or a file it names that cannot work, found before any work is done: a
    command prints it as one line and exits with status 2 (SPEC §6), as argparse does for its own errors. Problems
    found in the data itself while working (a line that is not UTF-8, files of different lengths) are not this:
    those exit with status 1."""


def check_input_file(path: str, option: str = "", noun: str = "file") -> None:
    """A file a command will read, named by `option` (empty for a positional argument): UsageError, before any
    work, if it is a directory or does not exist ("--src F: is a directory, not a file"; noun "checkpoint file":
    "... not a checkpoint file")."""
    import os

    where = f"{option} {path}" if option else path
    if os.path.isdir(path):
        raise UsageError(f"{where}: is a directory, not {'an' if noun[0] in 'aeiou' else 'a'} {noun}")
    if not os.path.isfile(path):
        raise UsageError(f"{where}: no such {noun}")
