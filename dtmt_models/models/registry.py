"""The one registry of NMT systems: `build_model(name, src_vocab_size, tgt_vocab_size, **options)`."""
from __future__ import annotations

from typing import Callable, Dict, List

import torch.nn as nn

from dtmt_models.errors import one_line

_MODELS: Dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    """Class decorator: makes the system buildable by name."""
    def wrap(cls):
        if name in _MODELS:
            raise ValueError(f"model {name!r} registered twice")
        _MODELS[name] = cls
        cls.model_name = name
        return cls
    return wrap


def list_models() -> List[str]:
    _import_systems()
    return sorted(_MODELS)


def build_model(name: str, src_vocab_size: int, tgt_vocab_size: int, **options) -> nn.Module:
    """Builds the system `name` (see list_models()); options are the keyword arguments of its class."""
    _import_systems()
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(_MODELS)}")
    for arg, v in (("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size)):
        if not isinstance(v, int) or v < 2:
            raise ValueError(f"{arg} must be an int >= 2, got {v!r}")
    return _MODELS[name](src_vocab_size, tgt_vocab_size, **options)


def _import_systems() -> None:
    # the systems register themselves on import
    from . import systems  # noqa: F401


def check_model_options(name: str, options: dict) -> None:
    """Raises ValueError, in one line, if `options` cannot build the system `name`: an unknown option, a value
    of the wrong type for the option's default, or a value the system refuses (the system is built on the meta
    device, so nothing is allocated). Call it before any expensive work."""
    import inspect

    import torch

    _import_systems()
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(_MODELS)}")
    params = {}
    for cls in _MODELS[name].__mro__:   # a subclass passing **kwargs on takes its base's options too
        if "__init__" not in vars(cls):
            continue
        sig = inspect.signature(cls.__init__).parameters
        for k, p in sig.items():
            if k not in ("self", "src_vocab_size", "tgt_vocab_size") and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                  p.KEYWORD_ONLY):
                params.setdefault(k, p)
        if not any(p.kind == p.VAR_KEYWORD for p in sig.values()):
            break
    for key, value in options.items():
        if key not in params:
            raise ValueError(f"unknown option {key!r} for {name}; its options are: {', '.join(sorted(params))}")
        default = params[key].default
        expected = type(default) if default is not inspect.Parameter.empty and default is not None else None
        ok = (expected is None or isinstance(value, expected) and not (expected is int and isinstance(value, bool))
              or expected is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"option {key}={value!r} for {name}: expected {expected.__name__} "
                             f"(default {default!r})")
    try:
        with torch.device("meta"):
            build_model(name, 8, 8, **options)
    except (ValueError, TypeError, RuntimeError, AssertionError) as exc:
        raise ValueError(f"{name} cannot be built with {options}: {one_line(exc)}") from None
