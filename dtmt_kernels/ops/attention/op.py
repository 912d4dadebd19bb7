"""The additive-attention ops of one decoder step as torch.library custom ops (C++ CPU kernels,
csrc/attention_cpu.cpp): fakes and autograd. reference.additive_scores / reference.attention_context are what
they compute.

    torch.ops.dtmt.additive_scores(keys [B, S, NH, D], query [B, NH, D], v [NH, D]) -> scores [B, NH, S]
    torch.ops.dtmt.attention_context(alpha [B, NH, S], values [B, S, C]) -> context [B, C]
        (values may be a view whose last dimension is contiguous; it is read in place)
and their backward ops (additive_scores_backward -> (dkeys, dquery, dv); attention_context_backward ->
(dalpha, dvalues), dvalues empty when values_grad is false)."""
from __future__ import annotations

import torch

from .._extension import built
from .. import _autocast
from .._register import (FLOAT32_64, check_fake_dtypes, check_fake_sizes, refuse_double_backward, register_autograd,
                         register_fake)


def _dense_like(t):
    """A fresh tensor shaped as t, laid out as the C++ kernels lay out their result for it: t's strides when its
    last dimension is contiguous, else contiguous."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return torch.empty_like(t)


def _check_scores(op, keys, query, v):
    """What the scores' shapes rest on, checked as the kernel checks it (a meta call with a query or v of other
    sizes gave scores of the keys' without a word). Returns (B, S, NH)."""
    check_fake_sizes(op, keys=(keys, [None] * 4))
    B, S, NH, D = keys.shape
    check_fake_sizes(op, query=(query, [B, NH, D]), v=(v, [NH, D]))
    check_fake_dtypes(op, FLOAT32_64, keys=keys, q=query, v=v)
    return B, S, NH


def _scores_fake(keys, query, v):
    B, S, NH = _check_scores("additive_scores", keys, query, v)
    return keys.new_empty(B, NH, S)


def _scores_backward_fake(grad, keys, query, v):
    B, S, NH = _check_scores("additive_scores_backward", keys, query, v)
    check_fake_sizes("additive_scores_backward", grad=(grad, [B, NH, S]))
    check_fake_dtypes("additive_scores_backward", FLOAT32_64, keys=keys, grad=grad)
    return (torch.empty_like(keys, memory_format=torch.contiguous_format),
            torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _scores_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scores_backward(ctx, grad):
    return torch.ops.dtmt.additive_scores_backward(grad, *ctx.saved_tensors)


def _check_context(op, alpha, values):
    """What the context's shapes rest on, checked as the kernel checks it. Returns (B, C)."""
    check_fake_sizes(op, alpha=(alpha, [None] * 3))
    B, NH, S = alpha.shape
    check_fake_sizes(op, values=(values, [B, S, None]))
    if NH == 0 or values.shape[2] % NH:
        raise RuntimeError(f"dtmt::{op}: values' C = {values.shape[2]} must be a multiple of alpha's NH = {NH}")
    check_fake_dtypes(op, FLOAT32_64, alpha=alpha, values=values)
    return B, values.shape[2]


def _context_fake(alpha, values):
    B, C = _check_context("attention_context", alpha, values)
    return values.new_empty(B, C)


def _context_backward_fake(grad, alpha, values, values_grad=True):
    B, C = _check_context("attention_context_backward", alpha, values)
    check_fake_sizes("attention_context_backward", grad=(grad, [B, C]))
    check_fake_dtypes("attention_context_backward", FLOAT32_64, values=values, grad=grad)
    dalpha = torch.empty_like(alpha, memory_format=torch.contiguous_format)
    return dalpha, (_dense_like(values) if values_grad else values.new_empty(0))


def _context_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _context_backward(ctx, grad):
    alpha, values = ctx.saved_tensors
    dalpha, dvalues = torch.ops.dtmt.attention_context_backward(grad, alpha, values, ctx.needs_input_grad[1])
    return dalpha, (dvalues if ctx.needs_input_grad[1] else None)


def _register() -> None:
    if not built():
        return
    register_fake("dtmt::additive_scores", _scores_fake)
    register_fake("dtmt::additive_scores_backward", _scores_backward_fake)
    register_autograd("dtmt::additive_scores", _scores_backward, setup_context=_scores_setup)
    register_fake("dtmt::attention_context", _context_fake)
    register_fake("dtmt::attention_context_backward", _context_backward_fake)
    register_autograd("dtmt::attention_context", _context_backward, setup_context=_context_setup)
    for op in ("dtmt::additive_scores", "dtmt::attention_context"):
        _autocast.register(op, _autocast.float32_rule)
        refuse_double_backward(op + "_backward")


_register()
