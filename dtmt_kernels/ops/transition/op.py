"""The transition op (deep transition block or ATR over a sequence, one direction) as torch.library custom ops:
the fake (meta) implementations and the one autograd definition shared by every backend's forward op.

    torch.ops.dtmt.transition_forward           C++: CPU kernels (csrc/transition_cpu.cpp), CUDA kernels
                                                (csrc/transition_cuda.cu) under the CUDA dispatch key
    torch.ops.dtmt.transition_forward_triton    the Triton kernels (triton.py)
    torch.ops.dtmt.transition_encode            inference (C++, CPU): one layer's one or two directions in one call
                                                (FrozenTransitionLayer), (x, h0 [D, B, H], mask, kind, the D x ten
                                                parameters, reverse, eps) -> (out [T, B, D*H], h_n [D, B, H])
    torch.ops.dtmt.transition_encode_tokens     the same from token ids and tables of their input products
                                                (FrozenTransitionLayer.encode_tokens), (tokens [T, B], table,
                                                position_table or None, h0, mask, kind, parameters, reverse, eps)

The two forward ops take (x [T, B, I], h0 [B, H], mask [T, B] or None, drop [D+1, B, H] or None, kind, the ten flat
parameters (`flat_params`: absent ones None or empty), reverse, eps) and return (out [T, B, H], h_n [B, H]) followed
by what their backward op reads: xp [T, B, n_in*H], hs [D+1, T, B, H] (the state entering each sub-cell, in the
accumulation dtype), hs_lp (hs in the input dtype for 16-bit inputs, else empty), hp [T, B, n_h*H], hpt [D, T, B,
3H]. Their backward ops return the twelve gradients (x, h0, then the ten parameters; empty for an absent parameter).
reference.transition_sequence (this folder) is the function all of them compute.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .._extension import built
from .. import _autocast
from .._register import check_transforms, refuse_double_backward, register_autograd, register_fake
from . import triton as _triton_launchers  # noqa: F401 - registers dtmt::transition_*_triton
from .layout import KINDS, ROWS, acc_dtype, check_mask, check_sequence, check_shapes, present
from .reference import TransitionWeights

PARAM_NAMES = ("w_ih", "b_ih", "w_hh", "b_hh", "ln_w", "ln_b", "t_w", "t_b", "t_ln_w", "t_ln_b")


def _stack(ts) -> Tensor:
    """torch.stack, without a copy for one tensor (depth 1)."""
    return ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts)


def flat_params(w: TransitionWeights) -> List[Optional[Tensor]]:
    """The ten parameter tensors in the ops' order (PARAM_NAMES: T-GRU parameters stacked to [D, ...], absent ones
    None)."""
    t_w = t_b = t_ln_w = t_ln_b = None
    if w.depth:
        t_w, t_b = _stack(w.t_w), _stack(w.t_b)
        if w.t_ln_w[0] is not None:
            t_ln_w, t_ln_b = _stack(w.t_ln_w), _stack(w.t_ln_b)
    return [w.w_ih, w.b_ih, w.w_hh, w.b_hh, w.ln_w, w.ln_b, t_w, t_b, t_ln_w, t_ln_b]


def _forward_fake_for(op: str):
    """The fake of forward op `op`: its kernels' argument checks (check_sequence, the C++ op's forms for the C++ op),
    then outputs of the kernels' shapes."""
    name, cpp = op.split("::")[-1], not op.endswith("_triton")

    def fake(x, h0, mask, drop, kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b, reverse, eps):
        check_sequence(name, x, h0, mask, drop, kind, eps, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w,
                       t_ln_b, cpp=cpp)
        return _forward_outputs(x, h0, kind, w_hh, t_w)

    return fake


def _forward_outputs(x, h0, kind, w_hh, t_w):
    T, B, _ = x.shape
    n_in, n_h, _ = ROWS[kind]
    H = w_hh.shape[0] // n_h
    D = t_w.shape[0] if present(t_w) else 0
    acc = acc_dtype(x.dtype)
    hs = x.new_empty(D + 1, T, B, H, dtype=acc)
    hs_lp = x.new_empty(D + 1, T, B, H) if acc != x.dtype else x.new_empty(0)
    return (x.new_empty(T, B, H), h0.new_empty(B, H), x.new_empty(T, B, n_in * H), hs, hs_lp,
            x.new_empty(T, B, n_h * H), x.new_empty(D, T, B, 3 * H))


def _backward_fake(grad_out, grad_hn, x, mask, drop, kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w,
                   t_ln_b, xp, hs, hs_lp, hp, hpt, reverse, eps, weight_grads=True):
    params = (w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b)
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format), grad_hn.new_empty(x.shape[1], w_hh.shape[1])]
    grads += [torch.empty_like(p, memory_format=torch.contiguous_format) if present(p) else x.new_empty(0)
              for p in params]
    if not weight_grads:   # the pre-activation gradients in the slots of dw_ih, dw_hh and dt_w (csrc/transition.h)
        N = x.shape[0] * x.shape[1]
        grads[2], grads[3] = x.new_empty(N, xp.shape[-1]), x.new_empty(0)
        grads[4], grads[5] = x.new_empty(N, hp.shape[-1]), x.new_empty(0)
        if present(t_w):
            grads[8] = x.new_empty(t_w.shape[0], N, hpt.shape[-1])
        grads[9] = x.new_empty(0)
    return grads


def _setup_context_for(op: str):
    """The setup_context of forward op `op` (one definition for every backend)."""
    name = op.split("::")[-1]

    def setup_context(ctx, inputs, output):
        refuse_mask_gradients(name, inputs[2], inputs[3])   # (a graph is being recorded: called only then)
        _setup_context(ctx, inputs, output)

    return setup_context


def _setup_context(ctx, inputs, output):
    x, h0, mask, drop, kind, *rest = inputs
    params, (reverse, eps) = rest[:10], rest[10:]
    _, _, *saved = output
    ctx.kind, ctx.reverse, ctx.eps = kind, reverse, eps
    ctx.shapes = (output[0].shape, output[1].shape, output[1].dtype)
    ctx.save_for_backward(x, mask, drop, *params, *saved)
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)   # no zeros for the saved outputs (hs alone is [D+1, T, B, H]); see backward


def _autograd_for(backward_op):
    """The backward of a forward op whose backward op is `backward_op`: one definition for every backend."""

    def backward(ctx, grad_out, grad_hn, *_saved_grads):
        x, mask, drop, *rest = ctx.saved_tensors
        out_shape, hn_shape, hn_dtype = ctx.shapes
        if grad_out is None:   # the one output without a gradient gets zeros (the backward op reads both)
            grad_out = x.new_zeros(out_shape)
        if grad_hn is None:
            grad_hn = x.new_zeros(hn_shape, dtype=hn_dtype)
        params, saved = rest[:10], rest[10:]
        grads = backward_op(grad_out, grad_hn, x, mask, drop, ctx.kind, *params, *saved, ctx.reverse, ctx.eps)
        dx, dh0, *dparams = grads
        dparams = [g if present(p) else None for g, p in zip(dparams, params)]
        return (dx, dh0, None, None, None, *dparams, None, None)

    return backward


def _check_encode_fake(op: str, x: Tensor, h0: Tensor, kind, params, tokens: bool = False) -> None:
    """check_shapes for each direction of an encode op (h0 [D, B, H], ten parameters a direction, or twelve with the
    row panels of w_hh and t_w)."""
    if h0.dim() != 3 or h0.shape[0] not in (1, 2):
        raise RuntimeError(f"dtmt::{op}: h0 must be [D, B, H] with D = 1 or 2 directions, got {list(h0.shape)}")
    D = h0.shape[0]
    if len(params) not in (10 * D, 12 * D):
        raise RuntimeError(f"dtmt::{op}: params must be ten a direction (twelve with row panels; {D} directions: "
                           f"h0 {list(h0.shape)}), got {len(params)}")
    per = len(params) // D
    for d in range(D):
        check_shapes(op, x, h0, kind, params[per * d], params[per * d + 2], params[per * d + 6], (D,), tokens)


def _encode_fake(x, h0, mask, kind, params, reverse, eps):
    _check_encode_fake("transition_encode", x, h0, kind, params)
    check_mask("transition_encode", mask)
    D, B, H = h0.shape
    return x.new_empty(x.shape[0], B, D * H), h0.new_empty(D, B, H)


def _encode_tokens_fake(tokens, table, position_table, h0, mask, kind, params, reverse, eps):
    _check_encode_fake("transition_encode_tokens", tokens, h0, kind, params, tokens=True)
    check_mask("transition_encode_tokens", mask)
    D, B, H = h0.shape
    return table.new_empty(tokens.shape[0], B, D * H), h0.new_empty(D, B, H)


def _register() -> None:
    pairs = [("dtmt::transition_forward_triton", "dtmt::transition_backward_triton",
              torch.ops.dtmt.transition_backward_triton)]
    if built():
        pairs.append(("dtmt::transition_forward", "dtmt::transition_backward", torch.ops.dtmt.transition_backward))
        register_fake("dtmt::transition_encode", _encode_fake)
        _autocast.register("dtmt::transition_encode", _autocast.low_precision_rule)   # as its per-direction op
        register_fake("dtmt::transition_encode_tokens", _encode_tokens_fake)
        _autocast.register("dtmt::transition_encode_tokens", _autocast.float32_rule)   # tables made in float
    for forward, backward, backward_op in pairs:
        register_fake(forward, _forward_fake_for(forward))
        register_fake(backward, _backward_fake)
        register_autograd(forward, _autograd_for(backward_op), setup_context=_setup_context_for(forward))
        refuse_double_backward(backward)
        _autocast.register(forward, _autocast.low_precision_rule)


_register()


def refuse_mask_gradients(op: str, mask: Optional[Tensor], drop: Optional[Tensor]) -> None:
    """RuntimeError naming `op` for a mask or dropout mask that needs a gradient: the fused backwards form none for
    them (it was None, where the reference backend gives one, c ⊙ dh' for the dropout mask: a silent difference
    between backends; a raw op's call had it too)."""
    for name, t, what in (("mask", mask, "mask"), ("drop", drop, "dropout mask")):
        if t is not None and t.requires_grad:
            raise RuntimeError(f"dtmt::{op}: {name} requires grad, but the fused kernels form no gradient for the "
                               f"{what}; detach it, or run the layer with backend='reference' (learned {what})")


def check_drop(op: str, drop: Optional[Tensor]) -> None:
    """refuse_mask_gradients for a dropout mask given to a step, before it runs (where a graph is recorded)."""
    if torch.is_grad_enabled():
        refuse_mask_gradients(op, None, drop)


def fused_sequence(forward_op):
    """A transition_sequence (reference.transition_sequence's contract) computed by `forward_op`."""

    name = forward_op._qualified_op_name.split("::")[-1]

    def transition_sequence(x: Tensor, h0: Tensor, w: TransitionWeights, mask: Optional[Tensor] = None,
                            drop: Optional[Tensor] = None, reverse: bool = False, eps: float = 1e-5):
        params = flat_params(w)
        check_transforms(name, x, h0, drop, *params)
        check_drop(name, drop)   # (before the kernels run; the op's setup_context checks the masks again)
        out, h_n, *_ = forward_op(x, h0, mask, drop, KINDS[w.cell], *params, reverse, float(eps))
        return out, h_n

    return transition_sequence
