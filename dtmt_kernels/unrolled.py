"""The `unrolled` block: within it, the step modules that are `Unrollable` (dtmt_kernels.nn's step cells, the
attention modules of dtmt_models) run their steps as one unrolled sequence for autograd, each weight gradient
formed once over all steps; `step_context`, an attention step's context whose gradient to the annotations is formed
the same way. The autograd functions behind them are in autograd.py; dtmt_kernels.nn gives these names too
(`dk.nn.unrolled`, `dk.nn.Unrollable`, `dk.nn.step_context`)."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from .autograd import CppContextStepFunction, CppUnrolledValuesFunction, UnrolledContext
from .functional import attention_context, attention_kernels_run, check_attention_context
from .ops._register import check_transforms


class Unrollable:
    """Mixin of the modules whose per-step work `unrolled` batches over the steps of a block (the step cells
    below; the attention modules of dtmt_models)."""

    def _unrolled_sessions(self) -> Optional[dict]:
        """The sessions of the block the calling thread has open on this module when autograd is recording, else
        None. Under torch.compile / torch.export / torch.jit.trace the block is ignored (its sessions are Python
        state that a graph cannot hold; a trace failed with "unordered_map::at"), under torch.func's transforms
        (vmap: the sessions' Functions have no vmap rule), and under saved-tensor hooks (torch.utils.checkpoint's
        non-reentrant form recomputes a step at the backward, perhaps after the block has closed, and refuses a
        recomputation that saves other tensors; save_on_cpu): each step is then the plain op, whose gradients the
        graph, the transform or the checkpoint forms; and in a forward that runs during a backward
        (torch.utils.checkpoint's reentrant form recomputes its steps there: joining the block's sessions, their
        nested backward ran the shared weight sink and dropped the rows kept for the later steps, weight gradients
        off by up to 1.8)."""
        blocks = getattr(_THREAD, "blocks", None)
        if (not blocks or not torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing()
                or torch._C._functorch.peek_interpreter_stack() is not None
                or _saved_tensor_hooks_active() or torch._C._current_graph_task_id() != -1):
            return None
        return blocks.get(self)


def _hooks_getter():
    """torch's getter of the innermost saved-tensor hooks, as a function of no argument (private: it took none
    before torch 2.7 or so, and may be absent; then no hooks are seen)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return lambda: None
    try:
        top(False)
        return lambda: top(False)
    except TypeError:
        return top


_TOP_HOOKS = _hooks_getter()


def _saved_tensor_hooks_active() -> bool:
    return _TOP_HOOKS() is not None


# .blocks: the calling thread's open blocks, module -> its sessions (a WeakKeyDictionary). Kept off the modules, so
# that a copy or pickle of a module never carries autograd state, and each thread's forward passes through a shared
# module keep their own sessions; a thread's dictionary is its own (no lock), and goes with the thread.
_THREAD = threading.local()


@contextlib.contextmanager
def unrolled(*modules: nn.Module) -> Iterator[None]:
    """Within the block, the given modules and the modules inside them that are `Unrollable`
    (DeepTransitionGRUCell / ATRCell, the attention modules of dtmt_models: `unrolled(model)` opens all of a model's;
    anything else is ignored) run their steps as one unrolled sequence for
    autograd, the cells on the backends of UNROLLED_BACKENDS (cpp), the attention context on those of
    functional.ATTENTION_KERNEL_BACKENDS (cpp). A cell's flat
    weights are assembled once, and each weight gradient is one
    GEMM over every step's rows at backward instead of one GEMM and one accumulation per step
    (autograd.UnrolledSteps); an attention's context (`step_context`) forms the annotations' gradient once over
    all steps (autograd.UnrolledContext). Gradients are those of the plain step-by-step path up to float
    rounding. For teacher forcing, where a decoder cell runs once per target position:

        with dk.nn.unrolled(model.query_cell, model.decoder_cell):
            for t in range(T): ...

    Other backends, inference (no autograd recording) and calls outside the block are unaffected. The backward
    may run after the block has closed; a block may hold several forward / backward rounds (truncated
    backpropagation: a session ends when its backward has run or a parameter has changed: in place, as autograd
    sees it, or given new storage; a change through `.data` in place, which autograd does not see, may not be seen
    here either: the steps may read copies made when the session began). Under torch.func's transforms (vmap)
    and saved-tensor hooks (a non-reentrant torch.utils.checkpoint, save_on_cpu) the steps are the plain op.
    Blocks nest (the outer one holds). A block is the calling thread's: threads that run the same modules at once
    each have their own, and the gradients of each are those it would have alone."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():   # a compiled graph or a trace forms the weight
        # gradients itself (_unrolled_sessions)
        yield
        return
    blocks = getattr(_THREAD, "blocks", None)
    if blocks is None:
        blocks = _THREAD.blocks = weakref.WeakKeyDictionary()
    opened = []
    for given in modules:   # (a container given alone had opened nothing, without a word)
        for c in given.modules() if isinstance(given, nn.Module) else (given,):
            if isinstance(c, Unrollable) and c not in blocks:
                blocks[c] = {}
                opened.append(c)
    try:
        yield
    finally:   # (from this block's own dictionary: a generator holding the block may be closed on another thread)
        for c in opened:
            blocks.pop(c, None)


def step_context(owner: nn.Module, alpha: Tensor, values: Tensor, backend: str = "auto") -> Tensor:
    """dtmt_kernels.functional.attention_context for one decoder step of the attention module `owner`: inside an
    `unrolled` block open on `owner` (an Unrollable) with autograd recording, on a backend that runs the attention
    kernels (functional.ATTENTION_KERNEL_BACKENDS: cpp), the steps against the same values share one
    UnrolledContext (the values' gradient formed once over all of them); otherwise exactly
    functional.attention_context."""
    sessions = owner._unrolled_sessions() if isinstance(owner, Unrollable) else None
    if sessions is None or not attention_kernels_run(check_attention_context(alpha, values, backend), values):
        return attention_context(alpha, values, backend)
    check_transforms("attention_context", alpha, values)
    key = (id(values), alpha.shape[1])
    hit = sessions.get(key)
    if hit is None or hit[0].done or hit[0].version != values._version:
        steps = UnrolledContext(values)   # it keeps `values` alive: the id is not reused
        sessions[key] = hit = (steps, CppUnrolledValuesFunction.apply(steps, values))
    return CppContextStepFunction.apply(alpha, hit[1], hit[0])
