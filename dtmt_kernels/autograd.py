"""`torch.autograd.Function`s around the fused C++ kernels (dtmt_kernels._C).

The Functions take the flat tensors of one direction (see reference.TransitionWeights for the layout,
T-GRU parameters stacked to [depth, ...]) and return (out [T, B, H], h_n [B, H]). Absent optional tensors
(mask, candidate-dropout masks, layer norm, T-GRUs) are passed to the kernels as empty tensors.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .reference import TransitionWeights

try:  # the extension is built by setup.py; its absence is reported by backends.available_backends()
    from . import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _C = None
    _IMPORT_ERROR = exc

KINDS = {"gru": 0, "lgru": 1, "lau": 2, "atr": 3}


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t.contiguous()


class CppTransitionFunction(torch.autograd.Function):
    """Deep transition block (or ATR) over a whole sequence with the C++ CPU kernels."""

    @staticmethod
    def forward(ctx, x, h0, mask, drop, kind: int, reverse: bool, eps: float,
                w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b):
        params = [t.contiguous() for t in (w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b)]
        x, h0, mask, drop = (t.contiguous() for t in (x, h0, mask, drop))
        out, h_n, xp, hs, hp, hpt = _C.transition_forward(x, h0, mask, drop, kind, *params, reverse, eps)
        ctx.kind, ctx.reverse, ctx.eps = kind, reverse, eps
        ctx.save_for_backward(x, mask, drop, *params, xp, hs, hp, hpt)
        return out, h_n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_hn):
        x, mask, drop, *rest = ctx.saved_tensors
        params, (xp, hs, hp, hpt) = rest[:10], rest[10:]
        grads = _C.transition_backward(grad_out.contiguous(), grad_hn.contiguous(), x, mask, drop, ctx.kind,
                                       *params, xp, hs, hp, hpt, ctx.reverse, ctx.eps)
        dx, dh0, *dparams = grads
        dparams = [g if g is not None and g.numel() else None for g in dparams]
        return (dx, dh0, None, None, None, None, None, *dparams)


class _UnrolledSession:
    """What the step Functions of an `unrolled` block share with their sink: the rows each step's backward
    keeps, under the step's index (running the backward of the same graph twice, with retain_graph, overwrites
    them rather than adding them twice) and tagged with the backward pass (graph task) that made them, so that
    the sink uses only its own pass's rows: a pass that did not reach the sink (torch.autograd.grad of other
    inputs, an exception part-way) leaves nothing behind that a later pass would add in. Once the sink has run,
    the session is `done` and the next forward in the block starts a new one."""

    def __init__(self):
        self.rows: dict = {}
        self.n_steps = 0
        self.done = False

    def next_index(self) -> int:
        self.n_steps += 1
        return self.n_steps - 1

    def keep(self, index: int, row: tuple) -> None:
        self.rows[index] = (torch._C._current_graph_task_id(), row)

    def take(self) -> list:
        """This backward pass's rows in step order (all rows are dropped)."""
        task = torch._C._current_graph_task_id()
        rows = [row for k, (t, row) in sorted(self.rows.items()) if t == task]
        self.rows = {}
        self.done = True
        return rows


class UnrolledSteps(_UnrolledSession):
    """One cell's steps in a `dtmt_kernels.nn.unrolled` block (forward in autograd mode, cpp backend).

    A cell that runs one step per call (a decoder, teacher-forced) would otherwise form its weight gradients
    at every step: a GEMM with K = B rows per weight, then autograd adds each step's [rows, cols] gradient to
    the last. Here each step's backward forms only the gradients to its input and state and keeps the
    pre-activation gradients the weight gradients are made of (csrc/transition.h, weight_grads=False);
    `CppUnrolledWeightsFunction`, which every step takes as an input and autograd therefore runs after all
    of them, forms each weight gradient in one GEMM over every step's rows.

    The flat parameters (T-GRUs stacked, biases widened: autograd.flat_params) are assembled once per session
    instead of once per step."""

    def __init__(self, kind: int, flat: list, versions: tuple):
        super().__init__()
        self.kind = kind
        self.live = flat                         # saved by every step: autograd's check for in-place changes
        self.flat = [t.detach() for t in flat]   # what the kernels read
        self.versions = versions                 # the cell's parameters' versions when the session began

    def weight_grads(self):
        """Gradients of the ten flat parameters from this backward pass's rows."""
        rows = self.take()
        if not rows:
            return [None] * 10
        cat = torch.cat
        x = cat([r[0] for r in rows])
        hs = cat([r[1] for r in rows], 1)              # [D+1, N, H]
        dxp = cat([r[2] for r in rows])
        dhp = cat([r[3] for r in rows])
        grads = [dxp.t().mm(x), dxp.sum(0), dhp.t().mm(hs[0]), dhp.sum(0), None, None, None, None, None, None]
        if rows[0][5] is not None:                     # base-cell layer norm
            grads[4] = torch.stack([r[5] for r in rows]).sum(0)
            grads[5] = torch.stack([r[6] for r in rows]).sum(0)
        D = self.flat[6].shape[0] if self.flat[6].numel() else 0
        if D:
            dhpt = cat([r[4] for r in rows], 1)        # [D, N, 3H]
            grads[6] = torch.bmm(dhpt.transpose(1, 2), hs[1:])
            grads[7] = dhpt.sum(1)
            if rows[0][7] is not None:
                grads[8] = torch.stack([r[7] for r in rows]).sum(0)
                grads[9] = torch.stack([r[8] for r in rows]).sum(0)
        del rows, x, hs, dxp, dhp   # the concatenations hold copies: free the rows before autograd goes on
        return grads


class CppUnrolledWeightsFunction(torch.autograd.Function):
    """The flat parameters of an UnrolledSteps in, a token (an empty tensor) out; every step takes the token,
    so the backward here runs once all the steps' backwards have, and returns the weight gradients of all."""

    @staticmethod
    def forward(ctx, steps: UnrolledSteps, *flat):
        ctx.steps = steps
        ctx.save_for_backward(*flat)   # only so that autograd reports a parameter changed in place before backward
        return flat[0].new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_token):
        ctx.saved_tensors  # noqa: B018 - the version check
        return (None, *ctx.steps.weight_grads())


class CppTransitionStepFunction(torch.autograd.Function):
    """One step of a cell in an `unrolled` block: x [B, I], h [B, H] -> h' [B, H] (no mask)."""

    @staticmethod
    def forward(ctx, x, h, drop, token, steps: UnrolledSteps, eps: float):
        x, h, drop = x.contiguous(), h.contiguous(), _or_empty(drop, x)
        out, h_n, xp, hs, hp, hpt = _C.transition_forward(x.unsqueeze(0), h, drop.new_empty(0), drop, steps.kind,
                                                          *steps.flat, False, eps)
        ctx.steps, ctx.eps, ctx.index = steps, eps, steps.next_index()
        ctx.save_for_backward(x, drop, xp, hs, hp, hpt, *steps.live)
        return h_n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h):
        x, drop, xp, hs, hp, hpt, *_ = ctx.saved_tensors   # unpacking the weights checks their versions
        steps = ctx.steps
        g = grad_h.contiguous()
        dx, dh, dxp, _, dhp, _, dln_w, dln_b, dhpt, _, dt_ln_w, dt_ln_b = _C.transition_backward(
            torch.zeros_like(g).unsqueeze(0), g, x.unsqueeze(0), drop.new_empty(0), drop, steps.kind, *steps.flat,
            xp, hs, hp, hpt, False, ctx.eps, weight_grads=False)
        if ctx.needs_input_grad[3]:   # the weights want gradients (not frozen)
            steps.keep(ctx.index, (x, hs[:, 0], dxp, dhp, dhpt, dln_w, dln_b, dt_ln_w, dt_ln_b))
        return dx[0], dh, None, x.new_zeros(0), None, None


class UnrolledContext(_UnrolledSession):
    """The attention contexts of many decoder steps against the same values (the annotations) in a
    `dtmt_kernels.nn.unrolled` block. Each step's backward forms only the gradient to its weights alpha_t
    (dalpha[b, h, s] = values[b, s, h] . dctx_t[b, h], the C++ context backward without the values' part) and
    keeps (alpha_t, dctx_t); `CppUnrolledValuesFunction`, which every step takes as an input, forms the values'
    gradient once, sum_t alpha_t^T dctx_t, as one batched GEMM. Without it every step writes a full
    [B, S, C] gradient that autograd then adds to the last."""

    def __init__(self, values: Tensor):
        super().__init__()
        self.live = values
        self.version = values._version
        self.values = _last_dim_contiguous(values.detach())

    def values_grad(self) -> Optional[Tensor]:
        rows = self.take()
        if not rows:
            return None
        alpha = torch.stack([r[0] for r in rows], 2)   # [B, NH, T, S]
        g = torch.stack([r[1] for r in rows], 2)       # [B, NH, T, Dc]
        B, _, _, S = alpha.shape
        return torch.matmul(alpha.transpose(2, 3), g).permute(0, 2, 1, 3).reshape(B, S, -1)


class CppUnrolledValuesFunction(torch.autograd.Function):
    """values in, a token out (see CppUnrolledWeightsFunction); backward: the values' gradient of all steps."""

    @staticmethod
    def forward(ctx, steps: UnrolledContext, values):
        ctx.steps = steps
        ctx.save_for_backward(values)   # only for autograd's check that it was not changed in place
        return values.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_token):
        ctx.saved_tensors  # noqa: B018 - the version check
        return None, ctx.steps.values_grad()


class CppContextStepFunction(torch.autograd.Function):
    """One step's attention context in an `unrolled` block: alpha [B, NH, S] -> [B, C]."""

    @staticmethod
    def forward(ctx, alpha, token, steps: UnrolledContext):
        alpha = alpha.contiguous()
        ctx.steps, ctx.index = steps, steps.next_index()
        ctx.save_for_backward(alpha, steps.live)
        return _C.attention_context_forward(alpha, steps.values)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        alpha, _ = ctx.saved_tensors   # unpacking the values checks their version
        B, NH, _ = alpha.shape
        g = grad.reshape(B, NH, -1)
        if ctx.needs_input_grad[1]:   # the values want a gradient
            ctx.steps.keep(ctx.index, (alpha, g))
        return _C.attention_context_backward(grad.contiguous(), alpha, ctx.steps.values, False)[0], \
            alpha.new_zeros(0), None


def _stack(ts) -> Tensor:
    """torch.stack, without a copy for one tensor (depth 1)."""
    return ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts)


def flat_params(w: TransitionWeights, like: Tensor):
    """The ten parameter tensors in the kernels' order (T-GRU parameters stacked, absent ones empty)."""
    if w.depth:
        t_w, t_b = _stack(w.t_w), _stack(w.t_b)
        has_ln = w.t_ln_w[0] is not None
        t_ln_w = _stack(w.t_ln_w) if has_ln else None
        t_ln_b = _stack(w.t_ln_b) if has_ln else None
    else:
        t_w = t_b = t_ln_w = t_ln_b = None
    return [w.w_ih, w.b_ih, w.w_hh, w.b_hh, _or_empty(w.ln_w, like), _or_empty(w.ln_b, like),
            _or_empty(t_w, like), _or_empty(t_b, like), _or_empty(t_ln_w, like), _or_empty(t_ln_b, like)]


def cpp_transition_sequence(x: Tensor, h0: Tensor, w: TransitionWeights, mask: Optional[Tensor] = None,
                            drop: Optional[Tensor] = None, reverse: bool = False, eps: float = 1e-5):
    """Same contract as reference.transition_sequence, computed by the C++ kernels."""
    return CppTransitionFunction.apply(x, h0, _or_empty(mask, x), _or_empty(drop, x), KINDS[w.cell], reverse, eps,
                                       *flat_params(w, x))


class CudaTransitionFunction(torch.autograd.Function):
    """The CUDA C++ kernels (`_C.transition_forward_cuda` / `_backward_cuda`, built only against a CUDA
    torch): same arguments and saved tensors as autograd.CppTransitionFunction, plus the low-precision
    copy of the states (`hs_lp`, empty for float32 / float64)."""

    @staticmethod
    def forward(ctx, x, h0, mask, drop, kind: int, reverse: bool, eps: float,
                w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b):
        params = [t.contiguous() for t in (w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b)]
        x, h0, mask, drop = (t.contiguous() for t in (x, h0, mask, drop))
        out, h_n, *saved = _C.transition_forward_cuda(x, h0, mask, drop, kind, *params, reverse, eps)
        ctx.kind, ctx.reverse, ctx.eps = kind, reverse, eps
        ctx.save_for_backward(x, mask, drop, *params, *saved)
        return out, h_n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_hn):
        x, mask, drop, *rest = ctx.saved_tensors
        params, saved = rest[:10], rest[10:]
        grads = _C.transition_backward_cuda(grad_out.contiguous(), grad_hn.contiguous(), x, mask, drop, ctx.kind,
                                            *params, *saved, ctx.reverse, ctx.eps)
        dx, dh0, *dparams = grads
        dparams = [g if g is not None and g.numel() else None for g in dparams]
        return (dx, dh0, None, None, None, None, None, *dparams)


def cuda_transition_sequence(x, h0, w, mask=None, drop=None, reverse=False, eps=1e-5):
    """Same contract as reference.transition_sequence, computed by the CUDA C++ kernels."""
    return CudaTransitionFunction.apply(x, h0, _or_empty(mask, x), _or_empty(drop, x), KINDS[w.cell], reverse,
                                        float(eps), *flat_params(w, x))


class CppAdditiveScoresFunction(torch.autograd.Function):
    """reference.additive_scores with the C++ kernel: one pass forward that keeps nothing but its inputs
    (which the caller holds anyway), tanh recomputed in backward."""

    @staticmethod
    def forward(ctx, keys, query, v):
        keys, query, v = keys.contiguous(), query.contiguous(), v.contiguous()
        ctx.save_for_backward(keys, query, v)
        return _C.additive_scores_forward(keys, query, v)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return tuple(_C.additive_scores_backward(grad.contiguous(), *ctx.saved_tensors))


def cpp_additive_scores(keys: Tensor, query: Tensor, v: Tensor) -> Tensor:
    """Same contract as reference.additive_scores, computed by the C++ kernel."""
    return CppAdditiveScoresFunction.apply(keys, query, v)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


class CppAttentionContextFunction(torch.autograd.Function):
    """reference.attention_context with the C++ kernel: one pass each way over the values, which may be a
    strided view (only the last dimension must be contiguous); nothing is saved beyond the inputs."""

    @staticmethod
    def forward(ctx, alpha, values):
        alpha, values = alpha.contiguous(), _last_dim_contiguous(values)
        ctx.save_for_backward(alpha, values)
        return _C.attention_context_forward(alpha, values)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return tuple(_C.attention_context_backward(grad.contiguous(), *ctx.saved_tensors))


def cpp_attention_context(alpha: Tensor, values: Tensor) -> Tensor:
    """Same contract as reference.attention_context, computed by the C++ kernel."""
    return CppAttentionContextFunction.apply(alpha, values)


def cpp_transition_inference(x: Tensor, h0: Tensor, cell: str, params, mask: Optional[Tensor] = None,
                             drop: Optional[Tensor] = None, reverse: bool = False, eps: float = 1e-5):
    """Forward only, without autograd bookkeeping (for use under torch.no_grad, e.g. in beam search):
    `params` as returned by flat_params, contiguous."""
    out, h_n, *_ = _C.transition_forward(x.contiguous(), h0.contiguous(), _or_empty(mask, x), _or_empty(drop, x),
                                         KINDS[cell], *params, reverse, eps)
    return out, h_n


def small_rows_applicable(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether `cpp_small_rows_linear` runs the weight-streaming kernel for F.linear(x, weight, bias): the extension
    built, CPU float32 tensors, at most _C.SMALL_ROWS_MAX rows (leading dims flattened) and nothing that needs a
    gradient (the kernel has no backward: it is for decoding)."""
    if _C is None or x.dim() == 0 or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 1 <= rows <= _C.SMALL_ROWS_MAX and x.shape[-1] == weight.shape[1]


def cpp_small_rows_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """F.linear(x, weight, bias) by the small-row kernel (csrc/small_gemm_cpu.cpp); `small_rows_applicable` must
    hold. x [..., K] with at most SMALL_ROWS_MAX rows -> [..., N]."""
    K = x.shape[-1]
    out = _C.small_rows_linear(x.reshape(-1, K), weight, x.new_empty(0) if bias is None else bias)
    return out.view(*x.shape[:-1], weight.shape[0])
