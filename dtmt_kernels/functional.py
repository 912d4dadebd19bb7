"""Functional API: run a deep transition block / ATR over a sequence or one step on a chosen backend, the
attention kernels and the decoding linear layer, plus the checks that every public entry point applies to its
inputs (validate at the boundary)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference
from .autograd import _C, cpp_additive_scores, cpp_attention_context, cpp_small_rows_linear, small_rows_applicable
from .backends import check_backend_name, resolve_backend
from .reference import TransitionWeights

LengthsLike = Union[Tensor, Sequence[int]]


def transition_sequence(x: Tensor, h0: Tensor, weights: TransitionWeights, mask: Optional[Tensor] = None,
                        drop: Optional[Tensor] = None, reverse: bool = False, backend: str = "auto",
                        eps: float = 1e-5):
    """Deep transition block (or ATR, `weights.cell == "atr"`) over x [T, B, I] from h0 [B, H].

    mask [T, B]: 1 for real tokens, 0 for padding (state carried, output 0). drop [depth+1, B, H]:
    candidate-dropout multipliers, already scaled. Returns (out [T, B, H], h_n [B, H])."""
    b = resolve_backend(backend, x.device)
    check_dtype_for_backend(b, x.dtype, "x")
    return b.run(x, h0, weights, mask, drop, reverse, eps)


def transition_step(x: Tensor, h: Tensor, weights: TransitionWeights, drop: Optional[Tensor] = None,
                    backend: str = "auto", eps: float = 1e-5) -> Tensor:
    """One step (decoder use): x [B, I], h [B, H] -> h' [B, H]."""
    _, h1 = transition_sequence(x.unsqueeze(0), h, weights, None, drop, False, backend, eps)
    return h1


def additive_scores(keys: Tensor, query: Tensor, v: Tensor, backend: str = "auto") -> Tensor:
    """Additive-attention scores of one decoder step, scores[b, h, s] = v[h] · tanh(keys[b, s, h] + query[b, h])
    (see reference.additive_scores): keys [B, S, NH, D], query [B, NH, D], v [NH, D] -> [B, NH, S].

    The backend is resolved as for the recurrent layers; `cpp` has a fused kernel for it (one pass, nothing
    kept for backward). The GPU backends have none: with them the scores are computed by the same PyTorch
    ops as the reference, on the GPU."""
    if keys.dim() != 4 or query.dim() != 3 or v.dim() != 2:
        raise ValueError(f"additive_scores: keys must be [B, S, NH, D], query [B, NH, D] and v [NH, D]; got "
                         f"{list(keys.shape)}, {list(query.shape)}, {list(v.shape)}")
    B, _, NH, D = keys.shape
    if tuple(query.shape) != (B, NH, D) or tuple(v.shape) != (NH, D):
        raise ValueError(f"additive_scores: with keys {list(keys.shape)}, query must be [{B}, {NH}, {D}] and "
                         f"v [{NH}, {D}]; got {list(query.shape)} and {list(v.shape)}")
    if query.dtype != keys.dtype or v.dtype != keys.dtype or query.device != keys.device or v.device != keys.device:
        raise ValueError("additive_scores: keys, query and v must share dtype and device")
    b = resolve_backend(backend, keys.device)
    check_dtype_for_backend(b, keys.dtype, "keys")
    if b.name == "cpp":
        return cpp_additive_scores(keys, query, v)
    return reference.additive_scores(keys, query, v)


def attention_context(alpha: Tensor, values: Tensor, backend: str = "auto") -> Tensor:
    """The context of one decoder step, head h weighting its own C/NH columns of the values
    (see reference.attention_context): alpha [B, NH, S], values [B, S, C] -> [B, C].

    Backends as for additive_scores: `cpp` has a fused kernel (values may be any view whose last dimension is
    contiguous, e.g. the transposed encoder output); the others run the reference's PyTorch ops."""
    b = check_attention_context(alpha, values, backend)
    if b.name == "cpp":
        return cpp_attention_context(alpha, values)
    return reference.attention_context(alpha, values)


def check_attention_context(alpha: Tensor, values: Tensor, backend: str):
    """attention_context's argument checks; returns the resolved backend."""
    if alpha.dim() != 3 or values.dim() != 3:
        raise ValueError(f"attention_context: alpha must be [B, NH, S] and values [B, S, C]; got "
                         f"{list(alpha.shape)} and {list(values.shape)}")
    B, NH, S = alpha.shape
    if values.shape[0] != B or values.shape[1] != S or NH == 0 or values.shape[2] % NH:
        raise ValueError(f"attention_context: with alpha {list(alpha.shape)}, values must be [{B}, {S}, C] with C "
                         f"divisible by {NH}; got {list(values.shape)}")
    if alpha.dtype != values.dtype or alpha.device != values.device:
        raise ValueError("attention_context: alpha and values must share dtype and device")
    b = resolve_backend(backend, values.device)
    check_dtype_for_backend(b, values.dtype, "values")
    return b


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """F.linear(x, weight, bias), for the linear layers a decoder step runs (see nn.Linear).

    With `cpp` (the `auto` choice for CPU tensors) a product of at most 8 float32 rows that needs no gradient,
    i.e. a decoder step at batch 1 with beam <= 8, runs the small-row kernel (csrc/small_gemm_cpu.cpp), which
    reads each weight once, in address order (why: benchmarks/NOTES.md, log items 10 and 12). Everything else, and every other backend, is F.linear (ATen's GEMM, cuBLAS
    on the GPU). Unlike the recurrent ops, `auto` never fails here: on a device with no fused backend it is
    F.linear."""
    if backend == "cpp":
        resolve_backend(backend, x.device)  # an error that says why when cpp cannot run these tensors
    elif backend != "auto":
        check_backend_name(backend)
        return F.linear(x, weight, bias)
    if small_rows_applicable(x, weight, bias):  # false without the extension, off the CPU, or with gradients
        return cpp_small_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


_ABSENT = torch.empty(0)   # what the C++ inference ops take for an absent tensor (they test numel() == 0)


def _or_none(t: Optional[Tensor]) -> Tensor:
    return _ABSENT if t is None else t


class _InferenceWeights:
    """Base of the named weight structures of the inference ops: each mirrors a struct of csrc/decode_step.h
    (its tensor fields in the same order: `tensor_fields()`, which a test holds equal to the extension's
    `_C.<NAME>_WEIGHT_FIELDS`), and keeps its tensors as the list the op takes (`tensors`, absent ones empty),
    made once. Fields named ...eps are the ops' float arguments, not tensors."""

    @classmethod
    def tensor_fields(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if not f.name.endswith("eps"))

    def __post_init__(self):
        object.__setattr__(self, "tensors", [_or_none(getattr(self, name)) for name in self.tensor_fields()])


@dataclass(frozen=True, eq=False)
class AttentionWeights(_InferenceWeights):
    """(Multi-head) additive attention for `attention_step`: w_q [NH*D, Q], v [NH, D]; the output projection w_o
    [C', C], b_o [C'] (multi-head attention) or None; the query's layer norm ln_w, ln_b [NH*D] and its eps
    (Nematus' attention) or None."""
    w_q: Tensor
    v: Tensor
    w_o: Optional[Tensor] = None
    b_o: Optional[Tensor] = None
    ln_w: Optional[Tensor] = None
    ln_b: Optional[Tensor] = None
    ln_eps: float = 1e-5


@dataclass(frozen=True, eq=False)
class ReadoutWeights(_InferenceWeights):
    """The Readout for `readout_features` and `rnmt_step`: w_y [R, E], w_s [R, Hs], w_c [R, C] and their biases
    (or None); the three layer norms' gains and offsets stacked, ln_w, ln_b [3, R] (or None) and their one eps;
    the output projection w_out [V, R], b_out [V] (`rnmt_step` only; None where the readout has more layers)."""
    w_y: Tensor
    b_y: Optional[Tensor]
    w_s: Tensor
    b_s: Optional[Tensor]
    w_c: Tensor
    b_c: Optional[Tensor]
    ln_w: Optional[Tensor] = None
    ln_b: Optional[Tensor] = None
    w_out: Optional[Tensor] = None
    b_out: Optional[Tensor] = None
    eps: float = 1e-5


@dataclass(frozen=True, eq=False)
class MemoryWeights(_InferenceWeights):
    """mce's memory addressing for `memory_encoder` (dtmt_models/models/systems/mce.py): w_state [H, H], w_memory [H, H],
    b_memory [H], v [1, H], w_read [H, H], b_read [H], w_write [H, H], b_write [H]."""
    w_state: Tensor
    w_memory: Tensor
    b_memory: Tensor
    v: Tensor
    w_read: Tensor
    b_read: Tensor
    w_write: Tensor
    b_write: Tensor


def attention_step(query: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor, weights: AttentionWeights):
    """Inference only (no autograd; CPU float32 / float64): one step of (multi-head) additive attention in one
    C++ call, what MultiHeadAdditiveAttention / AdditiveAttention compute in a dozen ops: q = query W_q^T,
    layer-normalised over all its NH*D features when the weights have ln_w / ln_b (Nematus), split into heads;
    scores = additive_scores(keys, q, v), alpha = softmax over the source positions where src_mask is true (0
    elsewhere), context = attention_context(alpha, annotations), then context W_o^T + b_o when w_o is given.
    query [B, Q], keys [B, S, NH, D], annotations [B, S, C], src_mask [B, S] bool -> (context, alpha [B, NH, S])."""
    context, alpha = _C.attention_step(query, keys, annotations, src_mask, weights.tensors, weights.ln_eps)
    return context, alpha


def readout_features(y: Tensor, s: Tensor, c: Tensor, weights: ReadoutWeights) -> Tensor:
    """Inference only: tanh(LN_y(y W_y^T + b_y) + LN_s(s W_s^T + b_s) + LN_c(c W_c^T + b_c)) in one C++ call (the
    Readout's features; no layer norm where the weights have none). y [..., E], s [..., Hs], c [..., C] with the
    same leading dims -> [..., R]."""
    lead = y.shape[:-1]
    out = _C.readout_features(y.reshape(-1, y.shape[-1]), s.reshape(-1, s.shape[-1]), c.reshape(-1, c.shape[-1]),
                              weights.tensors, weights.eps)
    return out.view(*lead, weights.w_y.shape[0])


def rnmt_step(y: Tensor, s: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor, query_cell, decoder_cell,
              attention: AttentionWeights, readout: ReadoutWeights):
    """Inference only: one whole step of the attentional RNMT decoder in one C++ call (dtmt_models.models.rnmt's
    FusedRNMTDecoder, for AttentionalRNMT and one-level Nematus): query cell, attention_step, decoder cell,
    readout_features, output projection (readout.w_out) and log-softmax. y [B, E] the embedded previous tokens,
    s [B, H]; keys [B, S, NH, D], annotations, src_mask as attention_step's; query_cell / decoder_cell:
    dtmt_kernels.nn.FrozenTransitionCell (a cell's kernel parameters gathered once) with the same eps. Returns
    (log_probs [B, V], float32 at least; s' [B, H]; the attention weights averaged over the heads [B, S])."""
    log_probs, s_new, alpha = _C.rnmt_step(y, s, keys, annotations, src_mask, query_cell.kind, query_cell.params,
                                           decoder_cell.kind, decoder_cell.params, query_cell.eps, attention.tensors,
                                           attention.ln_eps, readout.tensors, readout.eps)
    return log_probs, s_new, alpha


def memory_encoder(x: Tensor, memory: Tensor, src_mask: Tensor, reverse: bool, cell, addressing: MemoryWeights):
    """Inference only: one direction of mce's read-write-memory GRU encoder (dtmt_models/models/systems/mce.py) over the
    whole source in one C++ call. x [B, S, E], memory [B, S, H], src_mask [B, S] bool, cell: the direction's
    dtmt_kernels.nn.FrozenTransitionCell. Returns (states [B, S, H], final memory [B, S, H])."""
    states, final = _C.memory_encoder(x.contiguous(), memory, src_mask, reverse, cell.kind, cell.params, cell.eps,
                                      addressing.tensors)
    return states, final


def check_dtype_for_backend(backend, dtype: torch.dtype, name: str) -> None:
    if dtype not in backend.dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in backend.dtypes)
        raise ValueError(f"backend {backend.name!r} supports {names} inputs; {name} has dtype "
                         f"{str(dtype).replace('torch.', '')}")


def lengths_to_mask(lengths: LengthsLike, T: int, B: int, dtype: torch.dtype, device: torch.device,
                    owner: str = "lengths") -> Tensor:
    """Validates `lengths` (B integers in [1, T]) and returns the mask [T, B] of real (1) vs padded (0) steps."""
    if isinstance(lengths, Tensor):
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"{owner}: lengths must hold integers, got dtype {lengths.dtype}")
        if lengths.dim() != 1:
            raise ValueError(f"{owner}: lengths must be 1-D [B={B}], got shape {tuple(lengths.shape)}")
        lengths_cpu = lengths.detach().to("cpu", torch.long)
    else:
        try:
            lengths_cpu = torch.as_tensor(list(lengths), dtype=torch.long)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{owner}: lengths must be a 1-D tensor or sequence of ints ({exc})") from None
        if any(not float(v).is_integer() for v in lengths):
            raise ValueError(f"{owner}: lengths must hold integers, got {list(lengths)}")
    if lengths_cpu.numel() != B:
        raise ValueError(f"{owner}: lengths must have one entry per sequence [B={B}], got {lengths_cpu.numel()}")
    if B and (int(lengths_cpu.min()) < 1 or int(lengths_cpu.max()) > T):
        raise ValueError(f"{owner}: every length must be in [1, T={T}], got min {int(lengths_cpu.min())}, "
                         f"max {int(lengths_cpu.max())}")
    steps = torch.arange(T).unsqueeze(1)
    return (steps < lengths_cpu.unsqueeze(0)).to(device=device, dtype=dtype)
