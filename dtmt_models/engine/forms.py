"""The engine's frozen forms: the modules that stand in for a model's modules while decoding (`InferenceForm`s:
weights gathered once into the structures the engine's ops take, no autograd), and `inference_form(module)`, which
gives a module's form once, when a model is exported for decoding (Seq2Seq.inference_decoder):

    FrozenTransitionCell    a DeepTransitionGRUCell / ATRCell (the query and decoder transitions, mce's cell)
    FrozenTransitionLayer   a DeepTransitionGRU / ATR sequence layer (the encoders), with its int8, huge-page and
                            row-panel copies and its token tables (encode_tokens)
    AttentionStep           an additive attention module: the whole step as ops.attention_step
    FrozenReadout           a Readout: its features as ops.readout_features
    FrozenMemoryEncoder     a direction of mce's memory encoder: ops.memory_encoder

The kernels' layers (dtmt_kernels.nn) get their forms here; a model's own modules name theirs with an
`inference_module()` method, which builds one of these from its parameters where the fused ops can take it."""
from __future__ import annotations

import copy
import functools
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

import dtmt_kernels as dk
from dtmt_kernels.functional import lengths_to_mask
from dtmt_kernels.ops._extension import built
from dtmt_kernels.ops.linear import float64_products
from dtmt_kernels.ops.transition import KINDS

from . import ops


def runs_fused_inference(*modules: nn.Module) -> bool:
    """Whether the C++ inference ops may stand in for `modules` when decoding: the extension built, every module's
    backend "auto" or "cpp" (modules without one are not asked), and the first module's parameters on the CPU in
    float32 / float64. Asked once, when a model is prepared for decoding (Seq2Seq.inference_decoder)."""
    if not built() or any(getattr(m, "backend", "auto") not in ("auto", "cpp") for m in modules):
        return False
    p = next(modules[0].parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)


def plain_linear(m: Optional[nn.Module]) -> bool:
    """An nn.Linear (or dtmt_kernels.nn.Linear) that computes x W^T + b, its weight possibly parametrized (read
    once when its inference form is made): what the fused inference ops can take in its place."""
    return isinstance(m, nn.Linear) and type(m).forward in (nn.Linear.forward, dk.nn.Linear.forward)


class InferenceForm(nn.Module):
    """Base of the modules that stand in for another one while decoding: `inference_form(module)` returns one (or
    the module itself where the C++ inference ops cannot take it), and Seq2Seq.inference_decoder swaps them into a
    copy of the model. It holds the weights gathered once, in the layout the C++ op takes, computes
    the same function as the module without autograd (inference only), and answers every other attribute from
    the module it stands for (`source`). Its gathered weights are copies taken when it is made, while what it
    answers from `source`, and the modules of the decoder it is not swapped for (the target embedding the step
    reads), are the model's own tensors: after the parameters change, make a new decoder. An old one decodes
    with a mix of old and new weights (its fused search and its step loop then differ too)."""

    def __init__(self, source: nn.Module):
        super().__init__()
        self.__dict__["_source"] = source   # not a submodule: the form is not a parent of what it replaces
        self.training = False   # (a form decodes in eval mode, whatever its source's mode)

    @property
    def source(self) -> nn.Module:
        return self.__dict__["_source"]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_source"], name)

    def _apply(self, fn, recurse=True):   # (.to(), .double(), .cuda(): its gathered weights would stay as they are)
        raise inference_conversion(self)

    def sample_dropout_masks(self, batch_size: int, like: Optional[Tensor] = None) -> None:
        """None: a form decodes without candidate dropout (answered from its source, the masks followed the
        source's mode: a layer training again made the form's outputs random)."""
        return None


def inference_conversion(module) -> TypeError:
    """The error for converting a decoder (.to(), .double(), .cuda()) of which `module` (or a module of that class
    name) is a part: its weights were gathered once, in the layouts the engine's ops take, and a conversion would
    not reach them."""
    name = module if isinstance(module, str) else type(module).__name__
    return TypeError(f"{name}: a decoder (inference_decoder()) holds its weights as gathered when it "
                     "was built, which .to() / .double() / .cuda() do not reach; convert the model, then build its "
                     "decoder again")


def weights_kind(model: nn.Module) -> Tuple[tuple, tuple]:
    """What a decoder records of `model` when built and compares before a search (`check_unconverted`): each
    parameter's name, dtype and device, what a conversion (.to() / .double() / .cuda(), of the model or of a part)
    changes; and where the values of the model an inference copy was built from (`_built_from`, whose parameters
    the copy's forms read) are: each parameter's identity, its storage's address and its version counter, which a
    change in place (an optimizer step, load_state_dict) moves, as a new tensor put in its place does (load_state_dict
    with assign=True, `param.data = ...`, vector_to_parameters); the same of each buffer (a pruning mask, which a
    pruning step replaces: torch.nn.utils.prune's weight is its parameter times the mask). Inference tensors
    (made under torch.inference_mode) keep no version counter: theirs are told by a sample of their values (up to 64
    a tensor, evenly spread, read in one transfer), which a change of every value (load_state_dict) moves and a
    change of a few may not. A change through `param.data` moves no version counter and is not seen."""
    kinds = tuple((name, p.dtype, p.device) for name, p in model.named_parameters())
    source = model.__dict__.get("_built_from", model)
    tensors = [*source.parameters(), *source.buffers()]
    places = tuple((id(t), t.data_ptr(), None if t.is_inference() else t._version) for t in tensors)
    return kinds, places + (inference_sample(tensors),)


def inference_sample(tensors) -> bytes:
    """Up to 64 values of each inference tensor of `tensors`, evenly spread, as bytes (b"" where none is one): what
    weights_kind compares for the tensors without a version counter."""
    with torch.inference_mode():   # (reading inference tensors: no autograd, no version counter)
        parts = [t.detach().reshape(-1)[::-(-t.numel() // 64)].contiguous().view(-1).view(torch.uint8)
                 for t in tensors if t.is_inference() and t.numel()]
        return torch.cat([p.to(parts[0].device) for p in parts]).cpu().numpy().tobytes() if parts else b""


def check_unconverted(decoder, model: nn.Module, built_as) -> None:
    """TypeError, in one line, where `model` (whose parameters `decoder` shares), or a part of it, was converted
    after `decoder` was built (`built_as`: weights_kind then): the parameters converted in place, the weights the
    decoder gathered did not, and its search failed deep inside an op ('mat1 and mat2 must have the same dtype').
    RuntimeError where its weights changed since (an optimizer step, load_state_dict): the decoder read the
    parameters it shares as they are now and its gathered copies as they were, a model of neither, without a
    word."""
    kinds, places = weights_kind(model)
    for (name, dtype, device), (_, was_dtype, was_device) in zip(kinds, built_as[0]):
        if (dtype, device) != (was_dtype, was_device):   # (the first parameter converted: a part converted alone
            raise TypeError(                             # had been seen only where it was the first)
                f"{type(decoder).__name__}: its model was converted to {dtype} on {device} after the decoder "
                f"gathered its weights in {was_dtype} on {was_device}, which .to() / .double() / .cuda() do not "
                f"reach ({name}); build its decoder again (model.inference_decoder())")
    if places != built_as[1] or kinds != built_as[0]:
        raise RuntimeError(f"{type(decoder).__name__}: its model's weights changed in place (an optimizer step, "
                           f"load_state_dict) or were replaced after the decoder gathered them, and it would decode "
                           f"with weights the model no longer has; build its decoder again")


class FrozenTransitionCell(InferenceForm):
    """A DeepTransitionGRUCell / ATRCell for decoding: h' = cell(x [B, I], h [B, H] = zeros) with its kernel
    parameters gathered once (`kind`, `params`, `eps`: what torch.ops.dtmt.transition_forward and rnmt_step take).
    No candidate dropout (decoding is in eval mode)."""

    def __init__(self, cell: "dk.nn.TransitionCell"):
        super().__init__(cell)
        self.cell, self.kind, self.eps = cell.cell, KINDS[cell.cell], cell.eps
        with torch.no_grad():
            self.params = cell.kernel_params(0)

    @torch.no_grad()   # inference only: its ops write into buffers, which autograd refuses
    def forward(self, x: Tensor, h0: Optional[Tensor] = None, drop: Optional[Tensor] = None) -> Tensor:
        h = x.new_zeros(x.shape[0], self.source.hidden_size) if h0 is None else h0
        return torch.ops.dtmt.transition_forward(x.unsqueeze(0), h, None, drop, self.kind, *self.params, False,
                                                 self.eps)[1]


class FrozenTransitionLayer(InferenceForm):
    """A DeepTransitionGRU / ATR sequence layer for encoding: the layer's forward (the same checks, shapes and
    results) with each direction's kernel parameters gathered once (`directions`: (kind, params) pairs as
    FrozenTransitionCell holds them, for torch.ops.dtmt.transition_forward). No candidate dropout (eval mode).
    `int8()`: a copy whose recurrent matrices are int8 rows (int8 decoding); `on_huge_pages()`: a copy whose
    parameters sit in 2 MiB pages; `with_row_panels()`: a copy that also holds each direction's recurrent matrices in
    the row-panel layout (`panels`: (w_hh, t_w) panels a direction, or None), which transition_encode multiplies at
    batch 1 (dtmt_kernels.ops.linear.panels: the same outputs up to rounding). `input_products(rows)` and
    `encode_tokens`: the layer over token ids, their inputs' products with the input matrices made once as tables
    (torch.ops.dtmt.transition_encode_tokens: no input GEMM a call)."""

    def __init__(self, layer: "dk.nn.TransitionLayer", directions: Optional[List[Tuple[int, List[Tensor]]]] = None,
                 panels: Optional[List[Tuple[Tensor, Tensor]]] = None):
        super().__init__(layer)
        self.eps = layer.eps
        if directions is None:
            with torch.no_grad():
                directions = [(KINDS[layer.cell], layer.kernel_params(d)) for d in range(layer.num_directions)]
        self.directions, self.panels = directions, panels
        # CPU weights: every direction in one call of transition_encode (on two threads, a direction a thread), its
        # ten parameters followed by its two panel tensors where there are panels
        on_cpu = directions[0][1][0].device.type == "cpu"
        self._flat = None
        if on_cpu:
            self._flat = [t for d, (_, params) in enumerate(directions)
                          for t in (params if panels is None else [*params, *panels[d]])]

    @torch.no_grad()   # inference only: its ops write into buffers, which autograd refuses
    def forward(self, x: Tensor, h0: Optional[Tensor] = None, lengths=None) -> Tuple[Tensor, Tensor]:
        return dk.nn.TransitionLayer.forward(self, x, h0, lengths)

    # the layer's forward calls these on this form, so that they reach its _run (an attribute the form lacks is the
    # source layer's, bound to it: its own ops on its own weights)
    _time_major = dk.nn.TransitionLayer._time_major
    _forward_packed = dk.nn.TransitionLayer._forward_packed

    def _run(self, x: Tensor, h0: Tensor, mask: Optional[Tensor], drops: List[Optional[Tensor]]):
        if self._flat is not None and drops[0] is None:
            return torch.ops.dtmt.transition_encode(x, h0, mask, self.directions[0][0], self._flat,
                                                    getattr(self.source, "reverse", False), self.eps)
        return dk.nn.each_direction(self.source, lambda d, reverse: torch.ops.dtmt.transition_forward(
            x, h0[d], mask, drops[d], self.directions[d][0], *self.directions[d][1], reverse, self.eps)[:2])

    # the flat parameters' recurrent matrices: w_hh and the T-GRUs' t_w (ops.transition.flat_params order)
    RECURRENT = (2, 6)

    # the largest input_products table made (bytes)
    INPUT_TABLE_BYTES = 64 << 20

    def input_products(self, rows: Tensor) -> Optional[Tensor]:
        """The products of input rows [n, input_size] (an embedding's rows, or its position rows) with every
        direction's input matrix, without biases: [n, D * n_in*H], direction d in columns d*n_in*H.. (what
        encode_tokens reads as its table or position_table), computed in float64 and rounded once to the weights'
        dtype. None where the layer cannot take tables: weights that are not float32 / float64 on the CPU, rows of
        another width or dtype, or a table past INPUT_TABLE_BYTES."""
        w_ih = [params[0] for _, params in self.directions]
        if (self._flat is None or not all(w.dtype in (torch.float32, torch.float64) and w.dtype == rows.dtype
                                          for w in w_ih)
                or rows.dim() != 2 or rows.shape[1] != self.input_size or rows.device.type != "cpu"):
            return None
        width = sum(w.shape[0] for w in w_ih)
        if rows.shape[0] * width * rows.element_size() > self.INPUT_TABLE_BYTES:
            return None
        return float64_products(rows, w_ih)

    def encode_tokens(self, tokens: Tensor, table: Tensor, position_table: Optional[Tensor] = None,
                      lengths=None) -> Tuple[Tensor, Tensor]:
        """`forward` over the inputs whose products `table` holds: tokens [B, T] ([T, B] if not batch_first) of
        int64 ids, table = input_products(embedding rows) [V, D * n_in*H], position_table = input_products(position
        rows) [>= T, ...], each position's row added to its token's, or None. From a zero state, the same (out, h_n)
        as forward over x = embedding[tokens] (+ positions) up to rounding."""
        name = type(self).__name__
        if self._flat is None:
            raise ValueError(f"{name}.encode_tokens: the C++ encoder takes CPU weights, got them on "
                             f"{self.directions[0][1][0].device}")
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"{name}.encode_tokens: tokens must be int64 [B, T] (batch_first) or [T, B], got "
                             f"{tokens.dtype} {list(tokens.shape)}")
        t = tokens.t() if self.batch_first else tokens
        T, B = t.shape
        if T == 0 or B == 0:
            raise ValueError(f"{name}.encode_tokens: at least one step and one sequence, got {list(tokens.shape)}")
        h0 = table.new_zeros(self.num_directions, B, self.hidden_size)
        mask = None if lengths is None else lengths_to_mask(lengths, T, B, table.dtype, table.device, name,
                                                            none_if_unpadded=True)
        out, h_n = torch.ops.dtmt.transition_encode_tokens(t, table, position_table, h0, mask, self.directions[0][0],
                                                           self._flat, getattr(self.source, "reverse", False),
                                                           self.eps)
        return (out.transpose(0, 1) if self.batch_first else out), h_n

    def int8(self) -> "FrozenTransitionLayer":
        """A copy with each direction's recurrent matrices (w_hh, the T-GRUs' t_w) as int8 rows, which
        transition_forward multiplies by the states quantized per row (small_gemm.h). The input matrix w_ih stays
        float32: its product is one GEMM over all the positions, not a step's; biases and layer norms too. CPU
        float32 weights only (ValueError otherwise)."""
        from dtmt_kernels.ops.linear.quantize import pack_int8_rows

        first = self.directions[0][1][2]
        if first.dtype == torch.int8:
            return self
        if first.dtype != torch.float32 or first.device.type != "cpu":
            raise ValueError(f"FrozenTransitionLayer.int8: int8 rows are made from CPU float32 weights, got "
                             f"{first.dtype} on {first.device}")
        return FrozenTransitionLayer(self.source, [
            (kind, [pack_int8_rows(p) if i in self.RECURRENT and p.numel() else p for i, p in enumerate(params)])
            for kind, params in self.directions])

    def on_huge_pages(self) -> "FrozenTransitionLayer":
        """A copy whose directions' parameters (float or int8) are copied, one direction after the other, into one
        buffer of 2 MiB pages (dtmt_kernels.ops.linear.placement.huge_page_copies: the recurrent matrices are read at
        every position; the same values, so the same results). The layer itself where huge pages are not offered."""
        from dtmt_kernels.ops.linear.placement import huge_page_copies, huge_pages_offered

        if not huge_pages_offered() or self._flat is None:
            return self
        panels = self.panels or []
        copies = iter(huge_page_copies([p for _, params in self.directions for p in params] +
                                       [p for pair in panels for p in pair]))
        directions = [(kind, [next(copies) for _ in params]) for kind, params in self.directions]
        return FrozenTransitionLayer(self.source, directions,
                                     [(next(copies), next(copies)) for _ in panels] if self.panels else None)

    def with_row_panels(self) -> "FrozenTransitionLayer":
        """A copy holding, beside its parameters, each direction's w_hh and T-GRU matrices t_w in the row-panel
        layout (dtmt_kernels.ops.linear.panels.row_panels: the same values, one more copy of the recurrent matrices),
        for transition_encode's products at batch 1; the layer itself where its weights are not CPU float32 (int8 rows,
        another device or dtype) or it has panels already."""
        from dtmt_kernels.ops.linear.panels import row_panels

        w_hh = self.directions[0][1][self.RECURRENT[0]]
        if self.panels is not None or self._flat is None or w_hh.dtype != torch.float32:
            return self
        with torch.no_grad():
            panels = [(row_panels(params[self.RECURRENT[0]]),
                       row_panels(params[self.RECURRENT[1]]) if params[self.RECURRENT[1]].numel()
                       else params[self.RECURRENT[1]]) for _, params in self.directions]
        return FrozenTransitionLayer(self.source, self.directions, panels)


class AttentionStep(InferenceForm):
    """An attention module for decoding (its `inference_module()`): the same forward(query, keys, annotations,
    src_mask) -> (context, weights) as one C++ call, `ops.attention_step`, with the weights (`weights`, an
    AttentionWeights) gathered once; `precompute` and everything else is the module's own. `single_head`: the
    module's keys are [B, S, A] and its weights [B, S] (AdditiveAttention), else [B, S, NH, D] and [B, NH, S].
    Inference only."""

    def __init__(self, source: nn.Module, weights: ops.AttentionWeights, single_head: bool):
        super().__init__(source)
        self.weights, self.single_head = weights, single_head

    def forward(self, query: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor) -> Tuple[Tensor, Tensor]:
        if self.single_head:
            context, alpha = ops.attention_step(query, keys.unsqueeze(2), annotations, src_mask, self.weights)
            return context, alpha.squeeze(1)
        return ops.attention_step(query, keys, annotations, src_mask, self.weights)


class FrozenReadout(InferenceForm):
    """A Readout for decoding (its `inference_module()`): `features` as one C++ call, `ops.readout_features`, with
    the weights (`weights`, a ReadoutWeights) gathered once; the deep layers, projection and log-softmax are the
    readout's own. Inference only."""

    def __init__(self, source: nn.Module, weights: ops.ReadoutWeights):
        super().__init__(source)
        self.weights = weights

    def features(self, y: Tensor, s: Tensor, c: Tensor) -> Tensor:
        return ops.readout_features(y, s, c, self.weights)

    def logits(self, features: Tensor) -> Tensor:
        return self.source.logits(features)

    def forward(self, features: Tensor) -> Tensor:
        return self.source(features)


class FrozenMemoryEncoder(InferenceForm):
    """A direction of mce's memory encoder for decoding (its `inference_module()`): the whole loop over the source as
    one C++ call with the same arithmetic, `ops.memory_encoder`, its cell (a FrozenTransitionCell) and addressing
    weights (a MemoryWeights) gathered once. Inference only."""

    def __init__(self, source: nn.Module, cell: FrozenTransitionCell, weights: ops.MemoryWeights):
        super().__init__(source)
        self.cell, self.weights = cell, weights

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, reverse: bool) -> Tuple[Tensor, Tensor]:
        return ops.memory_encoder(x, memory, src_mask, reverse, self.cell, self.weights)


@functools.singledispatch
def inference_form(module: nn.Module) -> nn.Module:
    """`module`'s form for decoding: what its `inference_module()` returns where it has one (a subclass of the
    kernels' layers too), a FrozenTransitionLayer / FrozenTransitionCell for the kernels' layers and cells where the
    cpp backend runs their parameters (runs_fused_inference), else the module itself."""
    own = getattr(module, "inference_module", None)
    return own() if own is not None else module


@inference_form.register
def _(layer: dk.nn.TransitionLayer) -> nn.Module:
    if hasattr(layer, "inference_module"):   # (a subclass that names its own)
        return layer.inference_module()
    return FrozenTransitionLayer(layer) if runs_fused_inference(layer) else layer


@inference_form.register
def _(cell: dk.nn.TransitionCell) -> nn.Module:
    if hasattr(cell, "inference_module"):
        return cell.inference_module()
    return FrozenTransitionCell(cell) if runs_fused_inference(cell) else cell


def inference_copy(module: nn.Module, form: Callable[[nn.Module], nn.Module] = inference_form) -> nn.Module:
    """`module` with every submodule whose `form` (default: engine.forms.inference_form) is another module replaced
    by it, as shallow copies of the modules on the way (parameters, buffers and the untouched submodules shared);
    `module` itself where nothing is replaced. ValueError for a module with a submodule in training mode (its
    dropout would run in the copy, which shares it: pass dtmt_models.models.modes.eval_copy(module))."""
    if any(m.training for m in module.modules()):
        raise ValueError(f"inference_copy: {type(module).__name__} is in training mode (a module under it is), and the "
                         f"copy would decode with its dropout; pass an eval copy (dtmt_models.models.modes.eval_copy) "
                         f"or call .eval() first")
    return _inference_copy(module, form)


def _inference_copy(module: nn.Module, form: Callable[[nn.Module], nn.Module]) -> nn.Module:
    replaced = form(module)
    if replaced is not module:
        return replaced
    children = {name: None if child is None else _inference_copy(child, form)
                for name, child in module._modules.items()}
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    new = copy.copy(module)
    new.__dict__["_modules"] = children
    return new
