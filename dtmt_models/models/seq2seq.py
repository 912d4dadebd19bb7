"""What every NMT system shares: the batch-first interface of contract §4, the readout, the loss, backend
switching and the incremental-decoding state.

    log_probs = model(src, src_lengths, prev_tokens)      # [B, T_tgt, V], teacher forcing
    state = model.encode(src, src_lengths)                # once per batch
    log_probs_t, state = model.step(state, prev_token_t)  # [B, V]
    state = model.reorder(state, index)                   # beam search bookkeeping

The decoder state is a flat dict of tensors whose first dimension is the batch, so `reorder` is one
`index_select` per entry. A step is embed_step -> transition -> features -> readout; teacher forcing runs the
same `transition` as incremental decoding (one code path, so the two give the same log-probabilities) with the
embedding lookup, the readout features and the vocabulary projection applied once to all steps.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import replace
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

import dtmt_kernels as dk
from dtmt_kernels.backends import BackendSwitch
from dtmt_models.engine import ops
from dtmt_models.engine.decoder import State, check_reorder_index, check_step_tokens
from dtmt_models.engine.forms import (FrozenReadout, InferenceForm, check_unconverted, inference_conversion,
                                     inference_copy, plain_linear, runs_fused_inference, weights_kind)
from dtmt_models.models.modes import copies_faithfully, eval_copy
from dtmt_models.engine.rnmt import FusedStep
from dtmt_models.models.loss import float_log_softmax, smoothed_cross_entropy


class Projection(nn.Module):
    """log_softmax(W dropout(features) + b), W optionally tied to an embedding matrix [V, in_dim]. The
    log-probabilities are float32 for half / bfloat16 models and in the model's own dtype otherwise."""

    def __init__(self, in_dim: int, vocab_size: int, dropout: float = 0.0,
                 tied_embedding: Optional[nn.Parameter] = None):
        super().__init__()
        self.proj = dk.nn.Linear(in_dim, vocab_size)
        if tied_embedding is not None:
            if tied_embedding.shape[1] != in_dim:
                raise ValueError(f"tied embeddings need the projection input ({in_dim}) to equal embed_dim "
                                 f"({tied_embedding.shape[1]})")
            self.proj.weight = tied_embedding
        self.dropout = nn.Dropout(dropout)

    def logits(self, features: Tensor) -> Tensor:
        return self.proj(self.dropout(features))

    def forward(self, features: Tensor) -> Tensor:
        return float_log_softmax(self.logits(features))


class Readout(nn.Module):
    """o = tanh(W_y y + W_s s + W_c c); log_probs = Projection(o) (dropout, then W_o tied to the target
    embedding when `tied_embedding` is given, which needs readout_dim == embed_dim).

    Nematus options (paper 002): `layer_norm` normalises each of the three projections before the sum, and
    `extra_layers` adds tanh(LN(W o)) layers of the same width before the softmax ("deep output")."""

    def __init__(self, embed_dim: int, state_dim: int, context_dim: int, readout_dim: int, vocab_size: int,
                 dropout: float = 0.0, tied_embedding: Optional[nn.Parameter] = None, layer_norm: bool = False,
                 extra_layers: int = 0):
        super().__init__()
        self.from_y = dk.nn.Linear(embed_dim, readout_dim, bias=False)
        self.from_s = dk.nn.Linear(state_dim, readout_dim, bias=True)
        self.from_c = dk.nn.Linear(context_dim, readout_dim, bias=False)
        norm = (lambda: nn.LayerNorm(readout_dim)) if layer_norm else nn.Identity
        self.norms = nn.ModuleList([norm(), norm(), norm()])
        self.deep = nn.ModuleList(nn.Sequential(dk.nn.Linear(readout_dim, readout_dim), norm(), nn.Tanh())
                                  for _ in range(extra_layers))
        self.output = Projection(readout_dim, vocab_size, dropout, tied_embedding)

    def inference_module(self) -> nn.Module:
        """This readout's form for decoding: a FrozenReadout where the fused features op can take it (the cpp
        backend, plain linears, the three norms all nn.Identity or all affine nn.LayerNorm over R with one eps),
        else itself. The output projection joins its weights where the readout has no deep layers and a plain
        Projection (what the whole fused decoder step takes)."""
        lin = (self.from_y, self.from_s, self.from_c)
        if not (runs_fused_inference(*lin) and all(plain_linear(m) for m in lin)):
            return self
        norms = list(self.norms)
        R = self.from_y.out_features
        if all(type(n) is nn.Identity for n in norms):
            ln = {}
        elif (all(type(n) is nn.LayerNorm and tuple(n.normalized_shape) == (R,) and n.weight is not None
                  and n.bias is not None for n in norms) and len({n.eps for n in norms}) == 1):
            with torch.no_grad():
                ln = dict(ln_w=torch.stack([n.weight for n in norms]), ln_b=torch.stack([n.bias for n in norms]),
                          eps=norms[0].eps)
        else:
            return self
        out = {}
        proj = self.output.proj
        if (len(self.deep) == 0 and type(self.output) is Projection and plain_linear(proj)
                and runs_fused_inference(proj)):
            out = dict(w_out=proj.weight, b_out=proj.bias)
        weights = ops.ReadoutWeights(self.from_y.weight, self.from_y.bias, self.from_s.weight, self.from_s.bias,
                                     self.from_c.weight, self.from_c.bias, **ln, **out)
        return FrozenReadout(self, weights)

    def features(self, y: Tensor, s: Tensor, c: Tensor) -> Tensor:
        ny, ns, nc = self.norms
        return torch.tanh(ny(self.from_y(y)) + ns(self.from_s(s)) + nc(self.from_c(c)))

    def logits(self, features: Tensor) -> Tensor:
        for layer in self.deep:
            features = layer(features)
        return self.output.logits(features)

    def forward(self, features: Tensor) -> Tensor:
        return float_log_softmax(self.logits(features))


def lengths_mask(lengths: Tensor, max_len: int) -> Tensor:
    """[B, max_len] bool, True at real tokens."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


INT8_SYSTEMS = "dtmt, shallow-rnmt, rnnsearch-atr, mce and one-level nematus"


def check_int8_flag(model, int8) -> None:
    """TypeError unless `int8`, given to `model`'s inference_decoder, is a bool (a string was truthy: int8="no" built
    an int8 decoder)."""
    if not isinstance(int8, bool):
        raise TypeError(f"{type(model).__name__}.inference_decoder(): int8 must be True or False, got {int8!r}")


def int8_unavailable(model) -> ValueError:
    """The error for int8 decoding asked of a model that cannot have it, saying which of the conditions it fails."""
    why = []   # (training mode is none: the decoder is built from an eval copy)
    weights = next(model.parameters(), None)
    if weights is not None and weights.dtype != torch.float32:
        why.append(f"its weights are {str(weights.dtype).replace('torch.', '')}")
    if weights is not None and weights.device.type != "cpu":
        why.append(f"it is on {weights.device}")
    backends = sorted({m.backend for m in model.modules() if isinstance(m, BackendSwitch)} - {"auto", "cpp"})
    if backends:
        why.append(f"its backend is {', '.join(backends)}")
    if len(getattr(model, "levels", ())):   # (Nematus' higher decoder levels, a deep decoder: the step has one)
        why.append(f"its decoder has {1 + len(model.levels)} levels")
    return ValueError(f"int8 decoding runs the fused decoder step of {INT8_SYSTEMS} (cpp backend, CPU, float32); "
                      f"this {type(model).__name__} model does not decode with it"
                      + (f": {'; '.join(why)}" if why else ""))


def _conversion_refused(name: str, fn, recurse: bool = True):
    """A part of an inference copy's _apply: refused (inference_conversion) as the copy's own is. (A partial of the
    part's class name: a method bound to the part did not pickle, and held the part in a cycle.)"""
    raise inference_conversion(name)


def _no_state_dict(model: nn.Module, method: str) -> TypeError:
    return TypeError(f"{type(model).__name__}.{method}: a decoder (inference_decoder()) is a copy for decoding that "
                     f"shares the model's parameters (and may hold weights gathered from them); save or load the "
                     f"model, then build its decoder again")


class Seq2Seq(nn.Module):
    """Base of the systems. Subclasses build `self.tgt_embed` and `self.readout` and implement `encode` and
    `transition` (or `decoder_step` as a whole)."""

    model_name = "seq2seq"
    # the Decoder protocol's other members (dtmt_models.engine.decoder): no bound on the target positions (the
    # transformer has one), no one-call search (FusedRNMTDecoder has one)
    max_target_steps: Optional[int] = None
    # the most source positions (None: no bound; the transformer's position table): translate cuts longer sources
    max_source_steps: Optional[int] = None
    search = None
    # What a class states of its methods, read once (at export, at the first forward) instead of comparing methods
    # there. A class that gets a method of what a statement covers from elsewhere than the class that made the
    # statement (its own definition, a mixin's) and does not state it again loses what that method covers (set
    # once, when the class is made: __init_subclass__).
    # fused_step: the engine's one-call step computes this class's step (engine.rnmt.FusedStep; AttentionalRNMT and
    #   Nematus state it); None: the step runs as the modules.
    fused_step: Optional[FusedStep] = None
    # stepwise_teacher_forcing: teacher forcing runs `decoder_step` step by step (a class whose decoder_step is not
    #   Seq2Seq's) instead of `transition` with the embeddings and readout batched over all steps.
    stepwise_teacher_forcing: bool = False
    _STEP_METHODS = ("transition", "features", "decoder_step", "step")
    _ENCODE_METHODS = ("encode", "encode_source", "state_from")

    def __init_subclass__(cls, **kwargs):
        """A subclass's statements: its own, else those of the class that made them, less what the methods it gets
        from elsewhere cover (a step method: the fused step; `embed_step`: the one-call search, whose op embeds the
        previous token itself; an encode method: the source tables)."""
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "stepwise_teacher_forcing" not in own:
            cls.stepwise_teacher_forcing = cls.decoder_step is not Seq2Seq.decoder_step
        if "fused_step" in own or cls.fused_step is None:
            return
        stated = next(c for c in cls.__mro__ if "fused_step" in vars(c))

        def changed(names):
            return any(getattr(cls, n, None) is not getattr(stated, n, None) for n in names)

        if changed(Seq2Seq._STEP_METHODS):
            cls.fused_step = None
            return
        lost = {}
        if changed(("embed_step",)):
            lost["embeds"] = False
        if changed(Seq2Seq._ENCODE_METHODS):
            lost["tabled_encoder"] = False
        if lost:
            cls.fused_step = replace(cls.fused_step, **lost)

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, pad_id: int = 0):
        super().__init__()
        self.src_vocab_size, self.tgt_vocab_size, self.pad_id = src_vocab_size, tgt_vocab_size, pad_id

    # ---------------------------------------------------------------------------------------- interface
    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        raise NotImplementedError

    def embed_step(self, state: State, prev_tokens: Tensor) -> Tensor:
        """The embedded previous tokens of one step, prev_tokens [B] -> [B, E]."""
        return self.tgt_embed(prev_tokens)

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        """The recurrent part of one step, from the embedded previous token y [B, E]: (the tensors the readout
        features are made of, besides y; the new state). `keep_attention` puts the step's attention weights in
        the state as "attn" (teacher forcing does not need them)."""
        raise NotImplementedError

    def features(self, y: Tensor, *parts: Tensor) -> Tensor:
        """Readout features from y and the transition's parts, for one step ([B, ...]) or all steps at once
        ([B, T, ...])."""
        return self.readout.features(y, *parts)

    def decoder_step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        """One step: prev_tokens [B] -> (readout features [B, F], new state). A system either implements
        `transition` (and, where needed, `embed_step` / `features`) or overrides this."""
        y = self.embed_step(state, prev_tokens)
        parts, state = self.transition(state, y)
        return self.features(y, *parts), state

    def step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        check_step_tokens(type(self).__name__, prev_tokens, next(iter(state.values())).shape[0], self.tgt_vocab_size)
        features, state = self.decoder_step(state, prev_tokens)
        return self.readout(features), state

    def output(self, features: Tensor, target: Optional[Tensor], smoothing: float):
        """The readout's log-probabilities, or with a target the training loss (`loss`'s three numbers) from its
        logits, log-softmax and loss fused (`smoothed_cross_entropy`)."""
        if target is None:
            return self.readout(features)
        logits = self.readout.logits(features)
        try:
            return smoothed_cross_entropy(logits, target, smoothing, self.pad_id)
        except ValueError as exc:   # (the target's or smoothing's check: the argument of this model's call)
            raise ValueError(f"{type(self).__name__}: {exc}") from None

    def forward(self, src: Tensor, src_lengths: Tensor, prev_tokens: Tensor, target: Optional[Tensor] = None,
                smoothing: float = 0.0):
        """Teacher forcing: log-probabilities [B, T, V]; given `target` [B, T], the training loss instead
        (smoothed loss sum, NLL sum, number of target tokens, as `loss`). The steps' transitions run in a loop,
        with what does not feed the recurrence batched over time: the target embeddings are looked up once (one embedding gradient instead of one per step) and the
        readout features and vocabulary projection run once over [B, T, ...] after the loop; and the step cells
        run `dk.nn.unrolled` (their weight gradients formed once over all steps). A system that overrides
        `decoder_step` gets the same loop over its `decoder_step` instead."""
        # the batch checked once (encode's check: done), its lengths read once; the step cells' weight gradients: one
        # GEMM each over all steps
        with checked_batch(self, src, src_lengths, prev_tokens), dk.nn.unrolled(*self.modules()):
            state = self.encode(src, src_lengths)
            T = prev_tokens.shape[1]
            if self.stepwise_teacher_forcing:
                feats = []
                for t in range(T):
                    f, state = self.decoder_step(state, prev_tokens[:, t])
                    feats.append(f)
                return self.output(torch.stack(feats, 1), target, smoothing)
            ys = self.tgt_embed(prev_tokens)  # positions 0..T-1 where the embedding has them, as embed_step's
            steps = []
            # unbind: one gradient node for all steps (ys[:, t] would zero-fill and add a full [B, T, E] per step)
            for y in ys.unbind(1):
                parts, state = self.transition(state, y, keep_attention=False)
                steps.append(parts)
        return self.output(self.features(ys, *(torch.stack(p, 1) for p in zip(*steps))), target, smoothing)

    def __getstate__(self):   # (copy.copy, copy.deepcopy, pickle)
        built_as = self.__dict__.get("_built_as")
        if built_as is not None:   # (an inference copy whose weights changed is refused, not copied as a fresh one)
            check_unconverted(self, self, built_as)
        return super().__getstate__()

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.__dict__.get("_built_as") is not None:   # (a deep copy's or an unpickled one's parameters and
            # gathered weights are new tensors, copied together: its own record; the copied one named the original's
            # tensors and a copy was refused as if its weights had changed)
            self.__dict__["_built_as"] = weights_kind(self)

    def inference_decoder(self, int8: bool = False) -> "Seq2Seq":
        """What beam search decodes with (`encode` / `step` / `reorder`, the same results as this model's): in
        eval mode a copy of the model, sharing its parameters, in which every submodule that has a fused
        inference form (dtmt_models.engine.forms.inference_form: the cells, attention, readout, mce's memory
        encoder) stands in its place, and for the systems with one the whole step as one
        C++ call (engine.rnmt.FusedRNMTDecoder); of a model in training mode, the same, from an eval copy (it had
        returned the model itself: a step loop of one's own decoded with dropout on). Built once per batch by
        `beam_search`, or once per run by a caller that decodes many batches with the same weights (translate,
        validation); inference only (no autograd). Weights are read when it is built: after they change (an
        optimizer step), build a new one: a search with the old one is a RuntimeError (where it gathered weights:
        the transformer's copy reads them all live and decodes the new model). On a decoder, returns itself,
        or TypeError where the model was converted (.to() / .double() / .cuda()) after the decoder gathered its
        weights. `int8`: decode with int8 weight matrices, which only the fused step of the attentional RNMT systems
        has (engine.rnmt.FusedRNMTDecoder): ValueError here."""
        check_int8_flag(self, int8)
        if int8:
            raise int8_unavailable(self)
        if self.training and not copies_faithfully(self):   # (its forms would follow its mode: dropout in decoding)
            raise ValueError(f"{type(self).__name__}.inference_decoder(): the model is in training mode and cannot be "
                             f"copied in eval mode (copies_faithfully); call .eval() first")
        if self.__dict__.get("_inference_copy", False):
            built_as = self.__dict__.get("_built_as")
            if built_as is not None:   # (its forms' gathered weights against the parameters it shares with the model)
                check_unconverted(self, self, built_as)
            return self
        # (from an eval copy of every module: a form or a module left as it is would follow this model's mode when it
        # trains again, the decoder with it; a model that does not copy faithfully follows it)
        prepared = inference_copy(eval_copy(self) if copies_faithfully(self) else self)
        if prepared is not self:
            prepared.__dict__["_inference_copy"] = True
            prepared.__dict__["_built_from"] = self   # (whose weights it reads: weights_kind's versions)
            originals = {id(m) for m in self.modules()}
            for m in prepared.modules():   # (a part of the copy converted, d.model.src_embed.double(), converted the
                if m is not prepared and id(m) not in originals:   # model's parameters, which it shares)
                    m.__dict__["_apply"] = functools.partial(_conversion_refused, type(m).__name__)
            if any(isinstance(m, InferenceForm) for m in prepared.modules()):
                prepared.__dict__["_built_as"] = weights_kind(prepared)
        return prepared

    def reorder(self, state: State, index: Tensor) -> State:
        check_reorder_index(type(self).__name__, index, next(iter(state.values())).shape[0])
        return {k: v.index_select(0, index) for k, v in state.items()}

    def reorder_within(self, state: State, index: Tensor) -> State:
        """`reorder` for an index that keeps every row among its sentence's rows (the Decoder protocol's, which a
        search calls at every step with rows it made: not checked again)."""
        return {k: v.index_select(0, index) for k, v in state.items()}

    def loss(self, src: Tensor, src_lengths: Tensor, prev_tokens: Tensor, target: Tensor,
             smoothing: float = 0.0) -> Tuple[Tensor, Tensor, int]:
        """(label-smoothed loss sum, NLL sum, number of target tokens), padding ignored."""
        return self(src, src_lengths, prev_tokens, target=target, smoothing=smoothing)

    # -------------------------------------------------------------------------------------- utilities
    __prepare_scriptable__ = BackendSwitch.__prepare_scriptable__   # (the same refusal as the layers')

    def _apply(self, fn, recurse=True):
        if self.__dict__.get("_inference_copy", False):   # (before any parameter, shared with the model, is converted)
            raise inference_conversion(self)
        return super()._apply(fn, recurse)

    def state_dict(self, *args, **kwargs):
        if self.__dict__.get("_inference_copy", False):   # (its forms hold the weights outside parameters: 4 entries
            raise _no_state_dict(self, "state_dict")        # of dtmt's 62 were saved, without a word)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        if self.__dict__.get("_inference_copy", False):   # (strict=False wrote into the model's shared parameters,
            raise _no_state_dict(self, "load_state_dict")   # and the forms kept the weights they had gathered)
        return super().load_state_dict(*args, **kwargs)

    def set_backend(self, backend: str) -> "Seq2Seq":
        """Switches every fused recurrent layer and attention of the model (e.g. "cpp" <-> "reference"). ValueError
        for a backend that cannot run in this process (it was taken, and the first translation refused it)."""
        from dtmt_kernels.backends import check_backend_available

        check_backend_available(backend)
        for m in self.modules():
            if isinstance(m, BackendSwitch):
                m.backend = backend
        return self

    def check_batch(self, src: Tensor, src_lengths: Tensor, prev_tokens: Optional[Tensor] = None) -> None:
        built_as = self.__dict__.get("_built_as")
        if built_as is not None:   # an inference copy's encode (every system's calls this): its forms' gathered
            check_unconverted(self, self, built_as)   # weights against the model's (a direct encode / step had
            # decoded with the old ones after the model's changed, or failed inside a kernel after a conversion)
        if prev_tokens is None and not torch.compiler.is_compiling():
            kept = getattr(_CHECKED, "batch", None)
            if kept is not None and kept[0] is self and kept[1] is src and kept[2] is src_lengths:
                return   # (forward checked this batch, its target side too, before its encode: checked_batch)
        name = type(self).__name__
        if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype != torch.long:
            raise ValueError(f"{name}: src must be a LongTensor [B, S], got "
                             f"{getattr(src, 'dtype', type(src).__name__)} {list(getattr(src, 'shape', []))}")
        B, S = src.shape
        if B == 0 or S == 0:   # (the transformer failed inside a reshape, the RNN systems named an inner layer)
            raise ValueError(f"{name}: src must hold at least one sentence of at least one token, got {[B, S]}")
        if not isinstance(src_lengths, Tensor):
            raise ValueError(f"{name}: src_lengths must be a LongTensor [B={B}], got {type(src_lengths).__name__}")
        if src_lengths.is_floating_point() or src_lengths.is_complex() or src_lengths.dtype == torch.bool:
            raise ValueError(f"{name}: src_lengths must hold integers, got dtype {src_lengths.dtype}")
        if tuple(src_lengths.shape) != (B,):
            raise ValueError(f"{name}: src_lengths must be a tensor [B={B}], got {list(src_lengths.shape)}")
        if src_lengths.is_meta:   # (its values are read below: torch's NotImplementedError from the copy)
            raise ValueError(f"{name}: src_lengths must hold values (a CPU or CUDA tensor), got a meta tensor")
        if not dk.functional.host_reads_allowed():   # (a data-dependent `if` would end a graph: an op in it)
            torch._assert_async(((src_lengths >= 1) & (src_lengths <= S)).all(), f"{name}: src_lengths must be in "
                                f"[1, S={S}]")
        elif not all(1 <= n <= S for n in dk.functional.host_list(src_lengths)):
            raise ValueError(f"{name}: src_lengths must be in [1, S={S}]")
        if prev_tokens is not None and (not isinstance(prev_tokens, Tensor) or prev_tokens.dim() != 2
                                        or prev_tokens.shape[0] != B or prev_tokens.shape[1] == 0
                                        or prev_tokens.dtype != torch.long):
            raise ValueError(f"{name}: prev_tokens must be a LongTensor [B={B}, T] with T >= 1, got "
                             f"{getattr(prev_tokens, 'dtype', type(prev_tokens).__name__)} "
                             f"{list(getattr(prev_tokens, 'shape', []))}")
        # ids outside the vocabularies: IndexError, as nn.Embedding's, naming them (one transfer for both)
        given = [(arg, ids, size) for arg, ids, size in (("src", src, self.src_vocab_size),
                                                         ("prev_tokens", prev_tokens, self.tgt_vocab_size))
                 if ids is not None and ids.numel()]
        # the padding id inside a sentence's length: a left-padded batch (as some toolkits make them) had been read
        # with its padding as words and its last words cut, without a word
        inside = torch.arange(S, device=src.device) < src_lengths.to(src.device)[:, None]
        padded = ((src == self.pad_id) & inside).any()
        padding_inside = (f"{name}: src holds the padding id {self.pad_id} inside a sentence's length (src_lengths): "
                          f"a batch is padded on the right, each sentence from position 0")
        if not dk.functional.host_reads_allowed():
            for arg, ids, size in given:
                torch._assert_async(((ids >= 0) & (ids < size)).all(), f"{name}: {arg} holds an id outside the "
                                    f"vocabulary's {size}")
            torch._assert_async(~padded, padding_inside)
            return
        bounds = torch.stack([v for _, ids, _ in given for v in torch.aminmax(ids)] + [padded.long()]).tolist()
        if bounds.pop():
            raise ValueError(padding_inside)
        for (arg, _, size), lo, hi in zip(given, bounds[0::2], bounds[1::2]):
            if lo < 0 or hi >= size:
                raise IndexError(f"{name}: {arg} holds the id {hi if hi >= size else lo}, outside the "
                                 f"{'source' if arg == 'src' else 'target'} vocabulary's {size} ids")


@contextlib.contextmanager
def checked_batch(model: nn.Module, src: Tensor, src_lengths: Tensor, prev_tokens: Optional[Tensor] = None):
    """`model.check_batch(src, src_lengths, prev_tokens)`, then a block (a training forward) in which the same check of
    these very tensors returns at once (the forward's encode checks them again) and the lengths are read on the host
    once (dk.functional.host_reads_kept: the checks, the encoder's mask and the first state read them): each read is
    a synchronisation on a GPU. The batch checked is the calling thread's, held by reference (not on the model: a
    copy of the model made meanwhile, or another thread, never takes it for checked). Under torch.compile (no host
    reads there) only the check: the batch's tensors would guard the compiled graph."""
    with dk.functional.host_reads_kept():
        model.check_batch(src, src_lengths, prev_tokens)
        if torch.compiler.is_compiling():
            yield
            return
        outer = getattr(_CHECKED, "batch", None)
        _CHECKED.batch = (model, src, src_lengths)
        try:
            yield
        finally:
            _CHECKED.batch = outer


_CHECKED = threading.local()   # .batch: (model, src, src_lengths) of the calling thread's checked_batch block


def summary(model: nn.Module) -> str:
    """Parameter counts by top-level submodule and in total, as a printable table (also printed). A parameter that
    several submodules share (tied embeddings) is counted in the first that holds it and named in the others' rows, so
    that the rows add up to the total."""
    lines = [f"{type(model).__name__} ({getattr(model, 'model_name', '')})"]
    owner = {}   # id of a parameter -> the submodule it is counted in
    for name, child in model.named_children():
        own, shared = 0, set()
        for p in child.parameters():
            if owner.setdefault(id(p), name) == name:
                own += p.numel()
            else:
                shared.add(owner[id(p)])
        note = f"  (and {', '.join(sorted(shared))}'s, tied)" if shared else ""
        lines.append(f"  {name:<24s} {own:>12,d}{note}")
    total = sum(p.numel() for p in model.parameters())  # tied parameters counted once
    lines.append(f"  {'total':<24s} {total:>12,d}")
    text = "\n".join(lines)
    print(text)
    return text
