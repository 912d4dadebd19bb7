"""How the dtmt ops behave under torch.autocast (contract §3: 16-bit compute, float32 accumulation, layer-norm
statistics and state). Each op's folder registers one rule here for its forward op, for the CPU and CUDA autocast
dispatch keys; a rule casts the op's inputs and runs the op with autocast off (backward ops need none: autograd
calls them with the dtypes their forward saw).

    low_precision_rule   the transition ops: x, mask, dropout and the parameters in the autocast dtype (GEMMs in
                         it, float accumulation; the kernels keep states and layer-norm statistics in float32), h0
                         in float32, so that h_n, the state carried to the next call, stays float32
    float32_rule         everything else: attention scores and context (tanh, weighted sums: elementwise work, like
                         the softmax autocast keeps in float32), the small-row linear and the decode-step ops

Only autocast-eligible tensors are cast: floating point, not float64, on the autocast's device (torch's rule)."""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

_LIB = torch.library.Library("dtmt", "IMPL")
DEVICE_TYPES = ("cpu", "cuda")


def _eligible(t, device_type: str) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == device_type


def autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    """The autocast dtype of t's device while torch.autocast is on there and t is eligible, else None."""
    dev = t.device.type
    if dev not in DEVICE_TYPES or not _eligible(t, dev) or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def autocast_mix(dtypes: Iterable[torch.dtype], like: Tensor) -> bool:
    """Whether `dtypes` are what autocast leaves side by side on like's device while it is on there (float32 and
    the autocast dtype): the rules here then cast them, so the entry points' dtype checks let them through."""
    dtype = autocast_dtype(like)
    return dtype is not None and set(dtypes) <= {torch.float32, dtype}


def _cast(a, dtype: torch.dtype, device_type: str):
    if isinstance(a, (list, tuple)):
        return type(a)(_cast(t, dtype, device_type) for t in a)
    return a.to(dtype) if _eligible(a, device_type) and a.dtype != dtype else a


def float32_rule(args: Sequence, dtype: torch.dtype, device_type: str) -> list:
    """Every eligible tensor (also those in tensor lists) to float32."""
    return [_cast(a, torch.float32, device_type) for a in args]


def low_precision_rule(args: Sequence, dtype: torch.dtype, device_type: str) -> list:
    """transition_forward's arguments (x, h0, mask, drop, kind, ten parameters, reverse, eps) or transition_encode's
    (x, h0, mask, kind, the parameters' list, reverse, eps): h0 to float32, the other tensors to the autocast dtype;
    a float64 x leaves the call as it is."""
    args = list(args)
    if not _eligible(args[0], device_type):
        return args
    cast = [_cast(a, dtype, device_type) for a in args]
    cast[1] = _cast(args[1], torch.float32, device_type)
    return cast


def register(qualname: str, rule: Callable[[Sequence, torch.dtype, str], list]) -> None:
    """Registers `rule` as the op's kernel under autocast on the CPU and on CUDA."""
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    for device_type in DEVICE_TYPES:
        def kernel(*args, _device_type=device_type, **kwargs):   # keyword arguments (flags, eps) pass as they are
            dtype = torch.get_autocast_dtype(_device_type)
            cast = rule(args, dtype, _device_type)
            with torch.autocast(_device_type, enabled=False):
                return op(*cast, **kwargs)

        _LIB.impl(name, kernel, "Autocast" + ("CPU" if device_type == "cpu" else "CUDA"))
