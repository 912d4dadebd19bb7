"""Progress of long work (training, translation) on stderr: a live tqdm bar on a terminal, plain lines in a log.

    progress = Progress("auto", desc="dtmt translate", unit="sentence", every=60)
    progress.show(done, total, status="12.3 sentences/s", line="dtmt translate: 40/100 sentences")
    progress.message("saved last.pt")        # a line that stays (above the bar)
    progress.close()

Modes: "bar" (tqdm), "lines" (`line` printed, at most once every `every` seconds), "none" (no bar or lines; the
messages still printed: they are results, e.g. a validation's scores), "silent" (nothing at all: `dtmt translate
--quiet`, the processes other than the first under DDP), "auto" (a bar when the stream is a terminal, else lines).
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from tqdm import tqdm

MODES = ("auto", "bar", "lines", "none", "silent")


def counted(n: int, noun: str, nouns: Optional[str] = None) -> str:
    """`n` and its noun in number: "1 batch", "2 batches" (`nouns`: the plural, default noun + "s")."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


class Progress:
    def __init__(self, mode: str = "auto", desc: str = "", unit: str = "it", every: float = 0.0,
                 stream: Optional[TextIO] = None, line_stream: Optional[TextIO] = None,
                 message_stream: Optional[TextIO] = None):
        """stream: where the bar goes, and whose being a terminal "auto" asks (stderr); line_stream: where the
        lines go (default: stream); message_stream: where `message` writes (stdout)."""
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, got {mode!r}")
        self.stream = sys.stderr if stream is None else stream
        self.line_stream, self.message_stream = line_stream, message_stream
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "lines"
        self.mode, self.desc, self.unit, self.every = mode, desc, unit, every
        self.bar: Optional[tqdm] = None
        self.last_line = time.monotonic()   # lines: at most one every `every` seconds from the start

    def show(self, done: int, total: Optional[int] = None, status: str = "", line: Optional[str] = None) -> None:
        """Progress at `done` units (of `total` where known): the bar moves there and shows `status`; in lines
        mode `line` (when given) is printed, unless one was printed less than `every` seconds ago."""
        if self.mode == "bar":
            if self.bar is None:
                self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=self.stream, dynamic_ncols=True,
                                leave=False, mininterval=0.2, initial=done)
            elif total != self.bar.total:
                self.bar.total = total
            if status:
                self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(done - self.bar.n)
        elif self.mode == "lines" and line is not None:
            now = time.monotonic()
            if now - self.last_line >= self.every:
                self.last_line = now
                print(line, file=self.stream if self.line_stream is None else self.line_stream, flush=True)

    def message(self, text: str) -> None:
        """A line that stays: printed above the bar (or as a plain line), not in mode "silent"."""
        stream = sys.stdout if self.message_stream is None else self.message_stream
        if self.mode == "bar" and self.bar is not None:
            self.bar.write(text, file=stream)
        elif self.mode != "silent":
            print(text, file=stream, flush=True)

    def close(self) -> None:
        """Removes the bar (the messages stay)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


TICK_S = 30.0   # a Ticker's lines, at most one every this many seconds


class Ticker:
    """Progress of long work as log lines, at most one every TICK_S seconds (shorter work says nothing more):
    `tick(done)` logs "{what}: {done:,} of {total:,} {unit} ({percent}%)" (without a total, "{done:,} {unit}").
    For prepare's phases that read a whole corpus (copying it, encoding it): silent, they had looked hung for minutes
    on corpora of millions of pairs."""

    def __init__(self, log, what: str, total: Optional[int] = None, unit: str = "pairs"):
        self.log, self.what, self.total, self.unit, self.seconds = log, what, total, unit, TICK_S
        self.next = time.monotonic() + self.seconds

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.seconds
        of = f" of {self.total:,}" if self.total else ""
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        self.log(f"{self.what}: {done:,}{of} {self.unit}{share}")
