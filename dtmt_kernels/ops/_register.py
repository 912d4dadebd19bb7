"""What every op's registration shares: its fake implementation checks first that all its tensors are on one
device (register_fake); a backward op refuses to be differentiated (refuse_double_backward); a call under
forward-mode AD or torch.func's gradient transforms is refused (check_transforms).

Why the device check: a call with one argument on the meta device and the others on the CPU dispatches to the op's
fake (the meta key ranks first), which returned uninitialised tensors of the CPU arguments' device as the result (a
layer with a bias loaded onto the meta device gave values of 1e37, different at each call). torch's own ops refuse
it."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._library import custom_ops as _custom_ops


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def check_one_device(op: str, args) -> None:
    """RuntimeError naming `op` unless every non-empty tensor of `args` (lists and tuples looked into) is on one device.
    Empty tensors are skipped (they stand for absent arguments, read by no kernel), except where one is on the meta
    device: then every tensor counts (an empty meta bias, or a meta tensor among CPU tensors all empty, sent a CPU
    call to the fake, which returned uninitialised CPU tensors as the result)."""
    tensors = list(_tensors(args))
    meta = any(t.device.type == "meta" for t in tensors)
    devices = {t.device for t in tensors if meta or t.numel()}
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


def check_fake_sizes(op: str, **shapes) -> None:
    """The fakes' share of the kernels' size checks (a fake is all that a meta call or a torch.compile / export trace
    runs): each tensor of `shapes` (name=(tensor, [sizes]), None a size not checked) of those sizes. RuntimeError
    naming the op and the argument, as the kernels' (dtmt_models/engine/ops.py's fakes check theirs alike)."""
    for name, (t, sizes) in shapes.items():
        if t.dim() != len(sizes) or any(want is not None and got != want for got, want in zip(t.shape, sizes)):
            shown = ", ".join("?" if want is None else str(want) for want in sizes)
            raise RuntimeError(f"dtmt::{op}: {name} must be [{shown}], got {list(t.shape)}")


FLOAT32_64 = (torch.float32, torch.float64)


def check_fake_dtypes(op: str, allowed, **tensors) -> None:
    """The fakes' share of the kernels' dtype checks: every tensor of `tensors` (name=tensor) of the first one's
    dtype, and that one of `allowed`. RuntimeError naming the op and the argument (a meta call or a trace took
    dtypes the kernel refuses, which failed only when run)."""
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != ref.dtype:
            raise RuntimeError(f"dtmt::{op}: {name} is {t.dtype} but {first} is {ref.dtype}; give them one dtype")
    if ref.dtype not in allowed:
        raise RuntimeError(f"dtmt::{op}: takes {' or '.join(str(d).replace('torch.', '') for d in allowed)} "
                           f"tensors, got {ref.dtype}")


_libraries = []   # the fragments holding register_autograd's kernels (a Library unregisters when collected)


def register_autograd(op: str, backward, setup_context) -> None:
    """torch.library.register_autograd(op, backward, setup_context=setup_context); for an op defined in C++ (whose
    arguments must then be positional, without defaults: checked here) the same autograd.Function without torch's
    per-call overhead: the forward redispatched below autograd, `setup_context(ctx, inputs, output)`,
    `backward(ctx, *grads)` with ctx.needs_input_grad over the op's arguments. An op defined in Python
    (torch.library.custom_op: the Triton ones) has its own Autograd kernel, and gets torch's registration.

    Why not torch's: its kernel calls torch._library.utils.fill_defaults on every forward that records a graph, which
    reads schema.arguments (rebuilt at each access) once per argument, quadratic in their number: for
    transition_forward's 17 it was the largest piece of a small layer's host time a call, which on a GPU is what an
    eager forward at B = 1 waits on. With no defaults, what it fills is what the call passed."""
    if op in _custom_ops.OPDEFS:
        torch.library.register_autograd(op, backward, setup_context=setup_context)
        return
    overload = torch._library.utils.lookup_op(op)
    arguments = overload._schema.arguments
    if any(a.kwarg_only or a.has_default_value() for a in arguments):
        raise AssertionError(f"{op}: register_autograd takes ops whose arguments are positional without defaults "
                             f"(torch.library.register_autograd for the others): {overload._schema}")
    namespace, name = op.split("::", 1)
    below = torch._C._after_autograd_keyset

    def forward(ctx, *args):   # the op's arguments, then the dispatch keys
        with torch._C._AutoDispatchBelowAutograd():
            output = overload.redispatch(args[-1] & below, *args[:-1])
        setup_context(ctx, args[:-1], output)
        return output

    def backward_keys(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:-1]
        try:
            grads = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (*grads, None) if isinstance(grads, tuple) else (grads, None)

    function = type(f"{namespace}_{name}_Backward", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_keys)})

    def kernel(keys, *args):
        if _forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None:
            check_transforms(name, *_tensors(args))   # (a direct call's tangent was dropped: a silent zero)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(*args, keys)
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keys & below, *args)

    library = torch.library.Library(namespace, "FRAGMENT")
    library.impl(name, kernel, "Autograd", with_keyset=True)
    _libraries.append(library)


def refuse_double_backward(op: str) -> None:
    """Registers an autograd formula for the backward op `op` that refuses, in one line naming the op, to be
    differentiated: a gradient of a gradient through the fused kernels. Without one, torch ran the op under
    create_graph=True with only a warning, and the second-order gradients were missing (None), with no error. A
    backward called with create_graph=True still works; only differentiating its result is refused, as torch's cuDNN
    RNN does. The reference backend (pure PyTorch) has second-order gradients."""
    message = _double_backward_refused(op.split("::", 1)[-1])

    def backward(ctx, *grads):
        raise RuntimeError(message)

    torch.library.register_autograd(op, backward)


def _double_backward_refused(op: str) -> str:
    return (f"dtmt::{op}: a gradient of a gradient (double backward) is not supported by the fused kernels; run the "
            "layer with backend='reference' for second-order gradients")


def first_order_only(op: str):
    """An autograd.Function's backward decorator: torch's once_differentiable (the backward runs without recording),
    with the refusal of refuse_double_backward. torch's attaches its error only where the incoming gradients require
    grad, and otherwise returns the gradients as constants: a gradient taken with create_graph=True through a step of
    an `unrolled` block (a loss linear in the states) lost its dependence on the weights and the inputs, and its
    gradient (a gradient penalty's) was silently wrong. Here the error is attached wherever the Function had an
    input that needed a gradient; a backward with create_graph=True still runs, and only differentiating its
    result raises."""
    message = _double_backward_refused(op).encode()

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(ctx, *args):
            with torch.no_grad():
                outputs = fn(ctx, *args)
            if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
                return outputs
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)

            def failing(value):   # (an alias that requires grad, so that the error node has an input to hang on)
                if value is None:
                    return None
                value = value.detach()
                value.requires_grad = True
                return value

            # the node hangs on what the gradients depend on too (the incoming gradients, the tensors the Function
            # saved, an unrolled session's live weights or values): on the aliases alone, torch.autograd.grad of a
            # gradient with respect to the weights or inputs never reached it and answered None (allow_unused)
            # (the saved tensors read again only for an unrolled session's Functions, which saved-tensor hooks turn
            # off: under a non-reentrant checkpoint a second read is refused, and the loss's saves need no gradient)
            session = getattr(ctx, "steps", None)
            saved = ctx.saved_tensors if session is not None else ()
            extra = [t for t in _tensors((args, saved, getattr(session, "live", ()))) if t.requires_grad]
            return torch._C._functions.DelayedError(message, len(outputs) + len(extra))(
                *[failing(v) for v in outputs], *extra)[:len(outputs)]

        return wrapper

    return decorate


def transformed(*tensors) -> Optional[str]:
    """What a call on `tensors` (None entries skipped) cannot give: "forward" where one carries a forward-mode tangent
    (torch.autograd.forward_ad, torch.func.jvp / jacfwd), "grad" where torch.func's gradient transforms (grad, vjp,
    jacrev, hessian) track one (_tracked); else None. Nothing under torch.compile (the transforms are traced there,
    not here)."""
    if torch.compiler.is_compiling():
        return None
    if _forward_ad._current_level >= 0 and any(t is not None and _forward_ad.unpack_dual(t).tangent is not None
                                               for t in tensors):
        return "forward"
    if torch._C._functorch.peek_interpreter_stack() is None:
        return None
    if any(t is not None and _tracked(t) for t in tensors):
        return "grad"
    return None


def _tracked(t: torch.Tensor) -> bool:
    """Whether a torch.func gradient transform tracks `t` at some level of its wrapping (a tensor made inside the
    transform, a frozen layer's state or biases, is wrapped too but tracked by none: the op is a constant there)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_gradtrackingtensor(t) and t.requires_grad:
            return True
        t = functorch.get_unwrapped(t)
    return False


def check_transforms(op: str, *tensors) -> None:
    """RuntimeError naming `op` where `transformed(*tensors)`: the ops' autograd formulas are reverse-mode ones
    (torch.library.register_autograd, autograd.Function without setup_context), so a forward-mode tangent passed
    through an op as through a constant (a silent zero or None), and torch.func.grad failed with torch's message on
    autograd.Function. The reference backend (pure PyTorch) supports both."""
    kind = transformed(*tensors)
    if kind == "forward":
        raise RuntimeError(f"dtmt::{op}: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not "
                           "supported by the fused kernels; run the layer with backend='reference' for it")
    if kind == "grad":
        raise RuntimeError(f"dtmt::{op}: torch.func's gradient transforms (grad, vjp, jacrev, hessian) are not "
                           "supported by the fused kernels; use torch.autograd.grad or .backward(), or run the layer "
                           "with backend='reference'")
