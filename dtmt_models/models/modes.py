"""A model's train / eval modes, for code that runs a model in eval mode (decoding, the attention analysis) without
switching the caller's: models, not decoding, so that analysis does not import the decoders."""
from __future__ import annotations

import contextlib
import types
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


def copies_faithfully(model: torch.nn.Module) -> bool:
    """Whether eval_copy(model) computes as `model` in eval mode would: no TorchScript module under it (its mode lives
    in C++, which a copy shares), and no module holding a callable of its own that may reach the model (a method
    replaced on the instance by a wrapper, a closure, a partial, a compiled function), only methods bound to the
    module itself (rebound to the copy) and plain functions (an activation such as F.relu)."""
    for m in model.modules():
        if isinstance(m, torch.jit.ScriptModule):
            return False
        for v in m.__dict__.values():
            if (not callable(v) or isinstance(v, (torch.nn.Module, torch.Tensor, type, types.BuiltinFunctionType))
                    or (isinstance(v, types.MethodType) and v.__self__ is m)
                    or (isinstance(v, types.FunctionType) and v.__closure__ is None)):
                continue
            return False
    return True


def eval_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `model`'s module tree in eval mode: each module copied once (a module standing in two places
    is one copy in both), its methods bound on the instance rebound to the copy; parameters, buffers and hooks are
    the model's own (their dictionaries shared: one registered on the copy is registered on the model). The model's
    modes are left alone: a decoder made from the copy keeps eval mode whatever is done to the model later
    (model.train()), and decoding never switches the modes of a model that another thread may be training. For a
    model that copies_faithfully."""
    memo = {}

    def copied(m: torch.nn.Module) -> torch.nn.Module:
        new = memo.get(id(m))
        if new is None:
            # (its __dict__ copied as copy.copy would, without the pickling protocol, which a parametrized module
            # refuses)
            new = memo[id(m)] = object.__new__(type(m))
            new.__dict__.update(m.__dict__)
            for name, v in m.__dict__.items():
                if isinstance(v, types.MethodType) and v.__self__ is m:
                    new.__dict__[name] = types.MethodType(v.__func__, new)
            new.__dict__["_modules"] = {name: None if c is None else copied(c) for name, c in m._modules.items()}
        return new

    return copied(model).eval()


@contextlib.contextmanager
def evaluating(model) -> Iterator:
    """What to run `model` with in eval mode, for the block: `model` itself where no module under it is in training
    mode, or anything but an nn.Module (a decoder object); else its eval_copy, which leaves the model's modes alone
    (also for a thread training it meanwhile); else, for a model that does not copy faithfully (a TorchScript module,
    a method replaced on an instance: copies_faithfully), the model switched to eval mode for the block, each module's
    mode restored after (as flags: a module overriding train() is not called again), which another thread running
    the model meanwhile would see."""
    if not isinstance(model, torch.nn.Module) or not any_training(model):   # (the usual case: nothing to do)
        yield model
        return
    if copies_faithfully(model):
        yield eval_copy(model)
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training
