"""The one registry of compute backends and the dispatch rule for `backend="auto"`.

Every backend computes the same function, `transition_sequence(x, h0, weights, mask, drop, reverse, eps)
-> (out, h_n)` (see ops/transition/reference.py); the fused ones through the custom ops of dtmt_kernels/ops/ (cpp and cuda: the
same op, torch.ops.dtmt.transition_forward, whose CPU and CUDA kernels the dispatcher picks by device; triton:
torch.ops.dtmt.transition_forward_triton). An unavailable backend is an error that says why, never a silent
fallback to another one.

Backends and where they run:

    reference   pure PyTorch (ops/transition/reference.py): CPU and CUDA, any floating dtype; the executable spec
    cpp         C++ CPU kernels (dtmt_kernels._C): CPU, float32 / float64, and float16 / bfloat16 (GEMMs in the
                16-bit dtype, states and layer-norm statistics in float32: what torch.autocast runs)
    triton      Triton kernels (dtmt_kernels/ops/transition/triton*.py): CUDA tensors, float16 / bfloat16 /
                float32 / float64.
                Available when triton imports and a CUDA device is present. With the environment variable
                TRITON_INTERPRET=1 (triton's CPU interpreter) it is available without a GPU and then also
                accepts CPU tensors: that is how its kernels are tested on machines without a GPU. The
                interpreter is slow (tiny sizes only) and `auto` never picks it for CPU tensors.
    cuda        CUDA C++ kernels (csrc/transition_cuda*.cu): CUDA tensors; present only when the extension
                was built against a CUDA torch (then `_C.has_cuda`; the kernels are those of
                torch.ops.dtmt.transition_forward for CUDA tensors)

`auto` picks cpp for CPU tensors and cuda, then triton, for CUDA tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
import importlib.util
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .ops._triton_mode import triton_interpreting

BACKEND_NAMES = ("auto", "reference", "cpp", "triton", "cuda")


@dataclass(frozen=True)
class Backend:
    name: str
    device_types: Tuple[str, ...]            # where its tensors may live
    dtypes: Tuple[torch.dtype, ...]          # input dtypes it accepts
    run: Callable                            # transition_sequence-compatible callable
    unavailable: Callable[[], Optional[str]]  # None when usable, else the reason it is not
    # where its tensors may live right now, when that depends on the environment (overrides device_types)
    device_types_now: Optional[Callable[[], Tuple[str, ...]]] = None

    def devices(self) -> Tuple[str, ...]:
        return self.device_types if self.device_types_now is None else self.device_types_now()


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


class BackendSwitch:
    """Mixin of the modules that run on a chosen backend (the recurrent layers of nn.py, the attention
    modules of dtmt_models): a `backend` attribute checked against BACKEND_NAMES when set."""

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = check_backend_name(value)

    def __prepare_scriptable__(self):   # (torch.jit.script asks every module before it compiles one)
        raise RuntimeError(f"{type(self).__name__}: TorchScript (torch.jit.script) is not supported; use "
                           "torch.compile or torch.export")


def check_backend_available(name: str) -> str:
    """`name` (check_backend_name), or a ValueError saying why it cannot run in this process, on any device ("auto"
    always can: which backend it picks depends on the tensors' device)."""
    check_backend_name(name)
    b = _REGISTRY.get(name)
    reason = None if name == "auto" else "it is not implemented in this build" if b is None else b.unavailable()
    if reason is not None:
        raise ValueError(f"backend {name!r} is not available: {reason}")
    return name


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend that runs `name` for tensors on `device` (a torch.device or its name, "cpu", "cuda:0"), or a
    ValueError saying why none can."""
    if not isinstance(device, torch.device):   # (a name had been an AttributeError on .type)
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            said = str(exc).strip().splitlines()[0] if isinstance(exc, RuntimeError) else "not a device name"
            raise ValueError(f"resolve_backend: device {device!r} is not a device torch knows ({said})") from None
    check_backend_available(name)
    if device.type == "meta":   # (the advice below sent it to the reference backend, which refused meta too)
        raise ValueError("no backend runs meta tensors (shapes only, no values): move the module to cpu or cuda "
                         "(.to_empty(device=...) and load its weights) to run it")
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ()):
            b = _REGISTRY.get(candidate)
            if b is not None and b.unavailable() is None and device.type in b.devices():
                return b
        raise ValueError(
            f"backend='auto' found no fused backend for {device.type} tensors "
            f"(available: {available_backends()}); pass backend='reference' to run the pure-PyTorch cells")
    b = _REGISTRY[name]
    if device.type not in b.devices():
        raise ValueError(f"backend {name!r} runs on {'/'.join(b.devices())} tensors, got tensors on {device}")
    return b


_TRITON_IMPORT_ERROR: List[Optional[str]] = []   # [] until checked, then [None or the reason]


def _triton_import_error() -> Optional[str]:
    """None when triton imports (checked once, without importing it at dtmt_kernels' import), else why not."""
    if not _TRITON_IMPORT_ERROR:
        try:
            found = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):
            found = False
        reason = None if found else "the triton package is not installed (pip install triton)"
        if found:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
            except Exception as exc:  # pragma: no cover - broken installs only
                reason = f"triton did not import ({type(exc).__name__}: {exc})"
        _TRITON_IMPORT_ERROR.append(reason)
    return _TRITON_IMPORT_ERROR[0]


def _triton_unavailable() -> Optional[str]:
    if not (triton_interpreting() or torch.cuda.is_available()):
        return ("it needs a CUDA device (none is available; set TRITON_INTERPRET=1 to run the kernels in "
                "triton's CPU interpreter)")
    return _triton_import_error()


def _triton_devices() -> Tuple[str, ...]:
    """Where the triton backend's tensors may live: CUDA, plus CPU while TRITON_INTERPRET is set."""
    return ("cuda", "cpu") if triton_interpreting() else ("cuda",)


def _cpp_unavailable() -> Optional[str]:
    from .ops import _extension

    if _extension.built():
        return None
    return (f"the C++ extension dtmt_kernels._C did not import ({_extension.IMPORT_ERROR}); build it with "
            "`pip install --no-build-isolation -e .`")


def _cuda_unavailable() -> Optional[str]:
    from .ops import _extension

    if not _extension.built():
        return f"the extension dtmt_kernels._C did not import ({_extension.IMPORT_ERROR})"
    if not _extension._C.has_cuda:
        return ("dtmt_kernels._C was built without CUDA kernels (they are built when the installed torch has "
                "CUDA and nvcc is found; rebuild with `pip install --no-build-isolation -e .`)")
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def _reference_sequence(x, h0, weights, mask, drop, reverse, eps):
    """reference.transition_sequence as a backend: under torch.autocast its out in the autocast dtype, as the fused
    ops' autocast rule returns it (ops/_autocast.py: low_precision_rule; h_n stays float32 in both), so that
    switching a layer's backend does not change its output's dtype."""
    from . import reference
    from .ops._autocast import autocast_dtype

    low = autocast_dtype(x)
    if low is not None:   # (the fused rule's: the state in float32, whatever h0 came in as)
        h0 = h0.float()
    out, h_n = reference.transition_sequence(x, h0, weights, mask, drop, reverse, eps)
    return (out if low is None else out.to(low)), h_n


def _register_builtin() -> None:
    from .ops.transition import fused_sequence

    register_backend(Backend(
        name="reference", device_types=("cpu", "cuda"),
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        run=_reference_sequence, unavailable=lambda: None))
    fused = fused_sequence(torch.ops.dtmt.transition_forward) if _cpp_unavailable() is None else None
    register_backend(Backend(
        name="cpp", device_types=("cpu",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), run=fused,
        unavailable=_cpp_unavailable))
    register_backend(Backend(
        name="triton", device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        run=fused_sequence(torch.ops.dtmt.transition_forward_triton), unavailable=_triton_unavailable,
        device_types_now=_triton_devices))
    register_backend(Backend(
        name="cuda", device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), run=fused,
        unavailable=_cuda_unavailable))


_register_builtin()
