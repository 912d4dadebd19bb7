"""The Decoder protocol: what every search needs of a system, written once (issue 75 item 1).

A search (beam_search's loop, its on-device form device_search, a decoder's own one-call `search`, an ensemble of
decoders) drives an object with these members and nothing else:

    pad_id             the padding id, never output (with BOS)
    max_target_steps   the most target positions the model has (the transformer's position table), or None
    encode(src [B, S], src_lengths [B]) -> state
    step(state, prev_tokens [rows]) -> (log-probabilities [rows, V], the next state); rows >= 1
    reorder(state, index [rows']) -> the state's rows taken by `index` (any number of rows; none leaves no step)
    reorder_within(state, index) -> `reorder` for an index that keeps every row among its sentence's rows (a decoder
                       may keep what it made once per sentence as it is); else the same as `reorder`
    search             beam search in one call (FusedRNMTDecoder's C++ loop), or None: the searches' loop then

Every system implements it through its `inference_decoder()` (Seq2Seq's copy with the fused inference forms,
FusedRNMTDecoder, the ensemble's EnsembleDecoder); `as_decoder` gives it for any model, and adapts an object that
has only encode / step / reorder (a decoder of one's own) with the defaults above. tests/test_decoder_protocol.py
checks every registered system.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

from dtmt_kernels.functional import host_reads_allowed
from dtmt_models.data.vocabulary import PAD
from dtmt_models.engine.forms import inference_sample

State = Dict[str, Tensor]


@runtime_checkable
class Decoder(Protocol):
    pad_id: int
    max_target_steps: Optional[int]
    search: Optional[Callable[..., list]]

    def encode(self, src: Tensor, src_lengths: Tensor) -> Any: ...

    def step(self, state: Any, prev_tokens: Tensor) -> Tuple[Tensor, Any]: ...

    def reorder(self, state: Any, index: Tensor) -> Any: ...

    def reorder_within(self, state: Any, index: Tensor) -> Any: ...


class AdaptedDecoder:
    """An object with encode / step / reorder only, given the protocol's other members: its own where it has them,
    else pad_id PAD, no bound on the target steps, no one-call search, reorder_within = reorder."""

    def __init__(self, inner):
        self.inner = inner
        self.encode, self.step, self.reorder = inner.encode, inner.step, inner.reorder
        self.reorder_within = getattr(inner, "reorder_within", inner.reorder)
        self.pad_id = getattr(inner, "pad_id", PAD)
        self.max_target_steps = getattr(inner, "max_target_steps", None)
        self.search = getattr(inner, "search", None)


# --amp's names and the dtypes they decode in
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _in_16_bits(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """A deepcopy memo in which each floating-point parameter and buffer of `model` is already its `dtype` copy, so
    that the copy of the model never holds a float32 copy of the weights beside the model's own."""
    memo = {}
    for p in model.parameters():
        if p.is_floating_point():
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        if b.is_floating_point():
            memo[id(b)] = b.detach().to(dtype)
    return memo


class AutocastDecoder:
    """16-bit decoding: a copy of the model with its floating-point weights and buffers in `dtype` (bfloat16 or
    float16; the model given keeps its own), whose encode and step run under torch.autocast(dtype) on the model's
    device. So the products read 16-bit weights (half the bytes a step), what autocast runs in float32 (softmax,
    log-softmax, layer norm) does, the dtmt ops follow their autocast rules (recurrent states and layer-norm
    statistics float32: dtmt_kernels/ops/_autocast.py), and the rest is 16-bit, as in a model converted with
    .half(). The log-probabilities a step returns are float32, so the searches' sums are those of a float32
    model's. No one-call search (the C++ loop is float32): the searches' loops drive it, on a GPU the device search with its steps as CUDA graphs (the
    autocast cache off, so that a capture holds no cast made outside it). `model`: the 16-bit copy."""

    def __init__(self, model, dtype: torch.dtype):
        if dtype not in AMP_DTYPES.values():
            raise ValueError(f"16-bit decoding takes bfloat16 or float16, got {dtype}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"16-bit decoding copies a model (a torch.nn.Module), got {type(model).__name__}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.built_as = _weight_versions(model)   # (the model given, changed after: the copy decoded its old weights)
        self.model = copy.deepcopy(model, _in_16_bits(model, dtype)).eval()   # (the model given is untouched)
        self.built_from = model   # (built_from's answer: the model given, not the copy)
        self.inner = as_decoder(self.model)
        self.dtype, self.device_type = dtype, device.type
        self.pad_id, self.max_target_steps = self.inner.pad_id, self.inner.max_target_steps
        self.reorder, self.reorder_within = self.inner.reorder, self.inner.reorder_within
        self.search = None

    def _autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)

    def encode(self, src: Tensor, src_lengths: Tensor):
        if _weight_versions(self.built_from) != self.built_as:   # (a search's start: its copy is of the model now)
            raise RuntimeError("AutocastDecoder: its model's weights changed (an optimizer step, load_state_dict) or "
                               "were replaced after its 16-bit copy was made, which holds the old ones; build the "
                               "decoder again")
        with self._autocast():
            return self.inner.encode(src, src_lengths)

    def step(self, state, prev_tokens: Tensor):
        with self._autocast():
            log_probs, state = self.inner.step(state, prev_tokens)
        return log_probs.float(), state


def _weight_versions(model: torch.nn.Module) -> tuple:
    """What AutocastDecoder compares of the model it copied: each parameter's and buffer's identity and version
    counter, which a change in place (an optimizer step, load_state_dict) or a tensor put in its place moves, and a
    sample of each inference tensor's values (forms.inference_sample); not their dtype or device: a conversion
    (.to(), as `dtmt translate --amp` makes of the model after its copy) leaves the copy the model's weights."""
    tensors = [*model.parameters(), *model.buffers()]
    return tuple((id(t), None if t.is_inference() else t._version) for t in tensors), inference_sample(tensors)


def built_from(decoder) -> Optional[torch.nn.Module]:
    """The model `decoder` was built from (inference_decoder, as_decoder, AutocastDecoder; a model that decodes as it
    is: itself), or None where it does not say (a decoder of one's own). What `translate` compares with the model it
    is given: a decoder of another model had decoded with that model's weights, checked against this one's
    vocabularies, without a word."""
    if isinstance(decoder, AdaptedDecoder):
        decoder = decoder.inner
    if isinstance(decoder, torch.nn.Module):   # (a system's prepared copy records its model; a model is its own)
        return decoder.__dict__.get("_built_from", decoder)
    prepared = getattr(decoder, "prepared", None)   # (FusedRNMTDecoder: the prepared copy it was made from)
    if isinstance(prepared, torch.nn.Module):
        return built_from(prepared)
    source = getattr(decoder, "built_from", None)   # (AutocastDecoder, an Ensemble's EnsembleDecoder)
    return source if isinstance(source, torch.nn.Module) else None


def as_decoder(model, int8: bool = False, amp: Optional[str] = None) -> Decoder:
    """What a search decodes `model` with: its `inference_decoder(int8)` where it has one (a system, an ensemble;
    a decoder returns itself; a torch.compile wrapper, the model it wraps, with a warning that it runs uncompiled),
    else the model itself, adapted where it lacks members of the protocol; with `amp`
    ("bf16" or "fp16", AMP_DTYPES) an AutocastDecoder of a 16-bit copy of the model. TypeError for an object without
    encode / step / reorder; ValueError for `int8` where the model has no int8 decoder, for int8 with amp, and for
    another amp; TypeError for an int8 that is not a bool."""
    if not isinstance(int8, bool):   # (a string was truthy: int8="no" built an int8 decoder)
        raise TypeError(f"as_decoder: int8 must be True or False, got {int8!r}")
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module):
        # torch.compile(model) compiles its forward; a search calls encode and step, which reached the model's
        # uncompiled ones through the wrapper without a word
        warnings.warn(f"decoding the {type(inner).__name__} that torch.compile wraps, uncompiled: torch.compile "
                      f"compiles forward, which a search does not call (the inference decoder is already fused)",
                      stacklevel=3)
        model = inner
    if amp is not None:
        if amp not in AMP_DTYPES:
            raise ValueError(f"amp must be one of {', '.join(AMP_DTYPES)}, got {amp!r}")
        if int8:
            raise ValueError("int8 and 16-bit decoding exclude each other")
        return AutocastDecoder(model, AMP_DTYPES[amp])
    build = getattr(model, "inference_decoder", None)
    if build is not None:
        decoder = build(int8=True) if int8 else build()
    elif int8:
        raise ValueError(f"int8 decoding: {type(model).__name__} has no inference decoder (only the recurrent "
                         f"systems have int8 weight matrices)")
    else:
        decoder = model
    if isinstance(decoder, Decoder):
        return decoder
    missing = [m for m in ("encode", "step", "reorder") if not callable(getattr(decoder, m, None))]
    if missing:
        inner = getattr(decoder, "module", None)   # (DataParallel, DistributedDataParallel: the model they wrap)
        wraps = (f"; it wraps a {type(inner).__name__}: decode its .module"
                 if isinstance(inner, torch.nn.Module) and callable(getattr(inner, "encode", None)) else "")
        raise TypeError(f"{type(decoder).__name__} is not a decoder: it has no {', '.join(missing)} "
                        f"(dtmt_models.engine.decoder.Decoder){wraps}")
    return AdaptedDecoder(decoder)


def check_step_tokens(name: str, prev_tokens: Tensor, B: int, vocab: int) -> None:
    """`step`'s tokens: a LongTensor [B], one previous token for each of the state's B >= 1 rows (ValueError), each an
    id of the target vocabulary's `vocab` (IndexError naming it, as the model's forward; it was nn.Embedding's "index
    out of range in self"). The ids are read where they are on the CPU (a few µs a step); on a GPU that read would
    wait for the device at every step, and the embedding's own check stands."""
    if B == 0:   # (a state reordered to no rows: each system failed its own way, or inside a layer, or went on)
        raise ValueError(f"{name}.step: the state has no rows (reordered to an empty index): there is no step to take")
    if not isinstance(prev_tokens, Tensor) or prev_tokens.dtype != torch.long or tuple(prev_tokens.shape) != (B,):
        raise ValueError(f"{name}.step: prev_tokens must be a LongTensor [B={B}] (one token for each of the state's "
                         f"rows), got {getattr(prev_tokens, 'dtype', type(prev_tokens).__name__)} "
                         f"{list(getattr(prev_tokens, 'shape', []))}")
    bad = _outside(prev_tokens, vocab)
    if bad is not None:
        raise IndexError(f"{name}.step: prev_tokens holds the id {bad}, outside the target vocabulary's {vocab} ids")


def check_reorder_index(name: str, index: Tensor, B: int) -> None:
    """`reorder`'s index: a LongTensor [N] of rows of the state's B (IndexError naming it; it was index_select's
    "index out of range in self"). Read where it is on the CPU, as check_step_tokens."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in (torch.long, torch.int):
        raise ValueError(f"{name}.reorder: index must be a LongTensor [N] of the state's rows, got "
                         f"{getattr(index, 'dtype', type(index).__name__)} {list(getattr(index, 'shape', []))}")
    bad = _outside(index, B)
    if bad is not None:
        raise IndexError(f"{name}.reorder: index holds the row {bad}, outside the state's {B} rows")


def _outside(t: Tensor, bound: int) -> Optional[int]:
    """A value of the integer tensor t outside [0, bound), read where t is on the CPU (a few µs); None where all are
    inside, or where reading would wait for a device (or is not allowed now: a trace, a capture)."""
    if t.device.type != "cpu" or not t.numel() or not host_reads_allowed():
        return None
    lo, hi = (int(v) for v in torch.aminmax(t))
    return hi if hi >= bound else lo if lo < 0 else None


def step_state(state: State, alpha: Tensor, keep_attention: bool, **updates: Tensor) -> State:
    """The state after a decoder step: `state` with `updates`, plus the step's attention weights as "attn" where
    kept (for multi-head attention [B, heads, S], the head average)."""
    new = {**state, **updates}
    if keep_attention:
        new["attn"] = alpha.mean(1) if alpha.dim() == 3 else alpha
    return new
