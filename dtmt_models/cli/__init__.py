"""The `dtmt` console script (contract §6): one entry point, one subcommand per job.

    dtmt prepare bible --out DIR                    dtmt prepare files --src F --tgt G --out DIR
    dtmt train --data DIR --model NAME [options]    dtmt translate --checkpoint C [FILE ...]
    dtmt evaluate --checkpoint C --data DIR --split test
    dtmt average --run RUN --last N -o AVG.pt       dtmt serve --checkpoint C [--port 8080]
    dtmt bench cells|train|decode|quality [options]
    dtmt models [--count] [--table 002-T4]

Each subcommand's command line (argparse, messages, exit codes) is a module of this package with a `main(argv)`
(so `python -m dtmt_models.cli.train ...` and `torchrun -m dtmt_models.cli.train ...` work too), over the
library functions of dtmt_models.data / training / decoding / models; this file only dispatches.
"""
from __future__ import annotations

import difflib
import importlib
import os
import signal
import sys
from typing import List, Optional

from dtmt_models.errors import diagnostics_never_fail

COMMANDS = {
    "prepare": ("dtmt_models.cli.prepare", "write a corpus (the embedded Bible, or your own files) to DIR"),
    "train": ("dtmt_models.cli.train", "train a system on a prepared corpus"),
    "translate": ("dtmt_models.cli.translate", "translate files or stdin with a checkpoint"),
    "evaluate": ("dtmt_models.cli.evaluate", "BLEU / chrF (and BLEU by source length) on a split"),
    "average": ("dtmt_models.cli.average", "average the weights of checkpoints of one run"),
    "serve": ("dtmt_models.cli.serve", "serve translations over HTTP (JSON API, batched requests)"),
    "bench": ("dtmt_models.cli.bench", "run the benchmarks in benchmarks/"),
    "models": ("dtmt_models.cli.models", "list the systems, their presets and the papers' table rows"),
}


def version() -> str:
    """The installed distribution's version (pyproject.toml's), or 'unknown' for a checkout not installed."""
    from importlib import metadata

    try:
        return metadata.version("dtmt")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def usage() -> str:
    lines = ["usage: dtmt <command> [options]   (dtmt <command> --help for the options; dtmt --version)", "",
             "commands:"]
    lines += [f"  {name:<10s} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with diagnostics_never_fail():   # (a stderr that cannot be written costs no output, no shutdown, no status)
        return _main(argv)


def _main(argv: List[str]) -> int:
    name = argv[0] if argv else ""
    try:
        try:
            status = _dispatch(argv)
        except SystemExit as exc:   # argparse's, a command's --help (0) or usage error (2): its output flushed
            if exc.code is not None and not isinstance(exc.code, int):   # below too (`--help > /dev/full` was 0)
                raise
            status = exc.code or 0
        if sys.stdout is not None:   # (None: started with stdout closed, `dtmt models >&-`)
            sys.stdout.flush()   # (here, where a reader gone is caught, not at the interpreter's exit)
        return status
    except BrokenPipeError:   # `dtmt models | head`: the reader of stdout left; quiet, with a writer's status then
        if sys.stdout is not None:
            _stdout_to_devnull()
        return 128 + signal.SIGPIPE
    except OSError as exc:   # one no command catches: stdout on a full disk (`dtmt models > /dev/full`, a traceback)
        print(f"dtmt{f' {name}' if name in COMMANDS else ''}: {_os_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # Ctrl-C where a command has no handler of its own (importing torch, say)
        print(f"\ndtmt {name}: interrupted", file=sys.stderr)
        return 130
    except MemoryError as exc:   # (a model too large for this machine: registry.build_model's, one line)
        print(f"dtmt {name}: out of memory{f': {exc}' if str(exc) else ''}", file=sys.stderr)
        return 1


def _dispatch(argv: List[str]) -> int:
    if argv and argv[0] in ("-h", "--help", "help", "-V", "--version") and sys.stdout is None:   # (`>&-`: exit 0,
        print(f"dtmt {argv[0]}: stdout is closed; nowhere to print", file=sys.stderr)             # nothing said)
        return 2
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"dtmt {version()}")
        return 0
    if not argv:   # no command: the usage, as an error (argparse's status for a missing argument)
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:   # (one line, as every other error: it was followed by the whole usage)
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"dtmt: unknown command {argv[0]!r}{f' (did you mean {close[0]!r}?)' if close else ''}; the commands: "
              f"{', '.join(COMMANDS)} (dtmt --help)", file=sys.stderr)
        return 2
    return int(importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]) or 0)


def _stdout_to_devnull() -> None:
    """Points stdout's descriptor at /dev/null: what its buffer still holds, which could not be written, goes
    nowhere at the interpreter's exit (which would otherwise print the error again as a traceback)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _os_error(exc: OSError) -> str:
    """An OSError that reached the dispatcher, in one line (its file where it names one). Where stdout's buffer
    still holds data it cannot write (the error came at the final flush), stdout goes to /dev/null."""
    if sys.stdout is not None:
        try:
            sys.stdout.flush()
        except OSError:
            _stdout_to_devnull()
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


if __name__ == "__main__":
    sys.exit(main())
