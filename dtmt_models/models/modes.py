"""A model's train / eval modes, for code that runs a model in eval mode (decoding, the attention analysis) without
switching the caller's: models, not decoding, so that analysis does not import the decoders."""
from __future__ import annotations

import torch


def any_training(model: torch.nn.Module) -> bool:
    """Whether the model or any module under it is in training mode (Module.modules()'s walk without its names
    and memo: this runs for every decoding call, a sentence at a time under `dtmt serve`)."""
    stack = [model]
    while stack:
        m = stack.pop()
        if m.training:
            return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


def eval_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `model`'s module tree in eval mode: each module copied once (a module standing in two places
    is one copy in both), parameters, buffers and hooks shared, `model` and its modules untouched. So a decoder
    made from it keeps eval mode whatever is done to `model` later (model.train()), and decoding never switches the
    modes of a model that another thread may be training."""
    memo = {}

    def copied(m: torch.nn.Module) -> torch.nn.Module:
        new = memo.get(id(m))
        if new is None:
            # (its __dict__ copied as copy.copy would, without the pickling protocol, which a parametrized module
            # refuses)
            new = memo[id(m)] = object.__new__(type(m))
            new.__dict__.update(m.__dict__)
            new.__dict__["_modules"] = {name: None if c is None else copied(c) for name, c in m._modules.items()}
        return new

    return copied(model).eval()


def in_eval_mode(model):
    """`model` where no module under it is in training mode, or anything but an nn.Module (a decoder object); else its
    eval_copy. What decoding runs: a model in training mode decodes without dropout, and its own modules keep their
    modes, also while another thread trains it (a mode switched on the model for the call did not)."""
    if not isinstance(model, torch.nn.Module) or not any_training(model):   # (the usual case: nothing to copy)
        return model
    return eval_copy(model)
