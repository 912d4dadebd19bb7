"""The C allocator's settings for a training process (glibc only).

A training update allocates tens of MB for the tensors its backward needs (every decoder step's saved rows, the
logits, the encoder's buffers) and frees them during the backward. glibc's malloc by default gives the top of its
heap back to the system once more than a small, self-adjusting amount there is free, and serves blocks above
its mmap threshold with a fresh mmap each time: either way the next update touches new pages and pays a page fault
(and the kernel's zeroing) for every 4 KiB of them. `tune_malloc` keeps freed memory in the process for the next
update instead: blocks up to 256 MiB come from the heap, and the heap is trimmed only when over 1 GiB of its top is
free. The peak memory stays about the same; memory freed after the peak stays with the process, ready for reuse.
(docs/design/training.md, "Allocator", has the timings.)

`dtmt train` calls it once, before the model is built. DTMT_MALLOC=default in the environment leaves glibc's own
behaviour, as do MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_ set by the user (their
settings stand); elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's <malloc.h>
MMAP_THRESHOLD = 256 << 20
FALLBACK_MMAP_THRESHOLD = 32 << 20            # the largest every glibc accepts on 64-bit systems
TRIM_THRESHOLD = 1 << 30
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _glibc():
    """The process's C library where it is glibc (it has gnu_get_libc_version and mallopt), else None."""
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):   # no process-wide C library handle (Windows)
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def tune_malloc() -> bool:
    """Sets glibc's mmap and trim thresholds for training (module docstring); True where they were set, False
    where the environment opts out (DTMT_MALLOC=default, or the user's own MALLOC_* settings) or the C library is
    not glibc. Process-wide and not undone: for a process that trains."""
    asked = os.environ.get("DTMT_MALLOC", "").strip().lower()
    if asked == "default":
        return False
    if asked:   # (DTMT_MALLOC=off was taken as unset without a word: the thresholds were set)
        import warnings

        warnings.warn(f"DTMT_MALLOC={os.environ['DTMT_MALLOC']!r} is not a setting: 'default' leaves glibc's own "
                      f"behaviour; unset, training's thresholds are set (as now)", stacklevel=2)
    if any(name in os.environ for name in USER_VARIABLES):
        return False
    libc = _glibc()
    if libc is None:
        return False
    if not any(libc.mallopt(M_MMAP_THRESHOLD, v) for v in (MMAP_THRESHOLD, FALLBACK_MMAP_THRESHOLD)):
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
