"""The attentional RNMT skeleton that DTMT, SHALLOWRNMT, RNNSearch-ATR and Nematus' cGRU share:

    annotations C = encoder(embeddings of x)                         (subclass: `encode_source`)
    s_0          = tanh(W_init · mean of C over the real tokens)
    per step t:  s̃_t = query_cell(y_{t-1}, s_{t-1})                  (DTMT query transition, cGRU's GRU1)
                 c_t, α_t = attention(s̃_t, C)
                 s_t = decoder_cell(c_t, s̃_t)                       (DTMT decoder transition, cGRU's GRU2)
                 features = tanh(W_1 y_{t-1} + W_2 s_t + W_3 c_t)    (the Readout)

Subclasses create src_embed, tgt_embed, init_state, query_cell, attention, decoder_cell and readout. Cells
with candidate dropout get one mask per sentence, drawn at `encode` and kept (batch first) in the state.

Decoding (`step` in eval mode without autograd, on the cpp backend) runs everything after the embedding lookup
as one C++ call (`fused_step_plan` / `fused_step`: `dtmt_kernels.functional.rnmt_step`), the same arithmetic as
the modules; at batch 1 the ~80 small PyTorch ops of a step cost more to dispatch than to compute
(benchmarks/NOTES.md, log item 12). Nematus' one-level cGRU decoder uses the same `fused_step`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

import dtmt_kernels as dk

from .attention import AdditiveAttention, MultiHeadAdditiveAttention
from .seq2seq import Projection, Readout, Seq2Seq, State, lengths_mask, step_state


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """x [B, S, D], mask [B, S] bool -> mean over the real positions [B, D]."""
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


SWAPPABLE_CELLS = ("atr", "gru", "lgru", "lau")


def _check_swappable(cell: str) -> None:
    if cell not in SWAPPABLE_CELLS:
        raise ValueError(f"cell must be one of {SWAPPABLE_CELLS}, got {cell!r}")


def recurrent_layer(cell: str, input_size: int, hidden_size: int, **options):
    """A one-cell recurrent layer of the given type (SPEC §4: systems swap GRU / LAU / L-GRU / ATR)."""
    _check_swappable(cell)
    if cell == "atr":
        return dk.nn.ATR(input_size, hidden_size, **options)
    return dk.nn.DeepTransitionGRU(input_size, hidden_size, depth=0, cell=cell, **options)


def recurrent_cell(cell: str, input_size: int, hidden_size: int, **options):
    """The single-step counterpart of `recurrent_layer`, for decoders."""
    _check_swappable(cell)
    if cell == "atr":
        return dk.nn.ATRCell(input_size, hidden_size, **options)
    return dk.nn.DeepTransitionGRUCell(input_size, hidden_size, depth=0, cell=cell, **options)


def start_state(attention, init_state, annotations: Tensor, src_lengths: Tensor,
                layers: Optional[int] = None) -> State:
    """What every attentional decoder starts from: the annotations, the attention keys (computed once per
    batch), the source mask, and s = tanh(init_state(mean annotation over the real tokens)); with `layers`,
    init_state produces one state per decoder layer and s is [B, layers, H]."""
    src_mask = lengths_mask(src_lengths, annotations.shape[1])
    s = torch.tanh(init_state(masked_mean(annotations, src_mask)))
    if layers is not None:
        s = s.view(s.shape[0], layers, -1)
    return {"annotations": annotations, "keys": attention.precompute(annotations), "src_mask": src_mask, "s": s}


def _step_parts(model: Seq2Seq) -> tuple:
    """Every submodule the fused step reads, found through the `_modules` dicts (the check runs every step, where
    nn.Module.__getattr__ costs ~0.5 us a lookup): (attention, readout, query_cell, decoder_cell, attention.query,
    attention.v (a Linear; None for multi-head), attention.out, attention.ln_q, readout.from_y, .from_s, .from_c,
    .output, output.proj, the three readout norms, then the readout's deep layers and Nematus' higher levels);
    absent ones are None."""
    m = model._modules
    att, r = m["attention"], m["readout"]
    am, rm = att._modules, r._modules
    out = rm["output"]
    levels = m["levels"]._modules.values() if "levels" in m else ()
    return (att, r, m["query_cell"], m["decoder_cell"], am.get("query"), am.get("v"), am.get("out"), am.get("ln_q"),
            rm["from_y"], rm["from_s"], rm["from_c"], out, out._modules.get("proj"), *rm["norms"]._modules.values(),
            *rm["deep"]._modules.values(), *levels)


def _plain_linear(m) -> bool:
    """A dtmt_kernels.nn.Linear whose weight and bias are its own parameters (not parametrized or pruned, which
    move them out of `_parameters`)."""
    return type(m) is dk.nn.Linear and "weight" in m._parameters and "bias" in m._parameters


def _structure_ok(model: Seq2Seq, parts: tuple, transition) -> bool:
    att, r, q, d, query, v, out, _, from_y, from_s, from_c, output, proj = parts[:13]
    cls = type(model)
    multi_head = type(att) is MultiHeadAdditiveAttention
    return (cls.transition is transition and cls.features is Seq2Seq.features
            and cls.decoder_step is Seq2Seq.decoder_step and not getattr(model, "levels", ())
            and isinstance(q, dk.nn._TransitionCell) and isinstance(d, dk.nn._TransitionCell)
            and (multi_head or type(att) is AdditiveAttention)
            and type(r) is Readout and len(r.deep) == 0 and type(output) is Projection
            and all(_plain_linear(m) for m in (query, out if multi_head else v, from_y, from_s, from_c, proj)))


def fused_step_plan(model: Seq2Seq, x: Tensor, transition) -> Optional[tuple]:
    """What `fused_step` needs, or None where it does not apply, for inputs like x (the embedded previous tokens
    or the decoder state: their device and dtype): eval mode, no autograd, every part on the cpp backend and of
    the kinds the fused op takes, and the step's structure the one `transition` (the model class's own, as the
    caller names it) gives: a subclass that changes the transition, features or decoder step, a model with
    higher decoder levels (`model.levels`, Nematus), a swapped-in module of another kind or a parametrized linear
    keeps the modules' path. The structural part is worked out once per set of submodules (keyed on their
    identity and class); what is checked every step (mode, autograd, backends, the cells' and norms' eps) costs a
    few us. The plan is (the parts of _step_parts, the attention query norm, the readout norms), read once a
    step."""
    if model.training or torch.is_grad_enabled():
        return None
    parts = _step_parts(model)
    cached = model.__dict__.get("_fused_structure")
    if (cached is None or len(cached[0]) != len(parts)
            or any(a is not b or type(a) is not t for a, b, t in zip(parts, cached[0], cached[1]))):
        cached = (parts, tuple(type(p) for p in parts), _structure_ok(model, parts, transition))
        model.__dict__["_fused_structure"] = cached   # the parts themselves: ids can be reused
    if not cached[2]:
        return None
    att, r, q, d = parts[:4]
    if not (q.eps == d.eps and dk.functional.fused_inference("cpp", x)
            and all(m.backend in ("auto", "cpp") for m in (q, d, att, *parts[8:11], parts[12]))):
        return None
    query_norm = (None, None, 1e-5) if type(att) is MultiHeadAdditiveAttention else att.fused_query_norm()
    readout_norms = r.stacked_norms()
    if query_norm is None or readout_norms is None:
        return None
    return parts, query_norm, readout_norms


def fused_step_applies(model: Seq2Seq, x: Tensor, transition) -> bool:
    """Whether `model.step` may run `fused_step` (see fused_step_plan)."""
    return fused_step_plan(model, x, transition) is not None


def fused_step(plan: tuple, y: Tensor, state: State, s: Tensor,
               drops=(None, None)) -> Tuple[Tensor, Tensor, Tensor]:
    """One decoder step of query_cell -> attention -> decoder_cell -> readout as one C++ call
    (`dtmt_kernels.functional.rnmt_step`, the same arithmetic as the modules), for a model's `fused_step_plan`:
    y [B, E] the embedded previous tokens, `state` holds the attention's keys, annotations and src_mask, s [B, H]
    the state the query cell reads, drops the two cells' candidate-dropout multipliers (or None).
    Returns (log_probs [B, V], s' [B, H], the attention weights averaged over the heads [B, S]). Parameters are
    read from the modules' `_parameters` dicts (see _step_parts)."""
    parts, (q_ln_w, q_ln_b, att_eps), (ln_w, ln_b, ln_eps) = plan
    att, r, q, d, query, v, out, _, from_y, from_s, from_c, _, proj = parts[:13]
    w_q = query._parameters["weight"]
    if type(att) is MultiHeadAdditiveAttention:
        o = out._parameters
        attention = (w_q, state["keys"], att._parameters["v"], state["annotations"], state["src_mask"], o["weight"],
                     o["bias"], None, None)
    else:
        attention = (w_q, state["keys"].unsqueeze(2), v._parameters["weight"], state["annotations"],
                     state["src_mask"], None, None, q_ln_w, q_ln_b)
    fy, fs, fc, fo = from_y._parameters, from_s._parameters, from_c._parameters, proj._parameters
    readout = (fy["weight"], fy["bias"], fs["weight"], fs["bias"], fc["weight"], fc["bias"], ln_w, ln_b,
               fo["weight"], fo["bias"])
    return dk.functional.rnmt_step(y, s, q, attention, d, readout, ln_eps, drops, att_eps)


class AttentionalRNMT(Seq2Seq):
    def encode_source(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        """Annotations [B, S, C] (zeros at padding)."""
        return self.encoder(self.src_embed(src), lengths=src_lengths)[0]

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        annotations = self.encode_source(src, src_lengths)
        B = src.shape[0]
        state = start_state(self.attention, self.init_state, annotations, src_lengths)
        state["pos"] = torch.zeros(B, dtype=torch.long, device=src.device)
        for name, cell in (("drop_q", self.query_cell), ("drop_d", self.decoder_cell)):
            drop = cell.sample_dropout_masks(B, annotations)
            if drop is not None:
                state[name] = drop.transpose(0, 1)  # [B, depth+1, H]: batch first, for reorder
        return state

    @staticmethod
    def _drop(state: State, key: str) -> Optional[Tensor]:
        d = state.get(key)
        return None if d is None else d.transpose(0, 1).contiguous()

    def embed_step(self, state: State, prev_tokens: Tensor) -> Tensor:
        return self.tgt_embed(prev_tokens, positions=state["pos"])

    def step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        plan = fused_step_plan(self, state["s"], AttentionalRNMT.transition)
        if plan is None:
            return super().step(state, prev_tokens)
        y = self.embed_step(state, prev_tokens)
        drops = (self._drop(state, "drop_q"), self._drop(state, "drop_d"))
        log_probs, s, alpha = fused_step(plan, y, state, state["s"], drops)
        return log_probs, step_state(state, alpha, True, s=s, pos=state["pos"] + 1)

    def _fused_step_applies(self, x: Tensor) -> bool:
        return fused_step_applies(self, x, AttentionalRNMT.transition)

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        """Query transition, attention and decoder transition: ((s_t, c_t), the new state)."""
        s_q = self.query_cell(y, state["s"], self._drop(state, "drop_q"))
        c, alpha = self.attention(s_q, state["keys"], state["annotations"], state["src_mask"])
        s = self.decoder_cell(c, s_q, self._drop(state, "drop_d"))
        return (s, c), step_state(state, alpha, keep_attention, s=s, pos=state["pos"] + 1)
