"""A model's train / eval modes, for code that runs a model in eval mode for a while and hands it back as it was
(decoding, the attention analysis): models, not decoding, so that analysis does not import the decoders."""
from __future__ import annotations

import contextlib
from typing import Iterator

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


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """`model` (an nn.Module; anything else is left alone) in eval mode for the block; afterwards every module has
    the mode it had before, so a member already in eval mode stays so whatever its parent's mode was (Module.train
    would set them all). The modes are restored as flags: a module overriding train() is not called again."""
    if not isinstance(model, torch.nn.Module) or not any_training(model):   # (the usual case: nothing to walk)
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
