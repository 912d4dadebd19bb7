"""The `dtmt_kernels.nn.unrolled` machinery: `torch.autograd.Function`s for a cell (or an attention context) run one
step per call, which keep each step's rows and form the weight (values) gradients of all steps at once. The steps
call the ops of dtmt_kernels/ops/ (torch.ops.dtmt.*) directly; the ops' own autograd is in their folders.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops._autocast import autocast_dtype
from .ops._register import first_order_only
from .ops.transition.grads import weight_grads
from .ops.transition.layout import present


def _graph_task() -> Optional[int]:
    """The running backward pass's graph task id (None where torch has no such call)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return None if task is None else task()


class _UnrolledSession:
    """What the step Functions of an `unrolled` block share with their sink: the rows each step's backward keeps,
    under the step's index (running the backward of the same graph twice, with retain_graph, overwrites them
    rather than adding them twice), tagged with the backward pass that made them, so that the sink uses only its
    own pass's rows: a pass that did not reach the sink (torch.autograd.grad of other inputs, an exception
    part-way) leaves nothing behind that a later pass would add in. Once the sink has run, the session is `done`
    and the next forward in the block starts a new one.

    A pass is told from the next by autograd's graph task (the id torch.utils.checkpoint reads too), and by the order
    of the steps' backwards: autograd runs a graph's nodes latest-created first (every node's gradient comes from
    nodes made after it), so within one pass the kept indices only decrease, and an index not below the last one
    kept starts a new pass. The order alone missed a pass that began below a row a partial pass had left (the
    backward of step 3 alone, then of steps 2 to 0: step 3's row was taken into the second pass's gradients)."""

    def __init__(self):
        self.rows: dict = {}
        self.n_steps = 0
        self.done = False
        self._pass = 0                     # the backward pass the latest rows belong to
        self._last: Optional[int] = None   # the index kept last in it
        self._task: Optional[int] = None   # its graph task

    def next_index(self) -> int:
        self.n_steps += 1
        return self.n_steps - 1

    def keep(self, index: int, row: tuple) -> None:
        task = _graph_task()
        if self._last is not None and (index >= self._last or task != self._task):
            self._pass += 1
        self._last, self._task = index, task
        self.rows[index] = (self._pass, row)

    def take(self) -> list:
        """This backward pass's rows in step order (all rows are dropped)."""
        rows = [row for _, (p, row) in sorted(self.rows.items()) if p == self._pass]
        self.rows, self._last = {}, None
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

    The flat parameters (T-GRUs stacked, biases widened: ops.transition.flat_params) are assembled once per session
    instead of once per step."""

    def __init__(self, kind: int, flat: list, versions: tuple):
        super().__init__()
        self.kind = kind
        self.live = flat                         # saved by every step: autograd's check for in-place changes
        self.flat = [t.detach() for t in flat]   # what the kernels read
        self.versions = versions                 # the cell's parameters' (versions, storages) when the session began
        self._cast: dict = {}

    def flat_in(self, dtype: torch.dtype) -> list:
        """The flat parameters in `dtype` (cast once per session)."""
        if dtype == self.flat[0].dtype:
            return self.flat
        if dtype not in self._cast:
            self._cast[dtype] = [t.to(dtype) for t in self.flat]
        return self._cast[dtype]

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
        D = self.flat[6].shape[0] if present(self.flat[6]) else 0
        dhpt = cat([r[4] for r in rows], 1)            # [D, N, 3H]
        dw_ih, db_ih, dw_hh, db_hh, dt_w, dt_b = weight_grads(x, hs, dxp, dhp, dhpt, (True,) * 4 + (D > 0,) * 2)
        grads = [dw_ih, db_ih, dw_hh, db_hh, None, None, dt_w, dt_b, None, None]
        if present(rows[0][5]):                       # base-cell layer norm
            grads[4] = torch.stack([r[5] for r in rows]).sum(0)
            grads[5] = torch.stack([r[6] for r in rows]).sum(0)
        if D and present(rows[0][7]):
            grads[8] = torch.stack([r[7] for r in rows]).sum(0)
            grads[9] = torch.stack([r[8] for r in rows]).sum(0)
        del rows, x, hs, dxp, dhp, dhpt   # the concatenations hold copies: free the rows before autograd goes on
        return grads


class CppUnrolledWeightsFunction(torch.autograd.Function):
    """The flat parameters of an UnrolledSteps in, a token (an empty tensor) out; every step takes the token,
    so the backward here runs once all the steps' backwards have, and returns the weight gradients of all.

    It saves no tensor, so that more than one backward pass may run through it: two sequences run in one block
    (micro-batches: two forwards, then a backward of each) share the session and its token, and the second
    backward reached a node whose saved tensors the first had freed ("Trying to backward through the graph a
    second time"). Each pass takes only its own steps' rows (_UnrolledSession)."""

    @staticmethod
    def forward(ctx, steps: UnrolledSteps, *flat):
        ctx.steps = steps   # nothing saved: every step saves the parameters, and unpacking checks their versions
        return flat[0].new_empty(0)

    @staticmethod
    @first_order_only("transition_backward")
    def backward(ctx, _grad_token):
        return (None, *ctx.steps.weight_grads())


class CppTransitionStepFunction(torch.autograd.Function):
    """One step of a cell in an `unrolled` block: x [B, I], h [B, H] -> h' [B, H] (no mask)."""

    @staticmethod
    def forward(ctx, x, h, drop, token, steps: UnrolledSteps, eps: float):
        dtype = autocast_dtype(x) or x.dtype     # under autocast: transition_forward's rule (x, weights, drop in the
        if dtype != x.dtype:                     # autocast dtype, the state in float32)
            x, h = x.to(dtype), h.float()
            drop = None if drop is None else drop.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            out, h_n, xp, hs, hs_lp, hp, hpt = torch.ops.dtmt.transition_forward(
                x.unsqueeze(0), h, None, drop, steps.kind, *steps.flat_in(dtype), False, eps)
        ctx.steps, ctx.eps, ctx.index = steps, eps, steps.next_index()
        ctx.save_for_backward(x, drop, xp, hs, hs_lp, hp, hpt, *steps.live)
        return h_n

    @staticmethod
    @first_order_only("transition_backward")
    def backward(ctx, grad_h):
        x, drop, xp, hs, hs_lp, hp, hpt, *_ = ctx.saved_tensors   # unpacking the weights checks their versions
        steps = ctx.steps
        g = grad_h.contiguous()
        dx, dh, dxp, _, dhp, _, dln_w, dln_b, dhpt, _, dt_ln_w, dt_ln_b = torch.ops.dtmt.transition_backward(
            g.new_zeros(1, *g.shape, dtype=x.dtype), g, x.unsqueeze(0), None, drop, steps.kind,
            *steps.flat_in(x.dtype), xp, hs, hs_lp, hp, hpt, False, ctx.eps, weight_grads=False)
        if ctx.needs_input_grad[3]:   # the weights want gradients (not frozen)
            states = hs_lp if present(hs_lp) else hs   # the states as the GEMMs read them
            steps.keep(ctx.index, (x, states[:, 0], dxp, dhp, dhpt, dln_w, dln_b, dt_ln_w, dt_ln_b))
        # (autograd casts dx and the weight gradients to the dtypes of the inputs they belong to)
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
        self.values = values.detach()
        self._float32: Optional[Tensor] = None

    def values_float32(self) -> Tensor:
        """The values in float32 (cast once per session, for steps under autocast)."""
        if self._float32 is None:
            self._float32 = self.values.float()
        return self._float32

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
        ctx.steps = steps   # nothing saved: every step saves the values, and unpacking checks their version
        return values.new_empty(0)

    @staticmethod
    @first_order_only("attention_context_backward")
    def backward(ctx, _grad_token):
        return None, ctx.steps.values_grad()


class CppContextStepFunction(torch.autograd.Function):
    """One step's attention context in an `unrolled` block: alpha [B, NH, S] -> [B, C]."""

    @staticmethod
    def forward(ctx, alpha, token, steps: UnrolledContext):
        values = steps.values
        if autocast_dtype(values) is not None:   # attention_context's autocast rule: float32
            alpha, values = alpha.float(), steps.values_float32()
        alpha = alpha.contiguous()
        ctx.steps, ctx.index = steps, steps.next_index()
        ctx.save_for_backward(alpha, steps.live)
        with torch.autocast(alpha.device.type, enabled=False):
            return torch.ops.dtmt.attention_context(alpha, values)

    @staticmethod
    @first_order_only("attention_context_backward")
    def backward(ctx, grad):
        alpha, _ = ctx.saved_tensors   # unpacking the values checks their version
        B, NH, _ = alpha.shape
        g = grad.reshape(B, NH, -1)
        if ctx.needs_input_grad[1]:   # the values want a gradient
            ctx.steps.keep(ctx.index, (alpha, g))
        values = ctx.steps.values if alpha.dtype == ctx.steps.values.dtype else ctx.steps.values_float32()
        return torch.ops.dtmt.attention_context_backward(grad.to(alpha.dtype), alpha, values, False)[0], \
            alpha.new_zeros(0), None
