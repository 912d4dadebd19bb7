"""Drop-in recurrent layers: `DeepTransitionGRU`, `DeepTransitionGRUCell`, `ATR`, `ATRCell`; `Linear`, the
torch.nn.Linear of decoder steps (the small-row kernel at batch 1); and, from unrolled.py, `unrolled`, a block in
which step cells form their weight gradients once over all their steps (teacher forcing), with `step_context`, an
attention step's context whose gradient to the annotations is formed the same way. Their forms for decoding (weights
gathered once, no autograd) are the inference engine's (dtmt_models.engine.forms); `TransitionLayer` and
`TransitionCell` are the bases of the layers and the cells.

They are called like `torch.nn.GRU` / `torch.nn.GRUCell` (their constructors differ: options after the sizes are
keywords only, docs/usage.md): time-major input unless `batch_first` (or a PackedSequence),
`h0` of shape [num_directions, B, H], outputs `(out [T, B, D*H], h_n [D, B, H])`, plus `lengths` for padded batches and
`reverse=True` for a unidirectional layer that reads each sequence right to left (stacks with alternating
directions).
The parameters are the same for every backend; `layer.backend = "reference"` switches a live module.

Parameter names (one direction; the reverse direction repeats them with the suffix `_reverse`):

    weight_ih [n_in*H, I], weight_hh [n_h*H, H]     base cell, rows stacked as in ops/transition/reference.py
    bias_ih, bias_hh                                 all rows without layer norm; with layer norm only the
                                                     non-gate rows (candidate, linear path): the LN offsets
                                                     replace the gate biases
    ln_weight, ln_bias [n_gates*H]                   per-gate layer-norm gains and offsets (layer_norm=True)
    tgru{k}_weight_hh [3H, H], tgru{k}_bias_hh,      T-GRU k = 1..depth, same bias rule
    tgru{k}_ln_weight, tgru{k}_ln_bias [2H]

ATR has weight_ih [H, I], weight_hh [H, H] and bias_hh [H] (the b of q = U h + b), or, with layer norm,
ln_weight / ln_bias [2H] for p and q (the q offset plays the role of b).
With `bias=False` (torch.nn.GRU's flag) a layer has no bias_ih, bias_hh or tgru{k}_bias_hh: those terms are zero;
layer-norm gains and offsets stay.
"""
from __future__ import annotations

import collections
import math
import numbers
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .autograd import CppTransitionStepFunction, CppUnrolledWeightsFunction, UnrolledSteps
from .backends import BackendSwitch, resolve_backend
from .functional import check_dtype_for_backend, lengths_to_mask, linear, padding_zeroed
from .ops._autocast import autocast_mix
from .ops._register import check_transforms
from .ops.transition.op import check_drop
from .ops.transition import CELL_KINDS, CELL_ROWS, DEEP_TRANSITION_CELLS, KINDS, flat_params
from .reference import TransitionWeights
from .unrolled import Unrollable, step_context, unrolled  # noqa: F401 (dk.nn's names for the block)


# The backends whose step cells run an `unrolled` block as one sequence (their weight gradients once over all steps).
# The CUDA kernels take it too (transition_backward with weight_grads=False): "cuda" joins this set once a GPU session
# has held it to the step-by-step path (tests/test_unrolled.py, test_gpu_unrolled_matches_the_cuda_step_path) and
# measured it (bench_train.py --fused cuda cuda+unrolled); until then a GPU update forms them step by step. Only
# "cpp" and "cuda" mean anything here: the steps call torch.ops.dtmt, whose kernels the tensors' device picks.
UNROLLED_BACKENDS = frozenset({"cpp"})


# The most T-GRUs a transition takes (the papers use up to 4; a million took minutes to build, parameter by
# parameter), and the largest input or hidden size (the kernels' int32 sizes).
MAX_DEPTH = 256
MAX_SIZE = 2 ** 31 - 1


def _check_flag(name: str, arg: str, value) -> None:
    """A switch is a bool (numpy's too) or an integer 0 or 1 (numpy's too): ValueError naming it otherwise
    (layer_norm="no" had meant True)."""
    if not (isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))
            or (isinstance(value, numbers.Integral) and value in (0, 1))):
        raise ValueError(f"{name}: {arg} must be True or False, got {value!r}")


class _TransitionBase(BackendSwitch, nn.Module):
    """Parameters, backend switch and input checks shared by the layers and cells of this module."""

    def __init__(self, input_size: int, hidden_size: int, cell: str, depth: int, layer_norm: bool,
                 num_directions: int, candidate_dropout: float, backend: str, eps: float = 1e-5, device=None,
                 dtype=None, bias: bool = True):
        super().__init__()
        name = type(self).__name__
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"{name}: dtype must be a floating-point torch.dtype, got {dtype!r}")
        for arg, value, low, high in (("input_size", input_size, 1, MAX_SIZE),
                                      ("hidden_size", hidden_size, 1, MAX_SIZE), ("depth", depth, 0, MAX_DEPTH)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name}: {arg} must be an int from {low} to {high:,}, got {value!r}")
        if cell not in CELL_KINDS:
            raise ValueError(f"{name}: cell must be one of {CELL_KINDS}, got {cell!r}")
        _check_flag(name, "layer_norm", layer_norm)
        _check_flag(name, "bias", bias)
        self.bias = bool(bias)   # (False: no gate biases, as torch.nn.GRU(bias=False); layer-norm offsets stay)
        self.input_size, self.hidden_size, self.cell, self.depth = input_size, hidden_size, cell, depth
        self.layer_norm, self.num_directions = bool(layer_norm), num_directions
        self.candidate_dropout, self.eps = candidate_dropout, eps
        self.backend = backend
        for sfx in self._suffixes():
            for pname, shape in self._parameter_shapes(sfx):
                self.register_parameter(pname, nn.Parameter(torch.empty(*shape, device=device, dtype=dtype)))
        self.reset_parameters()

    @property
    def candidate_dropout(self) -> float:
        """The probability of dropping a candidate unit in training (DTMT's candidate dropout), in [0, 1): checked
        whenever it is set, at construction or after (set to 1 afterwards, the outputs were NaN: 0 / 0)."""
        return self._candidate_dropout

    @candidate_dropout.setter
    def candidate_dropout(self, value) -> None:
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 <= float(value) < 1.0:
            raise ValueError(f"{type(self).__name__}: candidate_dropout must be a number in [0, 1), got {value!r}")
        if value and self.cell == "atr":   # (it was taken and did nothing: an ATR step has no candidate)
            raise ValueError(f"{type(self).__name__}: ATR has no candidate to drop (contract §2); candidate_dropout "
                             f"must be 0, got {value!r}")
        self._candidate_dropout = float(value)

    def __setstate__(self, state: dict) -> None:
        # a module pickled whole (torch.save(module)) by an earlier version: candidate_dropout and backend, now
        # properties, under their plain names; no `bias` flag (every layer had its biases then)
        state = dict(state)
        for plain in ("candidate_dropout", "backend"):
            if plain in state:
                state.setdefault(f"_{plain}", state.pop(plain))
        state["_candidate_dropout"] = float(state.get("_candidate_dropout", 0.0))
        state.setdefault("bias", True)
        super().__setstate__(state)

    # ----------------------------------------------------------------------------------------------- setup
    def _suffixes(self) -> List[str]:
        return ["", "_reverse"][: self.num_directions]

    def _parameter_shapes(self, sfx: str = "") -> List[Tuple[str, Tuple[int, ...]]]:
        """The parameters of one direction (suffix "" or "_reverse"): names and shapes, in the order registered."""
        H, I = self.hidden_size, self.input_size
        n_in, n_h, n_g = CELL_ROWS[self.cell]
        shapes = [(f"weight_ih{sfx}", (n_in * H, I)), (f"weight_hh{sfx}", (n_h * H, H))]
        if self.cell == "atr":
            if self.bias and not self.layer_norm:
                shapes.append((f"bias_hh{sfx}", (H,)))
        elif self.bias:
            skip = n_g if self.layer_norm else 0
            shapes += [(f"bias_ih{sfx}", ((n_in - skip) * H,)), (f"bias_hh{sfx}", ((n_h - skip) * H,))]
        if self.layer_norm:
            shapes += [(f"ln_weight{sfx}", (n_g * H,)), (f"ln_bias{sfx}", (n_g * H,))]
        for k in range(1, self.depth + 1):
            shapes.append((f"tgru{k}_weight_hh{sfx}", (3 * H, H)))
            if self.bias:
                shapes.append((f"tgru{k}_bias_hh{sfx}", ((3 - (2 if self.layer_norm else 0)) * H,)))
            if self.layer_norm:
                shapes += [(f"tgru{k}_ln_weight{sfx}", (2 * H,)), (f"tgru{k}_ln_bias{sfx}", (2 * H,))]
        return shapes

    def _weights_read(self, direction: int = 0) -> dict:
        """Name -> the tensor a forward computes with, for each parameter of one direction: the module's attribute of
        that name, as torch.nn.GRU reads its weights, so that a parametrization (weight_norm, spectral_norm, pruning)
        or a replica's plain tensors (nn.DataParallel) is what runs, not the parameter behind it. (The parameter
        itself where it is one: read so, a step costs no more than before; the names are listed once a module.)"""
        names = self.__dict__.get("_weight_names")
        if names is None:
            names = self.__dict__["_weight_names"] = tuple(tuple(name for name, _ in self._parameter_shapes(sfx))
                                                           for sfx in self._suffixes())
        params = self._parameters
        return {name: params[name] if name in params else getattr(self, name) for name in names[direction]}

    def reset_parameters(self) -> None:
        """Weights and biases ~ U(-1/√H, 1/√H) as torch.nn.GRU; layer-norm gains 1, offsets 0."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for name, p in self.named_parameters():
            if "ln_weight" in name:
                nn.init.ones_(p)
            elif "ln_bias" in name:
                nn.init.zeros_(p)
            else:
                nn.init.uniform_(p, -bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.cell != "atr":
            s += f", cell={self.cell!r}, depth={self.depth}"
        s += f", layer_norm={self.layer_norm}"
        if not self.bias:
            s += ", bias=False"
        if self.num_directions == 2:
            s += ", bidirectional=True"
        if getattr(self, "batch_first", False):
            s += ", batch_first=True"
        if getattr(self, "reverse", False):
            s += ", reverse=True"
        if self.candidate_dropout:
            s += f", candidate_dropout={self.candidate_dropout}"
        return s + f", backend={self.backend!r}"

    # ------------------------------------------------------------------------------------------ weights
    def direction_weights(self, direction: int = 0, params: Optional[dict] = None) -> TransitionWeights:
        """The flat, full-width parameters of one direction, as every backend takes them. `params` (name ->
        tensor, as `named_parameters()`) replaces the module's own, for functional use."""
        sfx = self._suffixes()[self._check_direction(direction)]
        p = self._weights_read(direction) if params is None else params
        H = self.hidden_size
        w_ih, w_hh = p[f"weight_ih{sfx}"], p[f"weight_hh{sfx}"]
        ln_w, ln_b = p.get(f"ln_weight{sfx}"), p.get(f"ln_bias{sfx}")
        if self.cell == "atr":
            b_ih = w_ih.new_zeros(H)  # p = W x has no bias
            b_hh = p.get(f"bias_hh{sfx}", None)
            b_hh = w_hh.new_zeros(H) if b_hh is None else b_hh
        elif not self.bias:   # (bias=False: the ops' zero biases)
            b_ih, b_hh = w_ih.new_zeros(w_ih.shape[0]), w_hh.new_zeros(w_hh.shape[0])
        else:
            n_g = CELL_ROWS[self.cell][2]
            b_ih = self._full_bias(p[f"bias_ih{sfx}"], n_g)
            b_hh = self._full_bias(p[f"bias_hh{sfx}"], n_g)
        t_w, t_b, t_ln_w, t_ln_b = [], [], [], []
        for k in range(1, self.depth + 1):
            w = p[f"tgru{k}_weight_hh{sfx}"]
            t_w.append(w)
            t_b.append(self._full_bias(p[f"tgru{k}_bias_hh{sfx}"], CELL_ROWS["tgru"][2]) if self.bias
                       else w.new_zeros(w.shape[0]))
            t_ln_w.append(p.get(f"tgru{k}_ln_weight{sfx}"))
            t_ln_b.append(p.get(f"tgru{k}_ln_bias{sfx}"))
        return TransitionWeights(self.cell, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b)

    def _check_direction(self, direction) -> int:
        """`direction`, an int from 0 to num_directions - 1: ValueError otherwise (-1 had read the reverse
        direction's weights, 2 was an IndexError)."""
        if not isinstance(direction, numbers.Integral) or isinstance(direction, bool) \
                or not 0 <= direction < self.num_directions:
            allowed = "0 or 1" if self.num_directions == 2 else "0 (the layer has one direction)"
            raise ValueError(f"{type(self).__name__}: direction must be {allowed}, got {direction!r}")
        return int(direction)

    def kernel_params(self, direction: int = 0) -> List[Tensor]:
        """The ten flat, contiguous parameter tensors of one direction in the ops' order (ops.transition.flat_params:
        T-GRU weights stacked, a copy where depth > 1; absent ones empty, as the ops' tensor lists take them), made
        by differentiable ops: under autograd they lead back to the parameters (the unrolled steps), under
        torch.no_grad they are plain tensors (the inference forms)."""
        empty = self.weight_hh.new_empty(0)
        return [empty if t is None else t.contiguous() for t in flat_params(self.direction_weights(direction))]

    def _full_bias(self, bias: Tensor, n_gates: int) -> Tensor:
        if not self.layer_norm:
            return bias
        return torch.cat([bias.new_zeros(n_gates * self.hidden_size), bias])

    def sample_dropout_masks(self, batch_size: int, like: Optional[Tensor] = None) -> Optional[Tensor]:
        """Candidate-dropout multipliers [depth+1, B, H] for one direction (None when dropout is off or in
        eval mode). Pass the result to a cell's every step to keep the mask fixed over time."""
        traced = isinstance(batch_size, torch.SymInt) or (   # (a size traced by torch.compile / torch.jit.trace)
            isinstance(batch_size, Tensor) and batch_size.dim() == 0 and not batch_size.is_floating_point()
            and not batch_size.is_complex() and batch_size.dtype != torch.bool)
        if not traced and (not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool)
                           or batch_size < 0):
            raise ValueError(f"{type(self).__name__}: batch_size must be an int >= 0, got {batch_size!r}")
        if not (self.training and self.candidate_dropout > 0):
            return None
        ref = like if like is not None else self.weight_hh
        keep = 1.0 - self.candidate_dropout
        shape = (self.depth + 1, batch_size, self.hidden_size)
        return torch.empty(shape, dtype=ref.dtype, device=ref.device).bernoulli_(keep).div_(keep)

    # ------------------------------------------------------------------------------------------- checks
    def _check_tensor(self, t, arg: str, expected: str) -> None:
        name = type(self).__name__
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: {arg} must be a Tensor {expected}, got {type(t).__name__}")
        ref = self.weight_hh
        if not t.is_floating_point():
            raise ValueError(f"{name}: {arg} must be a floating-point Tensor {expected}, got dtype {t.dtype}")
        # under autocast, float32 beside the autocast dtype either way (its rule casts them: ops/_autocast.py)
        if t.dtype != ref.dtype and not autocast_mix((t.dtype, ref.dtype), t):
            self._check_parameters()   # (weight_hh itself converted alone: named, not "the parameters")
            raise ValueError(f"{name}: {arg} has dtype {t.dtype} but the parameters are {ref.dtype}; "
                             f"convert one of them (e.g. layer.to({t.dtype}))")
        if t.device != ref.device:
            self._check_parameters()
            raise ValueError(f"{name}: {arg} is on {t.device} but the parameters are on {ref.device}")

    def _check_h(self, h: Optional[Tensor], expected_shape: Tuple[int, ...], label: str) -> None:
        if h is None:
            return
        self._check_tensor(h, "h0", label)
        if tuple(h.shape) != expected_shape:
            raise ValueError(f"{type(self).__name__}: h0 must have shape {label} = {list(expected_shape)}, "
                             f"got {list(h.shape)}")

    def _run(self, x: Tensor, h0: Tensor, mask: Optional[Tensor], drops: List[Optional[Tensor]]):
        """x [T, B, I] time-major, h0 [D, B, H] -> (out [T, B, D*H], h_n [D, B, H])."""
        backend = resolve_backend(self.backend, x.device)   # (also for no sequences: a backend that cannot run
        check_dtype_for_backend(backend, x.dtype, "x")       # here is an error at any batch size)
        if x.shape[1] == 0:   # torch.nn.GRU's answer to a batch of no sequences: empty outputs, zero gradients
            link = (x.sum() + sum(p.sum() for p in self.parameters())) * 0   # (in x's and the weights' graph)
            return x.new_zeros(x.shape[0], 0, self.num_directions * self.hidden_size) + link, h0 + link
        if backend.name == "reference":   # (it broadcasts a short bias where the ops refuse it; the checks cost
            self._check_parameter_shapes()   # nothing beside the reference's steps)
        try:
            x = padding_zeroed(x, mask)   # (non-finite padding made the gradients NaN)
            return each_direction(self, lambda d, reverse: backend.run(x, h0[d], self.direction_weights(d), mask,
                                                                        drops[d], reverse, self.eps))
        except RuntimeError:   # (the ops' own message, where a parameter is apart, named none: contract §3's one)
            self._check_parameter_shapes()
            self._check_parameters()
            raise

    def _check_parameter_shapes(self, direction: Optional[int] = None) -> None:
        """ValueError naming the first tensor a forward reads (`_weights_read`: a parameter, a parametrization's
        tensor, or one that torch.func.functional_call or an assignment put in its place) whose shape is not the one
        the layer's sizes give (the ops had refused it in their own names, b_hh for bias_hh, the reference had
        broadcast a bias of one value)."""
        for d in range(self.num_directions) if direction is None else (direction,):
            read = self._weights_read(d)
            for n, shape in self._parameter_shapes(self._suffixes()[d]):
                if tuple(read[n].shape) != shape:
                    raise ValueError(f"{type(self).__name__}: parameter {n} must be {list(shape)} (input_size "
                                     f"{self.input_size}, hidden_size {self.hidden_size}), got "
                                     f"{list(read[n].shape)}") from None

    def _check_parameters(self) -> None:
        """ValueError naming the first parameter whose device or dtype is not the others' (those of most of them):
        one loaded onto the meta device, or converted alone. Called only once an op has failed, so the checks cost
        nothing on a call that runs."""
        kinds = collections.Counter((p.dtype, p.device) for p in self.parameters())
        if len(kinds) < 2:
            return
        dtype, device = kinds.most_common(1)[0][0]
        for n, p in self.named_parameters():
            if (p.dtype, p.device) != (dtype, device):
                raise ValueError(f"{type(self).__name__}: parameter {n} is {p.dtype} on {p.device} but the others "
                                 f"are {dtype} on {device}; move or convert the whole layer (layer.to(...))") from None


def each_direction(layer, run) -> Tuple[Tensor, Tensor]:
    """`run(d, reverse) -> (out [T, B, H], h_n [B, H])` for each direction d of `layer` (d = 1, or a layer made
    with reverse=True, reads right to left), as the layer returns them: (out [T, B, D*H], h_n [D, B, H])."""
    outs, states = zip(*(run(d, d == 1 or getattr(layer, "reverse", False)) for d in range(layer.num_directions)))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, -1)), torch.stack(states)


class TransitionLayer(_TransitionBase):
    """Sequence layer: (x, h0=None, lengths=None) -> (out, h_n), like torch.nn.GRU."""

    num_layers = 1   # (torch.nn.GRU's attribute, which code sizing h0 reads: a layer here is one layer)

    def __init__(self, input_size, hidden_size, cell, depth, layer_norm, bidirectional, batch_first,
                 candidate_dropout, backend, reverse=False, device=None, dtype=None, bias=True):
        super().__init__(input_size, hidden_size, cell, depth, layer_norm, 2 if bidirectional else 1,
                         candidate_dropout, backend, device=device, dtype=dtype, bias=bias)
        for arg, value in (("bidirectional", bidirectional), ("batch_first", batch_first), ("reverse", reverse)):
            _check_flag(type(self).__name__, arg, value)
        if reverse and bidirectional:
            raise ValueError(f"{type(self).__name__}: reverse=True is for a unidirectional layer (it reads each "
                             "sequence right to left); a bidirectional layer already has both directions")
        self.bidirectional, self.batch_first, self.reverse = bool(bidirectional), bool(batch_first), bool(reverse)

    def forward(self, x, h0: Optional[Tensor] = None, lengths=None, *, hx: Optional[Tensor] = None):
        """x [T, B, I] ([B, T, I] if batch_first, [T, I] unbatched); h0 [D, B, H] (or hx=, torch.nn.GRU's name);
        lengths: B ints in [1, T] (padding at the end of each sequence). Returns out [T, B, D*H] (zeros at padded
        steps), h_n [D, B, H] (the state after each sequence's last real token, in each direction).

        x may be a PackedSequence (torch.nn.utils.rnn.pack_padded_sequence, sorted or not), as torch.nn.GRU takes
        it: out is then a PackedSequence of the same batch_sizes and order, h0 and h_n in the batch's own order
        (before packing), and lengths are the packed ones (the argument must be None)."""
        h0 = _initial_state(type(self).__name__, h0, hx)
        if isinstance(x, PackedSequence):
            return self._forward_packed(x, h0, lengths)
        name, I, H, D = type(self).__name__, self.input_size, self.hidden_size, self.num_directions
        layout = "[B, T, input_size]" if self.batch_first else "[T, B, input_size]"
        self._check_tensor(x, "x", layout)
        if x.dim() not in (2, 3) or x.shape[-1] != I:
            raise ValueError(f"{name}: x must have shape {layout} (or [T, input_size] unbatched) with "
                             f"input_size={I}, got {list(x.shape)}")
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(1)
            if h0 is not None:
                self._check_h(h0, (D, H), "[num_directions, hidden_size] (unbatched)")
                h0 = h0.unsqueeze(1)
            if lengths is not None:
                raise ValueError(f"{name}: lengths is for batched input; an unbatched x has no padding")
        elif self.batch_first:
            x = x.transpose(0, 1)
        out, h_n = self._time_major(x, h0, lengths, check_h0=not unbatched)
        if unbatched:
            return out.squeeze(1), h_n.squeeze(1)
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, h_n

    def flatten_parameters(self) -> None:
        """Nothing to do: torch.nn.GRU's gathers its weights into cuDNN's one buffer, and the ops here gather them
        at each forward. Present so that code written for torch.nn.GRU runs unchanged."""

    def _time_major(self, x: Tensor, h0: Optional[Tensor], lengths, check_h0: bool = True) -> Tuple[Tensor, Tensor]:
        """The layer on a checked time-major x [T, B, I]: (out [T, B, D*H], h_n [D, B, H])."""
        name, H, D = type(self).__name__, self.hidden_size, self.num_directions
        T, B = x.shape[0], x.shape[1]
        if T == 0:   # (torch.nn.GRU refuses it too; B = 0 is an empty batch, answered as torch's)
            raise ValueError(f"{name}: x must have at least one step, got shape {list(x.shape)}")
        if check_h0:
            self._check_h(h0, (D, B, H), "[num_directions, B, hidden_size]")
        if h0 is None:
            h0 = x.new_zeros(D, B, H)
        mask = None if lengths is None else lengths_to_mask(lengths, T, B, x.dtype, x.device, name,
                                                            none_if_unpadded=True)
        drops = [self.sample_dropout_masks(B, x) for _ in range(D)]
        return self._run(x, h0, mask, drops)

    def _forward_packed(self, x: PackedSequence, h0: Optional[Tensor], lengths) -> Tuple[PackedSequence, Tensor]:
        """forward of a PackedSequence: padded time-major in the batch's own order, run with its lengths, and the
        output packed again in x's order (the same batch_sizes, sorted_indices and unsorted_indices)."""
        name, I = type(self).__name__, self.input_size
        if lengths is not None:
            raise ValueError(f"{name}: lengths is for a padded x; a PackedSequence holds its own lengths")
        self._check_tensor(x.data, "x.data", "[sum of lengths, input_size] (a PackedSequence)")
        if x.data.dim() != 2 or x.data.shape[-1] != I:
            raise ValueError(f"{name}: a PackedSequence's data must have shape [sum of lengths, input_size] with "
                             f"input_size={I}, got {list(x.data.shape)}")
        _check_packing(name, x)
        padded, sizes = pad_packed_sequence(x)   # [T, B, I] in the batch's own order; sizes: int64 on the CPU
        out, h_n = self._time_major(padded, h0, sizes)
        order = x.sorted_indices
        if order is not None:   # (the packed order: longest first)
            out, sizes = out.index_select(1, order), sizes.index_select(0, order.cpu())
        data = pack_padded_sequence(out, sizes).data
        return PackedSequence(data, x.batch_sizes, x.sorted_indices, x.unsorted_indices), h_n


def _initial_state(name: str, h0: Optional[Tensor], hx: Optional[Tensor]) -> Optional[Tensor]:
    """The initial state given as h0 or, torch.nn.GRU's keyword, as hx=: ValueError where both are."""
    if hx is not None and h0 is not None:
        raise ValueError(f"{name}: give the initial state once, as h0 or as hx (torch.nn.GRU's name), not both")
    return h0 if hx is None else hx


def _check_packing(name: str, x: PackedSequence) -> None:
    """ValueError unless x's batch sizes and orders are what pack_padded_sequence makes: batch_sizes a non-increasing
    CPU int64 vector of positive sizes summing to data's rows, each order a permutation of the batch."""
    sizes = x.batch_sizes
    why = None
    if not isinstance(sizes, Tensor) or sizes.dtype != torch.int64 or sizes.dim() != 1 or sizes.device.type != "cpu":
        why = "batch_sizes must be a 1-D int64 CPU tensor"
    elif sizes.numel() == 0 or sizes[-1] < 1 or bool((sizes[1:] > sizes[:-1]).any()):
        why = f"batch_sizes must be positive and non-increasing, got {sizes.tolist()[:20]}"
    elif int(sizes.sum()) != x.data.shape[0]:
        why = f"batch_sizes sum to {int(sizes.sum())} but data has {x.data.shape[0]} rows"
    else:
        B = int(sizes[0])
        for arg, order in (("sorted_indices", x.sorted_indices), ("unsorted_indices", x.unsorted_indices)):
            if order is not None and (not isinstance(order, Tensor) or order.dtype != torch.int64
                                      or tuple(order.shape) != (B,)
                                      or not torch.equal(order.sort().values.cpu(), torch.arange(B))):
                why = f"{arg} must be a permutation of the batch's {B} sequences"
        if why is None and x.sorted_indices is not None and x.unsorted_indices is not None and not torch.equal(
                x.sorted_indices.cpu()[x.unsorted_indices.cpu()], torch.arange(B)):   # (a traceback deep inside)
            why = "unsorted_indices must be the inverse of sorted_indices"
    if why is not None:
        raise ValueError(f"{name}: x is no PackedSequence that torch.nn.utils.rnn.pack_padded_sequence or "
                         f"pack_sequence makes: {why}")


class TransitionCell(Unrollable, _TransitionBase):
    """One step (decoder use): (x [B, I], h0 [B, H] = None, drop=None) -> h' [B, H]."""

    def __init__(self, input_size, hidden_size, cell, depth, layer_norm, candidate_dropout, backend, device=None,
                 dtype=None, bias=True):
        super().__init__(input_size, hidden_size, cell, depth, layer_norm, 1, candidate_dropout, backend,
                         device=device, dtype=dtype, bias=bias)

    def forward(self, x: Tensor, h0: Optional[Tensor] = None, drop: Optional[Tensor] = None, *,
                hx: Optional[Tensor] = None) -> Tensor:
        """x [B, I] (or [I]), h0 [B, H] (or hx=, torch.nn.GRUCell's name) -> h' [B, H]. In training with
        candidate_dropout > 0 and no `drop`, a fresh mask is drawn for this step; to keep one mask over a whole
        sequence, draw it once with `sample_dropout_masks(B)` and pass it."""
        h = _initial_state(type(self).__name__, h0, hx)
        name, I, H = type(self).__name__, self.input_size, self.hidden_size
        self._check_tensor(x, "x", "[B, input_size]")
        if x.dim() not in (1, 2) or x.shape[-1] != I:
            raise ValueError(f"{name}: x must have shape [B, input_size] (or [input_size]) with "
                             f"input_size={I}, got {list(x.shape)}")
        unbatched = x.dim() == 1
        x2 = x.unsqueeze(0) if unbatched else x
        B = x2.shape[0]
        if h is not None:
            self._check_h(h, (H,) if unbatched else (B, H), "[hidden_size]" if unbatched else "[B, hidden_size]")
            h = h.unsqueeze(0) if unbatched else h
        else:
            h = x2.new_zeros(B, H)
        if drop is None:
            drop = self.sample_dropout_masks(B, x2)
        elif self.cell == "atr":
            raise ValueError(f"{name}: ATR has no candidate to drop (contract §2); pass no drop mask")
        else:
            self._check_tensor(drop, "drop", "[depth+1, B, hidden_size]")
            if tuple(drop.shape) != (self.depth + 1, B, H):
                raise ValueError(f"{name}: drop must have shape [depth+1, B, hidden_size] = "
                                 f"{[self.depth + 1, B, H]}, got {list(drop.shape)}")
        session = self._unrolled_session(x2) if B > 0 else None   # (B = 0: _run's empty answer, as torch's)
        if session is not None:
            check_transforms("transition_forward", h, drop)   # (x and the weights: in _unrolled_session)
            check_drop("transition_forward", drop)
            h1 = CppTransitionStepFunction.apply(x2, h, drop, session[1], session[0], self.eps)
            return h1[0] if unbatched else h1
        _, h_n = self._run(x2.unsqueeze(0), h.unsqueeze(0), None, [drop])
        return h_n[0, 0] if unbatched else h_n[0]

    def _unrolled_session(self, x: Tensor):
        """(UnrolledSteps, token) when this call is a step in an `unrolled` block that a backend of UNROLLED_BACKENDS
        runs with autograd recording, else None."""
        sessions = self._unrolled_sessions()
        if sessions is None:
            return None
        backend = resolve_backend(self.backend, x.device)
        if backend.name not in UNROLLED_BACKENDS:
            return None
        check_dtype_for_backend(backend, x.dtype, "x")
        key = (x.device, x.dtype)
        weights = list(self._weights_read(0).values())   # (a parametrized weight is a new tensor at each read)
        check_transforms("transition_forward", x, *weights)   # (before the session's Function sees them)
        # (a weight's version moves with an in-place change, its storage with `.data =` or torch.utils.swap_tensors)
        versions = tuple((w._version, w.data_ptr()) for w in weights)
        hit = sessions.get(key)
        if (hit is None or hit[0].done or hit[0].versions != versions   # a new graph, or changed weights
                or any(a is not b for a, b in zip(hit[2], weights))):
            self._check_parameter_shapes(0)
            flat = self.kernel_params(0)
            steps = UnrolledSteps(KINDS[self.cell], flat, versions)
            sessions[key] = hit = (steps, CppUnrolledWeightsFunction.apply(steps, *flat), weights)
        return hit


# the base cells of a deep transition, for messages: 'gru', 'lgru' or 'lau'
_DT_CELLS = ", ".join(map(repr, DEEP_TRANSITION_CELLS[:-1])) + f" or {DEEP_TRANSITION_CELLS[-1]!r}"


class DeepTransitionGRU(TransitionLayer):
    """Deep transition RNN layer (DTMT / Nematus transition depth): a base cell (L-GRU, GRU or LAU) followed
    by `depth` T-GRUs at every step; the last T-GRU's output is the step's output and next state.

    With cell="gru", depth=0, layer_norm=False it is a GRU (see `from_torch`)."""

    def __init__(self, input_size: int, hidden_size: int, *, depth: int = 4, cell: str = "lgru",
                 layer_norm: bool = True, bidirectional: bool = False, batch_first: bool = False,
                 candidate_dropout: float = 0.0, backend: str = "auto", reverse: bool = False, device=None,
                 dtype=None, bias: bool = True):
        if cell not in DEEP_TRANSITION_CELLS:
            raise ValueError(f"DeepTransitionGRU: cell must be {_DT_CELLS}, got {cell!r}"
                             + ("; use dtmt_kernels.nn.ATR" if cell == "atr" else ""))
        super().__init__(input_size, hidden_size, cell, depth, layer_norm, bidirectional, batch_first,
                         candidate_dropout, backend, reverse, device, dtype, bias)

    @classmethod
    def from_torch(cls, gru: nn.GRU, backend: str = "auto") -> "DeepTransitionGRU":
        """A GRU layer (cell="gru", depth=0, no layer norm) holding a copy of a one-layer torch.nn.GRU's
        weights; it reproduces the torch module's outputs. It takes the GRU's mode (train / eval) and which weights
        want gradients; a GRU without biases (bias=False) gives a layer without biases.)"""
        if not isinstance(gru, nn.GRU):
            raise ValueError(f"DeepTransitionGRU.from_torch: expected a torch.nn.GRU, got {type(gru).__name__}")
        if gru.num_layers != 1:
            raise ValueError(f"DeepTransitionGRU.from_torch: the GRU has num_layers={gru.num_layers}; "
                             "import each layer into its own DeepTransitionGRU")
        if getattr(gru, "proj_size", 0):
            raise ValueError("DeepTransitionGRU.from_torch: GRUs with proj_size are not supported")
        layer = cls(gru.input_size, gru.hidden_size, depth=0, cell="gru", layer_norm=False,
                    bidirectional=gru.bidirectional, batch_first=gru.batch_first, backend=backend, bias=gru.bias)
        return _copy_torch_gru(gru, layer, "_l0")


def _copy_torch_gru(gru: nn.Module, layer: "_TransitionBase", torch_suffix: str):
    """`layer` (a GRU: cell "gru", depth 0, no layer norm) on gru's device and dtype, holding a copy of its weights
    (`weight_ih{torch_suffix}`, ...: "_l0" for torch.nn.GRU, "" for torch.nn.GRUCell), in its mode (train / eval),
    each weight wanting a gradient where gru's does (a bias-free gru, bias=False, made a bias-free layer)."""
    ref = getattr(gru, f"weight_hh{torch_suffix}")
    H = gru.hidden_size
    layer = layer.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        for sfx in layer._suffixes():
            for kind in ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if layer.bias else ()):
                src = getattr(gru, f"{kind}{torch_suffix}{sfx}")
                dst = getattr(layer, f"{kind}{sfx}")
                dst.copy_(src)
                dst.requires_grad_(src.requires_grad)   # (a frozen GRU gives a frozen layer)
                # torch updates h' = (1-z) c + z h where contract §2 has h' = (1-z) h + z c: since
                # 1 - σ(a) = σ(-a), negating the update-gate rows maps one onto the other exactly.
                dst[H:2 * H].neg_()
    return layer.train(gru.training)


class DeepTransitionGRUCell(TransitionCell):
    """One step of a deep transition block, for decoders: h1 = cell(x, h0). Same parameters as one
    direction of DeepTransitionGRU (so a layer's forward-direction state_dict loads into it)."""

    def __init__(self, input_size: int, hidden_size: int, *, depth: int = 4, cell: str = "lgru",
                 layer_norm: bool = True, candidate_dropout: float = 0.0, backend: str = "auto", device=None,
                 dtype=None, bias: bool = True):
        if cell not in DEEP_TRANSITION_CELLS:
            raise ValueError(f"DeepTransitionGRUCell: cell must be {_DT_CELLS}, got {cell!r}"
                             + ("; use dtmt_kernels.nn.ATRCell" if cell == "atr" else ""))
        super().__init__(input_size, hidden_size, cell, depth, layer_norm, candidate_dropout, backend, device, dtype,
                         bias)

    @classmethod
    def from_torch(cls, cell: nn.GRUCell, backend: str = "auto") -> "DeepTransitionGRUCell":
        """A GRU cell (cell="gru", depth=0, no layer norm) holding a copy of a torch.nn.GRUCell's weights; it
        reproduces the torch module's outputs, as `DeepTransitionGRU.from_torch` does a GRU's."""
        if not isinstance(cell, nn.GRUCell):
            raise ValueError("DeepTransitionGRUCell.from_torch: expected a torch.nn.GRUCell, got "
                             f"{type(cell).__name__}")
        ours = cls(cell.input_size, cell.hidden_size, depth=0, cell="gru", layer_norm=False, backend=backend,
                   bias=cell.bias)
        return _copy_torch_gru(cell, ours, "")


class ATR(TransitionLayer):
    """Addition-subtraction twin-gated recurrent layer (paper 004): p = W x, q = U h + b,
    h' = σ(p+q) p + σ(p−q) h."""

    def __init__(self, input_size: int, hidden_size: int, *, layer_norm: bool = False, bidirectional: bool = False,
                 batch_first: bool = False, backend: str = "auto", reverse: bool = False, device=None, dtype=None,
                 bias: bool = True):
        super().__init__(input_size, hidden_size, "atr", 0, layer_norm, bidirectional, batch_first, 0.0, backend,
                         reverse, device, dtype, bias)


class ATRCell(TransitionCell):
    """One ATR step, for decoders: h1 = cell(x, h0)."""

    def __init__(self, input_size: int, hidden_size: int, *, layer_norm: bool = False, backend: str = "auto",
                 device=None, dtype=None, bias: bool = True):
        super().__init__(input_size, hidden_size, "atr", 0, layer_norm, 0.0, backend, device, dtype, bias)


class Linear(BackendSwitch, nn.Linear):
    """torch.nn.Linear (same parameters, initialisation and state_dict keys) computed by
    `dtmt_kernels.functional.linear`: on a CPU backend, a product of at most 8 float32 rows that needs no gradient
    (a decoder step at batch 1, beam <= 8) runs the weight-streaming small-row kernel; everything else is
    F.linear. `backend="reference"` (set by Seq2Seq.set_backend with the recurrent layers) is plain F.linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: str = "auto",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"
