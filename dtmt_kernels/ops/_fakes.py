"""Registration of the ops' fake implementations, with the one check every fake makes first: all its tensors on one
device.

Why: a call with one argument on the meta device and the others on the CPU dispatches to the op's fake (the meta
key ranks first), which returned uninitialised tensors of the CPU arguments' device as the result (a layer with a
bias loaded onto the meta device gave values of 1e37, different at each call). torch's own ops refuse it."""
from __future__ import annotations

import functools

import torch


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def check_one_device(op: str, args) -> None:
    """RuntimeError naming `op` unless every non-empty tensor of `args` (lists and tuples looked into) is on one device.
    Empty tensors are skipped: they stand for absent arguments, read by no kernel."""
    devices = {t.device for t in _tensors(args) if t.numel()}
    if len(devices) > 1:
        raise RuntimeError(f"dtmt::{op}: every tensor must be on one device, got {sorted(str(d) for d in devices)}")


def register_fake(op: str, fake) -> None:
    """torch.library.register_fake(op)(fake), the fake first checking its tensors' device (check_one_device)."""
    name = op.split("::", 1)[-1]

    @functools.wraps(fake)
    def checked(*args, **kwargs):
        check_one_device(name, (args, tuple(kwargs.values())))
        return fake(*args, **kwargs)

    torch.library.register_fake(op)(checked)
