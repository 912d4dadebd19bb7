"""What every op's registration shares: its fake implementation checks first that all its tensors are on one
device (register_fake); a backward op refuses to be differentiated (refuse_double_backward).

Why the device check: a call with one argument on the meta device and the others on the CPU dispatches to the op's
fake (the meta key ranks first), which returned uninitialised tensors of the CPU arguments' device as the result (a
layer with a bias loaded onto the meta device gave values of 1e37, different at each call). torch's own ops refuse
it."""
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


def refuse_double_backward(op: str) -> None:
    """Registers an autograd formula for the backward op `op` that refuses, in one line naming the op, to be
    differentiated: a gradient of a gradient through the fused kernels. Without one, torch ran the op under
    create_graph=True with only a warning, and the second-order gradients were missing (None), with no error. A
    backward called with create_graph=True still works; only differentiating its result is refused, as torch's cuDNN
    RNN does. The reference backend (pure PyTorch) has second-order gradients."""
    name = op.split("::", 1)[-1]

    def backward(ctx, *grads):
        raise RuntimeError(f"dtmt::{name}: a gradient of a gradient (double backward) is not supported by the fused "
                           "kernels; run the layer with backend='reference' for second-order gradients")

    torch.library.register_autograd(op, backward)
