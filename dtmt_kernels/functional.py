"""Functional API: run a deep transition block / ATR over a sequence or one step on a chosen backend, the
attention kernels, the decoding linear layer and the fused loss (dtmt_kernels/ops/), plus the checks that every
public entry point applies to its inputs (validate at the boundary). A decoder step's inference ops are the
engine's (dtmt_models.engine.ops)."""
from __future__ import annotations

import numbers
from collections.abc import Mapping, MappingView, Set as AbstractSet
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference
from .ops._autocast import autocast_dtype, autocast_mix
from .ops._host_reads import check_length_values, checked_lengths, host_list, host_reads_allowed, host_reads_kept
from .ops.linear import small_rows_applicable, small_rows_linear
from .ops.loss.op import PortableSmoothedCrossEntropy
from .ops._register import check_transforms, transformed
from .ops._extension import built
from .ops.transition.layout import CELL_KINDS, CELL_ROWS, DEEP_TRANSITION_CELLS
from .backends import resolve_backend
from .reference import TransitionWeights

__all__ = ["transition_sequence", "transition_step", "additive_scores", "attention_context", "linear",
           "small_rows_applicable", "small_rows_linear", "lengths_to_mask",
           "check_attention_context", "check_dtype_for_backend", "smoothed_cross_entropy", "host_reads_allowed",
           "host_list", "host_reads_kept"]

LengthsLike = Union[Tensor, Sequence[int]]

# The backends whose attention (additive_scores, attention_context, and an `unrolled` block's contexts) runs the
# fused kernels of torch.ops.dtmt; the others run the reference's PyTorch ops. The CUDA kernels exist
# (csrc/attention_cuda.cu): "cuda" joins this set once a GPU session has held them to the reference
# (tests/test_attention_kernel.py's GPU tests) and measured them (bench_attention.py --device cuda; bench_train.py
# --fused cuda cuda+attention); until then GPU attention runs the reference's ops. Only "cpp" and "cuda" mean
# anything here: the ops' kernels are picked by the tensors' device.
ATTENTION_KERNEL_BACKENDS = frozenset({"cpp"})


def transition_sequence(x: Tensor, h0: Tensor, weights: TransitionWeights, mask: Optional[Tensor] = None,
                        drop: Optional[Tensor] = None, reverse: bool = False, backend: str = "auto",
                        eps: float = 1e-5):
    """Deep transition block (or ATR, `weights.cell == "atr"`) over x [T, B, I] from h0 [B, H].

    mask [T, B]: 1 for real tokens, 0 for padding (state carried, output 0, input never read: padding_zeroed; bool
    or any floating dtype, taken in x's). drop [depth+1, B, H]: candidate-dropout multipliers, already scaled.
    Returns (out [T, B, H], h_n [B, H]). Arguments of the wrong kind, shape, dtype or device are a ValueError naming
    them, the same on every backend."""
    held = check_weights("transition_sequence", weights)
    mask, reverse = _check_sequence_arguments("transition_sequence", x, h0, weights, held, mask, drop, reverse, eps,
                                              "x", "h0")
    return _run_sequence(x, h0, weights, mask, drop, reverse, backend, eps)


def _run_sequence(x, h0, weights, mask, drop, reverse, backend, eps):
    """transition_sequence on checked arguments: the backend resolved for x's device and dtype, then run."""
    b = resolve_backend(backend, x.device)
    check_dtype_for_backend(b, x.dtype, "x")
    return b.run(padding_zeroed(x, mask), h0, weights, mask, drop, reverse, eps)


def padding_zeroed(x: Tensor, mask: Optional[Tensor]) -> Tensor:
    """x [T, B, I] with its padded steps (mask [T, B] <= 0.5) zero, what every backend runs. A padded step's input
    reaches no output, but its products reached the backward: NaN or Inf padding (a batch built with torch.empty)
    made every weight's gradient NaN, and on the reference backend the real tokens' too, where torch.nn.GRU over a
    PackedSequence never reads it. Its gradient there is zero, as before."""
    return x if mask is None else torch.where(mask.unsqueeze(-1) > 0.5, x, x.new_zeros(()))


def transition_step(x: Tensor, h: Tensor, weights: TransitionWeights, drop: Optional[Tensor] = None,
                    backend: str = "auto", eps: float = 1e-5) -> Tensor:
    """One step (decoder use): x [B, I], h [B, H] -> h' [B, H]."""
    held = check_weights("transition_step", weights)
    width = weights.w_ih.shape[-1]
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != width or x.shape[0] == 0:
        raise ValueError(f"transition_step: x must be a Tensor [B, input_size={width}] with B >= 1, got "
                         f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    x = x.unsqueeze(0)
    _check_sequence_arguments("transition_step", x, h, weights, held, None, drop, False, eps, "x", "h")
    return _run_sequence(x, h, weights, None, drop, False, backend, eps)[1]


def _check_sequence_arguments(op: str, x, h0, weights, held, mask, drop, reverse, eps, x_name: str, h_name: str):
    """transition_sequence's arguments (x [T, B, I]) against each other and `weights` (checked by check_weights,
    which returned `held`, the tensors they hold): ValueError naming the first that is of the wrong kind, shape,
    dtype or device (a few comparisons, nothing per element). Returns the mask in x's dtype (a bool or other
    floating mask cast) and reverse as a bool."""
    for name, t in ((x_name, x), (h_name, h0)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point Tensor, got "
                             f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    if x.dim() != 3 or x.shape[2] != weights.w_ih.shape[-1] or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{op}: {x_name} must be [T, B, input_size={weights.w_ih.shape[-1]}] with T, B >= 1, got "
                         f"{list(x.shape)}")
    T, B, H = x.shape[0], x.shape[1], weights.w_hh.shape[-1]
    given = [(h_name, h0, (B, H), f"[B={B}, H={H}]")]
    if mask is not None:
        given.append(("mask", mask, (T, B), f"[T={T}, B={B}]"))
    if drop is not None:
        given.append(("drop", drop, (weights.depth + 1, B, H), f"[depth+1={weights.depth + 1}, B={B}, H={H}]"))
    for name, t, shape, label in given:
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} must be a Tensor {label}, got "
                             f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {x_name} is on {x.device}")
        if name == "mask":   # (1 or 0 a step: any floating dtype or bool says it)
            if not (t.is_floating_point() or t.dtype == torch.bool):
                raise ValueError(f"{op}: mask must be bool or floating point, got {t.dtype}")
        elif t.dtype != x.dtype and not autocast_mix((t.dtype, x.dtype), x):
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but {x_name} has {x.dtype}")
    for name, t in held:   # (their shapes: check_weights)
        if t.device != x.device:
            raise ValueError(f"{op}: weights.{name} is on {t.device} but {x_name} is on {x.device}")
        if t.dtype != x.dtype and not autocast_mix((t.dtype, x.dtype), x):
            raise ValueError(f"{op}: weights.{name} has dtype {t.dtype} but {x_name} has {x.dtype}")
    if drop is not None and weights.cell == "atr":   # (it was taken and changed nothing)
        raise ValueError(f"{op}: ATR has no candidate to drop (contract §2); pass no drop mask")
    if mask is not None and mask.dtype != x.dtype and not autocast_mix((mask.dtype, x.dtype), x):
        mask = mask.to(x.dtype)
    # True or False (numpy's bool and 0 / 1 too)
    if not isinstance(reverse, (numbers.Integral, np.bool_)) or reverse not in (0, 1):
        raise ValueError(f"{op}: reverse must be True or False, got {reverse!r}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= float(eps) < float("inf"):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    return mask, bool(reverse)


def check_weights(op: str, w: TransitionWeights) -> List[Tuple[str, Tensor]]:
    """A TransitionWeights of the functional API against the cells' row layout (layout.CELLS): its cell, every
    weight's and bias's shape, layer norms given in pairs (weight and bias), the T-GRUs' for all of them or none,
    and T-GRUs only after a cell that may head a deep transition; ValueError naming the first that is wrong. (Malformed
    weights had run: a T-GRU's lone layer norm on one backend and not the other, a layer-norm bias without its weight
    skipped by the reference; or failed deep inside, differently per backend.) Returns (name, tensor) of every tensor
    `w` holds (an absent layer norm left out), whose device and dtype _check_sequence_arguments checks against x."""
    if not isinstance(w, TransitionWeights):
        raise ValueError(f"{op}: weights must be a TransitionWeights, got {type(w).__name__}")
    if w.cell not in CELL_KINDS:
        raise ValueError(f"{op}: weights.cell must be one of {', '.join(CELL_KINDS)}, got {w.cell!r}")

    def fail(name, t, shape):
        shape = f"[{', '.join(map(str, shape))}]"
        raise ValueError(f"{op}: weights.{name} must be a floating-point Tensor {shape} for cell {w.cell!r} "
                         f"(H = {H}), got {list(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
                         + (f" {t.dtype}" if isinstance(t, Tensor) and not t.is_floating_point() else ""))

    n_in, n_h, n_g = CELL_ROWS[w.cell]
    H = w.w_hh.shape[-1] if isinstance(w.w_hh, Tensor) and w.w_hh.dim() == 2 else "?"
    lists = {name: getattr(w, name) for name in ("t_w", "t_b", "t_ln_w", "t_ln_b")}
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{op}: weights.{name} must be a list, got {type(value).__name__}")
    depth = len(w.t_w)
    if any(len(v) != depth for v in lists.values()):
        counts = ", ".join(str(len(v)) for v in lists.values())
        raise ValueError(f"{op}: weights.t_w, t_b, t_ln_w and t_ln_b must have one entry per T-GRU ({depth}; a "
                         f"layer norm's None where there is none), got {counts}")
    if depth and w.cell not in DEEP_TRANSITION_CELLS:
        raise ValueError(f"{op}: weights.cell {w.cell!r} takes no T-GRUs (t_w must be empty), got {depth}")
    if not (isinstance(w.w_hh, Tensor) and w.w_hh.is_floating_point() and w.w_hh.dim() == 2 and H >= 1
            and tuple(w.w_hh.shape) == (n_h * H, H)):
        fail("w_hh", w.w_hh, (f"{n_h}H", "H"))
    I = w.w_ih.shape[-1] if isinstance(w.w_ih, Tensor) and w.w_ih.dim() == 2 else "I"
    expected = [("w_ih", w.w_ih, (n_in * H, I)), ("b_ih", w.b_ih, (n_in * H,)), ("b_hh", w.b_hh, (n_h * H,))]
    layer_norms = [("ln_w", "ln_b", w.ln_w, w.ln_b, n_g * H)]
    for k in range(depth):
        expected += [(f"t_w[{k}]", w.t_w[k], (3 * H, H)), (f"t_b[{k}]", w.t_b[k], (3 * H,))]
        layer_norms.append((f"t_ln_w[{k}]", f"t_ln_b[{k}]", w.t_ln_w[k], w.t_ln_b[k], CELL_ROWS["tgru"][2] * H))
    for name_w, name_b, ln_w, ln_b, width in layer_norms:
        if (ln_w is None) != (ln_b is None):
            raise ValueError(f"{op}: weights.{name_w} and {name_b} must both be given or both be None")
        if ln_w is not None:
            expected += [(name_w, ln_w, (width,)), (name_b, ln_b, (width,))]
    for name, t, shape in expected:
        if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
            fail(name, t, shape)
    if len({t is None for t in w.t_ln_w}) > 1:   # (the kernels take the T-GRUs' layer norms stacked, or none)
        raise ValueError(f"{op}: weights.t_ln_w must give a layer norm for every T-GRU or for none, got "
                         f"{['None' if t is None else 'Tensor' for t in w.t_ln_w]}")
    held = {"w_hh": w.w_hh, **{name: t for name, t, _ in expected}}
    order = ["w_ih", "b_ih", "w_hh", "b_hh", "ln_w", "ln_b"] + [f"{n}[{k}]" for k in range(depth)
                                                                for n in ("t_w", "t_b", "t_ln_w", "t_ln_b")]
    return [(name, held[name]) for name in order if name in held]


def additive_scores(keys: Tensor, query: Tensor, v: Tensor, backend: str = "auto") -> Tensor:
    """Additive-attention scores of one decoder step, scores[b, h, s] = v[h] · tanh(keys[b, s, h] + query[b, h])
    (see reference.additive_scores): keys [B, S, NH, D], query [B, NH, D], v [NH, D] -> [B, NH, S].

    The backend is resolved as for the recurrent layers; `cpp` has a fused kernel for it (one pass, nothing
    kept for backward), and so has `cuda` once it is in ATTENTION_KERNEL_BACKENDS (not yet: its kernels have not
    run on a GPU). Other backends compute the scores by the same PyTorch ops as the reference, on their device."""
    if not all(isinstance(t, Tensor) for t in (keys, query, v)):
        raise ValueError(f"additive_scores: keys, query and v must be Tensors, got "
                         f"{', '.join(type(t).__name__ for t in (keys, query, v))}")
    if keys.dim() != 4 or query.dim() != 3 or v.dim() != 2:
        raise ValueError(f"additive_scores: keys must be [B, S, NH, D], query [B, NH, D] and v [NH, D]; got "
                         f"{list(keys.shape)}, {list(query.shape)}, {list(v.shape)}")
    B, _, NH, D = keys.shape
    if tuple(query.shape) != (B, NH, D) or tuple(v.shape) != (NH, D):
        raise ValueError(f"additive_scores: with keys {list(keys.shape)}, query must be [{B}, {NH}, {D}] and "
                         f"v [{NH}, {D}]; got {list(query.shape)} and {list(v.shape)}")
    if not _shared_dtype(keys, query, v) or query.device != keys.device or v.device != keys.device:
        raise ValueError("additive_scores: keys, query and v must share dtype and device")
    b = resolve_backend(backend, keys.device)
    check_dtype_for_backend(b, keys.dtype, "keys")
    if attention_kernels_run(b, keys):
        check_transforms("additive_scores", keys, query, v)
        return torch.ops.dtmt.additive_scores(keys, query, v)
    return reference.additive_scores(keys, query, v)


def attention_context(alpha: Tensor, values: Tensor, backend: str = "auto") -> Tensor:
    """The context of one decoder step, head h weighting its own C/NH columns of the values
    (see reference.attention_context): alpha [B, NH, S], values [B, S, C] -> [B, C].

    Backends as for additive_scores: `cpp` (and `cuda` in ATTENTION_KERNEL_BACKENDS) has a fused kernel (values
    may be any view whose last dimension is contiguous, e.g. the transposed encoder output); the others run the
    reference's PyTorch ops."""
    b = check_attention_context(alpha, values, backend)
    if attention_kernels_run(b, values):
        check_transforms("attention_context", alpha, values)
        return torch.ops.dtmt.attention_context(alpha, values)
    return reference.attention_context(alpha, values)


def check_attention_context(alpha: Tensor, values: Tensor, backend: str):
    """attention_context's argument checks; returns the resolved backend."""
    if not isinstance(alpha, Tensor) or not isinstance(values, Tensor):
        raise ValueError(f"attention_context: alpha and values must be Tensors, got {type(alpha).__name__} and "
                         f"{type(values).__name__}")
    if alpha.dim() != 3 or values.dim() != 3:
        raise ValueError(f"attention_context: alpha must be [B, NH, S] and values [B, S, C]; got "
                         f"{list(alpha.shape)} and {list(values.shape)}")
    B, NH, S = alpha.shape
    if values.shape[0] != B or values.shape[1] != S or NH == 0 or values.shape[2] % NH:
        raise ValueError(f"attention_context: with alpha {list(alpha.shape)}, values must be [{B}, {S}, C] with C "
                         f"divisible by {NH}; got {list(values.shape)}")
    if not _shared_dtype(alpha, values) or alpha.device != values.device:
        raise ValueError("attention_context: alpha and values must share dtype and device")
    b = resolve_backend(backend, values.device)
    check_dtype_for_backend(b, values.dtype, "values")
    return b


def _shared_dtype(*ts: Tensor) -> bool:
    """Whether the tensors share a dtype, or differ only as torch.autocast makes them (float32 and the autocast
    dtype, on a device where it is on: the ops' autocast rules cast them, ops/_autocast.py)."""
    dtypes = {t.dtype for t in ts}
    return len(dtypes) == 1 or autocast_mix(dtypes, ts[0])


def attention_kernels_run(b, t: Tensor) -> bool:
    """Whether the resolved backend `b` runs the attention ops' fused kernels on tensors like t: a backend of
    ATTENTION_KERNEL_BACKENDS, and t float32 / float64, or any dtype under autocast (which runs them in float32);
    16-bit tensors outside autocast take the reference's PyTorch ops."""
    return (b.name in ATTENTION_KERNEL_BACKENDS
            and (t.dtype in (torch.float32, torch.float64) or autocast_dtype(t) is not None))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """F.linear(x, weight, bias), for the linear layers a decoder step runs (see nn.Linear).

    With `cpp` (the `auto` choice for CPU tensors) a product of at most 8 float32 rows that needs no gradient,
    i.e. a decoder step at batch 1 with beam <= 8, runs the small-row kernel (csrc/small_gemm_cpu.cpp), which
    reads each weight once, in address order (why: docs/design/cpu_kernels.md, "Streaming the weights").
    Everything else, and every other backend, is F.linear (ATen's GEMM, cuBLAS on the GPU). Unlike the recurrent
    ops, `auto` never fails here: on a device with no fused backend it is F.linear. A backend named that cannot run
    these tensors (not built, or another device) is a ValueError saying why, as for the recurrent ops (contract §3:
    no silent fallback)."""
    if backend != "auto":
        resolve_backend(backend, x.device)
        if backend != "cpp":
            return F.linear(x, weight, bias)
    if small_rows_applicable(x, weight, bias):  # false without the extension, off the CPU, or with gradients
        out = small_rows_linear(x, weight, bias)   # (float32, its autocast rule's: under autocast the dtype F.linear
        if not torch.is_autocast_enabled("cpu"):    # gives, so that it does not depend on the rows or grad mode)
            return out
        dtype = autocast_dtype(out)
        return out if dtype is None else out.to(dtype)
    return F.linear(x, weight, bias)


def smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0, ignore_index: int = -100):
    """The label-smoothed cross-entropy of a training update, log-softmax and loss fused: logits [N, V], target [N]
    (ids in [0, V), or ignore_index for a row to leave out) -> (smoothed loss sum, NLL sum), 0-dim tensors in the
    logits' dtype (float32 at least), as reference.smoothed_cross_entropy computes them. Gradients flow to the
    logits through the loss sum only.

    CPU float32 / float64 logits run the C++ kernel (torch.ops.dtmt.smoothed_cross_entropy: the gradient formed in
    the forward, one pass over each row); other devices and dtypes one autograd node of PyTorch ops that keeps the
    log-probabilities (ops.loss.op.PortableSmoothedCrossEntropy)."""
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise ValueError(f"smoothed_cross_entropy: logits and target must be Tensors, got "
                         f"{type(logits).__name__} and {type(target).__name__}")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"smoothed_cross_entropy: logits must be [N, V] and target [N]; got {list(logits.shape)} "
                         f"and {list(target.shape)}")
    if logits.shape[1] == 0:   # (the C++ op's message named the shapes it was given as the ones it takes)
        raise ValueError(f"smoothed_cross_entropy: logits {list(logits.shape)} score no words: V must be >= 1")
    if not logits.is_floating_point():
        raise ValueError(f"smoothed_cross_entropy: logits must be floating point, got {logits.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:   # (as torch's cross_entropy)
        raise ValueError(f"smoothed_cross_entropy: target must hold integer ids, got {target.dtype}")
    if (isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real)
            or not 0.0 <= float(smoothing) < 1.0):
        raise ValueError(f"smoothed_cross_entropy: smoothing must be a number in [0, 1), got {smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral) or not (
            -2 ** 63 <= int(ignore_index) < 2 ** 63):
        raise ValueError(f"smoothed_cross_entropy: ignore_index must be an int64, got {ignore_index!r}")
    if transformed(logits) is not None:   # (forward-mode AD, torch.func.grad: the same sums by torch's own loss,
        z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()   # which checks the ids)
        sums = [F.cross_entropy(z, target.long(), ignore_index=int(ignore_index), label_smoothing=eps,
                                reduction="sum") for eps in (float(smoothing), 0.0)]
        return sums[0], sums[1].detach()
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and built():
        loss, nll, _ = torch.ops.dtmt.smoothed_cross_entropy(logits, target.long(), float(smoothing), int(ignore_index))
        return loss, nll.detach()
    if target.device.type == "cpu" and host_reads_allowed():   # (as the kernel says it; gather's IndexError did)
        outside = target.ne(int(ignore_index)) & (target.lt(0) | target.ge(logits.shape[1]))
        if outside.any():
            raise RuntimeError(f"smoothed_cross_entropy: target {int(target[outside][0])} is outside "
                               f"[0, {logits.shape[1]})")
    return PortableSmoothedCrossEntropy.apply(logits, target, float(smoothing), int(ignore_index))


def check_dtype_for_backend(backend, dtype: torch.dtype, name: str) -> None:
    if dtype not in backend.dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in backend.dtypes)
        raise ValueError(f"backend {backend.name!r} supports {names} inputs; {name} has dtype "
                         f"{str(dtype).replace('torch.', '')}")


def _batched(t: Tensor) -> bool:
    """Whether torch.vmap batches `t` at some level of its functorch wrapping."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def lengths_to_mask(lengths: LengthsLike, T: int, B: int, dtype: torch.dtype, device: torch.device,
                    owner: str = "lengths", none_if_unpadded: bool = False) -> Optional[Tensor]:
    """Validates `lengths` (B integers in [1, T]) and returns the mask [T, B] of real (1) vs padded (0) steps; with
    `none_if_unpadded`, None where every length is T (no step to mask: the kernels' no-mask path, the same results;
    a sentence translated alone has none), except where host reads are not allowed (host_reads_allowed: under
    torch.compile or a CUDA graph's capture; a tensor of lengths is then checked and compared on `device`)."""
    if isinstance(lengths, Tensor):
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"{owner}: lengths must hold integers, got dtype {lengths.dtype}")
        if lengths.dim() != 1:
            raise ValueError(f"{owner}: lengths must be 1-D [B={B}], got shape {tuple(lengths.shape)}")
        if lengths.device.type == "meta":
            raise ValueError(f"{owner}: lengths must hold values (a CPU or CUDA tensor), got a meta tensor")
        if host_reads_allowed() and _batched(lengths):   # (vmapped over: torch's "Cannot access data pointer of
            # Tensor that doesn't have storage" at the read below; made inside torch.func.grad, they read)
            raise ValueError(f"{owner}: lengths are read on the host, which a torch.func transform (vmap over them) "
                             "does not allow; pass one batch's lengths from outside the transform")
        if lengths.numel() == B and not host_reads_allowed():   # (a graph: no read, no host tensor to copy in)
            on_device = lengths.detach().to(device=device, dtype=torch.long)
            steps = torch.arange(T, device=device)
            if torch.jit.is_tracing():   # (a trace drops the assert below: its result is read by nothing)
                on_device = checked_lengths(on_device, steps, owner)
            else:
                torch._assert_async(((on_device >= 1) & (on_device <= T)).all(),   # (T a symbol when exported: s27)
                                    f"{owner}: every length must be in [1, T={T}]" if isinstance(T, int) else
                                    f"{owner}: every length must be in [1, T], T the steps of x")
            return (steps.unsqueeze(1) < on_device.unsqueeze(0)).to(dtype)
        if lengths.numel() != B:
            raise ValueError(f"{owner}: lengths must have one entry per sequence [B={B}], got {lengths.numel()}")
        values = host_list(lengths)   # (once a batch inside host_reads_kept)
        lengths_cpu = torch.tensor(values, dtype=torch.long)
    else:
        # values in the batch's order: a set, a mapping or a mapping's view has no order of the rows (a text none)
        if isinstance(lengths, (str, bytes, AbstractSet, Mapping, MappingView)):
            raise ValueError(f"{owner}: lengths must be a 1-D tensor or sequence of ints [B={B}], "
                             f"got {type(lengths).__name__}")
        try:
            values = list(lengths)
        except TypeError:
            raise ValueError(f"{owner}: lengths must be a 1-D tensor or sequence of ints [B={B}], "
                             f"got {type(lengths).__name__}") from None
        # ints, whole floats, numpy numbers, one-element tensors; a bool, a nested list or a string is no length
        values = [v.item() if isinstance(v, Tensor) and v.numel() == 1 else v for v in values]
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and float(v).is_integer()
                   for v in values):
            raise ValueError(f"{owner}: lengths must hold integers, got {values}")
        values = [int(v) for v in values]
        if len(values) != B:
            raise ValueError(f"{owner}: lengths must have one entry per sequence [B={B}], got {len(values)}")
        check_length_values(owner, values, T)   # (before a tensor: a value past int64 overflows there)
        lengths_cpu = torch.tensor(values, dtype=torch.long)
    if not host_reads_allowed():
        # under torch.compile / torch.export a data-dependent `if` would break the graph: the range check is an op
        # of the graph instead, failing at run time with the same message (without the values)
        torch._assert_async(((lengths_cpu >= 1) & (lengths_cpu <= T)).all(),
                            f"{owner}: every length must be in [1, T={T}]")
    else:
        check_length_values(owner, values, T)
        if none_if_unpadded and all(v == T for v in values):
            return None
    steps = torch.arange(T).unsqueeze(1)
    return (steps < lengths_cpu.unsqueeze(0)).to(device=device, dtype=dtype)
