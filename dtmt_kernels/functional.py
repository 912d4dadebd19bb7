"""Functional API: run a deep transition block / ATR over a sequence or one step on a chosen backend, the
attention kernels and the decoding linear layer, plus the checks that every public entry point applies to its
inputs (validate at the boundary)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

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
    i.e. a decoder step at batch 1 with beam <= 8, runs the small-row kernel (csrc/small_gemm_cpu.cpp): it streams
    each weight once at the memory's read rate, 2-4x the rate of the BLAS GEMM at these shapes on the CPUs of
    benchmarks/NOTES.md (log item 12). Everything else, and every other backend, is F.linear (ATen's GEMM, cuBLAS
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


def fused_inference(backend: str, x: Tensor) -> bool:
    """Whether a module on `backend` may run the inference-only fused ops below for input x: autograd off
    (torch.no_grad / inference_mode, as in beam search and validation), the cpp backend ("auto" or "cpp") and a
    CPU float32 / float64 tensor."""
    return (not torch.is_grad_enabled() and _C is not None and backend in ("auto", "cpp")
            and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64))


_ABSENT = torch.empty(0)   # what the C++ inference ops take for an absent tensor (they test numel() == 0)


def _or_none(t: Optional[Tensor]) -> Tensor:
    return _ABSENT if t is None else t


def attention_step(query: Tensor, w_q: Tensor, keys: Tensor, v: Tensor, annotations: Tensor, src_mask: Tensor,
                   w_o: Optional[Tensor] = None, b_o: Optional[Tensor] = None, ln_w: Optional[Tensor] = None,
                   ln_b: Optional[Tensor] = None, ln_eps: float = 1e-5):
    """Inference only (see fused_inference): one step of (multi-head) additive attention in one C++ call,
    what MultiHeadAdditiveAttention / AdditiveAttention compute in a dozen ops:
    q = query W_q^T, layer-normalised over all its NH*D features when ln_w / ln_b are given (Nematus'
    AdditiveAttention), split into heads; scores = additive_scores(keys, q, v), alpha = softmax over the source
    positions where src_mask is true (0 elsewhere), context = attention_context(alpha, annotations), then
    context W_o^T + b_o when w_o is given. query [B, Q], keys [B, S, NH, D], v [NH, D], annotations [B, S, C],
    src_mask [B, S] bool -> (context, alpha [B, NH, S])."""
    context, alpha = _C.attention_step(query, w_q, keys.contiguous(), v.contiguous(), annotations, src_mask,
                                       _or_none(w_o), _or_none(b_o), _or_none(ln_w), _or_none(ln_b), ln_eps)
    return context, alpha


def readout_features(y: Tensor, s: Tensor, c: Tensor, w_y: Tensor, b_y: Optional[Tensor], w_s: Tensor,
                     b_s: Optional[Tensor], w_c: Tensor, b_c: Optional[Tensor], ln_w: Optional[Tensor] = None,
                     ln_b: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """Inference only (see fused_inference): tanh(LN_y(y W_y^T + b_y) + LN_s(s W_s^T + b_s) + LN_c(c W_c^T + b_c))
    in one C++ call (the Readout's features); ln_w / ln_b [3, R] hold the three layer norms' gains and offsets
    (None: no layer norm). y [..., E], s [..., Hs], c [..., C] with the same leading dims -> [..., R]."""
    lead = y.shape[:-1]
    out = _C.readout_features(y.reshape(-1, y.shape[-1]), s.reshape(-1, s.shape[-1]), c.reshape(-1, c.shape[-1]),
                              w_y, _or_none(b_y), w_s, _or_none(b_s), w_c, _or_none(b_c),
                              _or_none(ln_w), _or_none(ln_b), eps)
    return out.view(*lead, w_y.shape[0])


def rnmt_step(y: Tensor, s: Tensor, query_cell, attention: Sequence[Optional[Tensor]], decoder_cell,
              readout: Sequence[Optional[Tensor]], readout_eps: float = 1e-5, drops=(None, None),
              attention_eps: float = 1e-5):
    """Inference only (see fused_inference): one whole step of the attentional RNMT decoder in one C++ call
    (what dtmt_models.rnmt.fused_step runs for AttentionalRNMT and Nematus in eval mode): query cell,
    attention_step, decoder cell, readout_features, output projection and log-softmax. y [B, E] embedded previous
    tokens, s [B, H]; query_cell / decoder_cell: dtmt_kernels.nn cells (their weights are taken as the kernels'
    flat list, cached); attention = (w_q, keys [B, S, NH, D], v, annotations, src_mask, w_o, b_o, ln_w, ln_b) with
    attention_eps the query layer norm's eps (attention_step's arguments); readout = (w_y, b_y, w_s, b_s, w_c,
    b_c, ln_w [3, R], ln_b, w_out, b_out); None for absent tensors; drops: the two cells' candidate-dropout
    multipliers or None. Returns (log_probs [B, V] float32, s' [B, H], the attention weights averaged over the
    heads [B, S])."""
    from .autograd import KINDS
    if query_cell.eps != decoder_cell.eps:
        raise ValueError("rnmt_step: the two cells must share their layer-norm eps")
    log_probs, s_new, alpha = _C.rnmt_step(
        y, s, KINDS[query_cell.cell], query_cell._inference_params(0), _or_none(drops[0]),
        KINDS[decoder_cell.cell], decoder_cell._inference_params(0), _or_none(drops[1]),
        [_or_none(t) for t in attention], [_or_none(t) for t in readout], query_cell.eps, attention_eps,
        readout_eps)
    return log_probs, s_new, alpha


def memory_encoder(x: Tensor, memory: Tensor, src_mask: Tensor, reverse: bool, cell,
                   addressing: Sequence[Tensor]):
    """Inference only (see fused_inference): one direction of mce's read-write-memory GRU encoder
    (dtmt_models/systems/mce.py) over the whole source in one C++ call. x [B, S, E], memory [B, S, H], src_mask
    [B, S] bool, cell: the direction's dtmt_kernels.nn GRU cell, addressing = (W_state, W_memory, b_memory, v,
    W_read, b_read, W_write, b_write). Returns (states [B, S, H], final memory [B, S, H])."""
    from .autograd import KINDS
    states, final = _C.memory_encoder(x.contiguous(), memory, src_mask, reverse, KINDS[cell.cell],
                                      cell._inference_params(0), cell.eps, list(addressing))
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
