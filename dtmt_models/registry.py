"""The one registry of NMT systems: `build_model(name, src_vocab_size, tgt_vocab_size, **options)`."""
from __future__ import annotations

from typing import Callable, Dict, List

import torch.nn as nn

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
