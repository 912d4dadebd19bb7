"""The systems registered so far, by name: filled by `@register_model` as each module of dtmt_models/models/systems/
is imported, read by registry.py (build_model, list_models). A leaf module, so that the systems and the registry do
not import each other."""
from __future__ import annotations

from typing import Callable, Dict

import torch.nn as nn

MODELS: Dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    """Class decorator: makes the system buildable by name (a non-empty str: another had been taken, and every later
    list_models() and get_preset() failed in sorting the names)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_model: the name must be a non-empty str, got {name!r}")

    def wrap(cls):
        if name in MODELS:
            raise ValueError(f"model {name!r} registered twice")
        MODELS[name] = cls
        cls.model_name = name
        return cls
    return wrap
