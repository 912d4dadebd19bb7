"""torch.ops.dtmt.smoothed_cross_entropy(logits [N, V], target [N], smoothing, ignore_index) -> (loss sum [], NLL sum
[], grad [N, V]): reference.smoothed_cross_entropy's two sums and the gradient of the loss sum to the logits, which
the op forms in its forward (csrc/loss_cpu.cpp: CPU, float32 / float64); its backward scales that gradient (in
place, the first time). The NLL sum and the gradient are statistics: nothing flows back through them.

`PortableSmoothedCrossEntropy` computes the same two sums on any device and dtype (in float32 at least) as one
autograd node that keeps the log-probabilities and writes the logits' gradient in one tensor."""
from __future__ import annotations

import torch
from torch import Tensor

from .._extension import built
from .._register import FLOAT32_64, check_fake_dtypes, check_fake_sizes, first_order_only, register_autograd, \
    register_fake
from .._host_reads import host_reads_allowed


def _fake(logits, target, smoothing, ignore_index):   # (the kernel's gradient is contiguous, as the logits it reads)
    check_fake_sizes("smoothed_cross_entropy", logits=(logits, [None, None]))
    check_fake_sizes("smoothed_cross_entropy", target=(target, [logits.shape[0]]))
    check_fake_dtypes("smoothed_cross_entropy", FLOAT32_64, logits=logits)
    check_fake_dtypes("smoothed_cross_entropy", (torch.int64,), target=target)
    if not 0.0 <= smoothing < 1.0:
        raise RuntimeError(f"dtmt::smoothed_cross_entropy: takes 0 <= smoothing < 1, got {smoothing}")
    return logits.new_empty(()), logits.new_empty(()), torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.grad = output[2].detach()   # not saved_tensors: the backward scales it in place, which their check forbids
    ctx.version = ctx.grad._version   # ... so it checks itself that nothing else changed it (the op returns it)
    ctx.set_materialize_grads(False)   # the outputs with no gradient (NLL, grad) get no [N, V] of zeros
    ctx.mark_non_differentiable(output[1], output[2])   # (they wanted a gradient, and a backward through them left
    # the logits' None, without a word)
    ctx.scaled_by = None


def _backward(ctx, grad_loss, _grad_nll, _grad_grad):
    if torch.is_grad_enabled():   # create_graph: the saved gradient has no graph of its own to the logits
        raise RuntimeError("dtmt.smoothed_cross_entropy: double backward (create_graph=True) is not supported")
    if grad_loss is None:
        return None, None, None, None
    grad = ctx.grad
    if type(grad_loss) is not torch.Tensor or not host_reads_allowed():   # traced (torch.compile, export), captured
        return grad * grad_loss, None, None, None
    if grad._version != ctx.version:   # (the op's third output, modified in place: the gradient was silently it)
        raise RuntimeError("dtmt.smoothed_cross_entropy: its grad output, which the backward reads, was modified in "
                           "place; clone it first")
    factor = float(grad_loss)
    if ctx.scaled_by is None:          # the first backward scales the saved gradient in place (no [N, V] copy)
        ctx.scaled_by = factor
        grad.mul_(factor)
        ctx.version = grad._version
        return grad, None, None, None
    if ctx.scaled_by == 0.0:
        raise RuntimeError("dtmt.smoothed_cross_entropy: a second backward (retain_graph) after one whose incoming "
                           "gradient was 0 is not supported")
    return grad * (factor / ctx.scaled_by), None, None, None   # again (retain_graph): equal up to rounding


if built():
    register_fake("dtmt::smoothed_cross_entropy", _fake)
    register_autograd("dtmt::smoothed_cross_entropy", _backward, setup_context=_setup)


class PortableSmoothedCrossEntropy(torch.autograd.Function):
    """(loss sum, NLL sum) of log_softmax(logits) [N, V] against target [N], rows of ignore_index left out.

    Forward keeps only the log-probabilities; backward writes the logits' gradient in one dense tensor:
    d loss / d z = w · (softmax(z) − (1 − ε) onehot(y) − ε / V), with w the incoming gradient on the kept rows
    and 0 on the others."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float, ignore_index: int):
        log_probs = torch.log_softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32))
        target = target.long()   # (an int32 target compared an ignore_index beyond int32 wrapped: 2**40 as 0)
        keep = target.ne(ignore_index)
        safe = torch.where(keep, target, 0)
        nll = -log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        smooth = -log_probs.mean(-1)
        loss = torch.where(keep, nll if smoothing == 0 else (1.0 - smoothing) * nll + smoothing * smooth, 0.0).sum()
        ctx.save_for_backward(log_probs, safe, keep)
        ctx.smoothing, ctx.logits_dtype = smoothing, logits.dtype
        nll_sum = torch.where(keep, nll, 0.0).sum()
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    @first_order_only("smoothed_cross_entropy_backward")
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        log_probs, target, keep = ctx.saved_tensors
        eps = ctx.smoothing
        grad = log_probs.exp()                                      # softmax, one pass
        grad.sub_(eps / log_probs.shape[-1])
        grad.scatter_add_(-1, target.unsqueeze(-1),
                          torch.full_like(target, -(1.0 - eps), dtype=grad.dtype).unsqueeze(-1))
        grad.mul_((keep.to(grad.dtype) * grad_loss).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None
