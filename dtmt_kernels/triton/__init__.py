"""Triton backend: fused deep transition block (GRU / L-GRU / LAU + T-GRUs) and ATR, forward and backward.

Importing this package never imports triton: `unavailable_reason()` says whether the backend can run here,
and `transition_sequence` imports the kernels on first use. See ops.py for the algorithm and kernels.py for
the kernels.

Devices: CUDA tensors normally. With TRITON_INTERPRET=1 in the environment, triton's interpreter runs the
kernels on the host, so the backend then also accepts CPU tensors (slow: for tests at small sizes only).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

_TRUE = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether triton kernels decorated now would run in the interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


_IMPORT_ERROR: Optional[str] = None
_CHECKED = False


def _triton_import_error() -> Optional[str]:
    global _IMPORT_ERROR, _CHECKED
    if not _CHECKED:
        _CHECKED = True
        try:
            found = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            _IMPORT_ERROR = "the triton package is not installed (pip install triton)"
        else:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
            except Exception as exc:  # pragma: no cover - broken installs only
                _IMPORT_ERROR = f"triton did not import ({type(exc).__name__}: {exc})"
    return _IMPORT_ERROR


def unavailable_reason() -> Optional[str]:
    """None when the Triton backend can run in this process, else why not."""
    import torch

    if not (interpreting() or torch.cuda.is_available()):
        return ("it needs a CUDA device (none is available; set TRITON_INTERPRET=1 to run the kernels in "
                "triton's CPU interpreter)")
    return _triton_import_error()


def device_types() -> tuple:
    """Where the backend's tensors may live: CUDA, plus CPU while TRITON_INTERPRET is set."""
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def transition_sequence(x, h0, weights, mask=None, drop=None, reverse=False, eps=1e-5):
    """Same contract as reference.transition_sequence, computed by the Triton kernels."""
    from .ops import triton_transition_sequence

    return triton_transition_sequence(x, h0, weights, mask, drop, reverse, eps)


__all__ = ["interpreting", "unavailable_reason", "device_types", "transition_sequence"]
