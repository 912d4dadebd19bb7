"""The one registry of compute backends and the dispatch rule for `backend="auto"`.

Every backend computes the same function, `transition_sequence(x, h0, weights, mask, drop, reverse, eps)
-> (out, h_n)` (see reference.py). An unavailable backend is an error that says why, never a silent
fallback to another one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

BACKEND_NAMES = ("auto", "reference", "cpp", "triton", "cuda")


@dataclass(frozen=True)
class Backend:
    name: str
    device_types: Tuple[str, ...]            # where its tensors may live
    dtypes: Tuple[torch.dtype, ...]          # input dtypes it accepts
    run: Callable                            # transition_sequence-compatible callable
    unavailable: Callable[[], Optional[str]]  # None when usable, else the reason it is not


_REGISTRY: Dict[str, Backend] = {}
_AUTO_ORDER = {"cpu": ("cpp",), "cuda": ("cuda", "triton")}


def register_backend(backend: Backend) -> None:
    _REGISTRY[backend.name] = backend


def available_backends() -> List[str]:
    """Names of the backends usable in this process (e.g. ["reference", "cpp"])."""
    return [name for name, b in _REGISTRY.items() if b.unavailable() is None]


def check_backend_name(name: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    return name


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend that runs `name` for tensors on `device`, or a ValueError saying why none can."""
    check_backend_name(name)
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ()):
            b = _REGISTRY.get(candidate)
            if b is not None and b.unavailable() is None:
                return b
        raise ValueError(
            f"backend='auto' found no fused backend for {device.type} tensors "
            f"(available: {available_backends()}); pass backend='reference' to run the pure-PyTorch cells")
    b = _REGISTRY.get(name)
    reason = "it is not implemented in this build" if b is None else b.unavailable()
    if reason is not None:
        raise ValueError(f"backend {name!r} is not available: {reason}")
    if device.type not in b.device_types:
        raise ValueError(f"backend {name!r} runs on {'/'.join(b.device_types)} tensors, got tensors on {device}")
    return b


def _register_builtin() -> None:
    from . import autograd, reference

    register_backend(Backend(
        name="reference", device_types=("cpu", "cuda"),
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        run=reference.transition_sequence, unavailable=lambda: None))
    register_backend(Backend(
        name="cpp", device_types=("cpu",), dtypes=(torch.float32, torch.float64),
        run=autograd.cpp_transition_sequence,
        unavailable=lambda: None if autograd._C is not None else
        f"the C++ extension dtmt_kernels._C did not import ({autograd._IMPORT_ERROR}); "
        "build it with `pip install --no-build-isolation -e .`"))


_register_builtin()
