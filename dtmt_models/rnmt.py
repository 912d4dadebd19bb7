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
as one C++ call (`fused_step`: `dtmt_kernels.functional.rnmt_step`), the same arithmetic as the modules; at
batch 1 the ~80 small PyTorch ops of a step cost more to dispatch than to compute (benchmarks/NOTES.md, log
item 12). Nematus' one-level cGRU decoder uses the same `fused_step`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

import dtmt_kernels as dk

from .attention import AdditiveAttention, MultiHeadAdditiveAttention
from .seq2seq import Readout, Seq2Seq, State, lengths_mask, step_state


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
    """The submodules a fused step reads: (attention, readout, query_cell, decoder_cell, then the query norm,
    the readout's norms and deep layers and Nematus' higher levels), found through the `_modules` dicts: the
    check runs every step, where nn.Module.__getattr__ would cost ~0.5 us a lookup."""
    m = model._modules
    att, r = m["attention"], m["readout"]
    rm = r._modules
    levels = m["levels"]._modules.values() if "levels" in m else ()
    return (att, r, m["query_cell"], m["decoder_cell"], att._modules.get("ln_q"), *rm["norms"]._modules.values(),
            *rm["deep"]._modules.values(), *levels)


def fused_step_applies(model: Seq2Seq, y: Tensor, transition) -> bool:
    """Whether `model.step` may run `fused_step`: eval mode, no autograd, every part on the cpp backend and of
    the kinds the fused op takes, and the step's structure the one `transition` (the model class's own, as the
    caller names it) gives: a subclass that changes the transition, features or decoder step, or a model with
    higher decoder levels (`model.levels`, Nematus), keeps the modules' path. The structural part is worked out
    once per set of submodules (~20 us of isinstance checks, per step); what is checked every step (mode,
    autograd, backends, eps) costs ~3 us."""
    if model.training or torch.is_grad_enabled():
        return False
    parts = _step_parts(model)
    cached = model.__dict__.get("_fused_structure")
    if cached is None or len(cached[0]) != len(parts) or any(a is not b for a, b in zip(cached[0], parts)):
        att, r, q, d = parts[:4]
        cls = type(model)
        ok = (cls.transition is transition and cls.features is Seq2Seq.features
              and cls.decoder_step is Seq2Seq.decoder_step and not getattr(model, "levels", ())
              and isinstance(q, dk.nn._TransitionCell) and isinstance(d, dk.nn._TransitionCell)
              and (isinstance(att, MultiHeadAdditiveAttention)
                   or (isinstance(att, AdditiveAttention) and att.fused_query_norm() is not None))
              and type(r) is Readout and len(r.deep) == 0)
        switches = (q, d, att, r.from_y, r.from_s, r.from_c, r.output.proj) if ok else ()
        model.__dict__["_fused_structure"] = cached = (parts, ok, switches)   # the parts themselves: ids can be
    _, ok, switches = cached                                                    # reused
    return (ok and parts[2].eps == parts[3].eps and dk.functional.fused_inference("cpp", y)
            and all(m.backend in ("auto", "cpp") for m in switches))


def fused_step(model: Seq2Seq, y: Tensor, state: State, s: Tensor,
               drops=(None, None)) -> Tuple[Tensor, Tensor, Tensor]:
    """One decoder step of query_cell -> attention -> decoder_cell -> readout as one C++ call
    (`dtmt_kernels.functional.rnmt_step`, the same arithmetic as the modules), where `fused_step_applies`:
    y [B, E] the embedded previous tokens, `state` holds the attention's keys, annotations and src_mask, s [B, H]
    the state the query cell reads, drops the two cells' candidate-dropout multipliers (or None).
    Returns (log_probs [B, V], s' [B, H], the attention weights averaged over the heads [B, S]). Parameters are
    read from the modules' `_parameters` dicts (see _step_parts)."""
    att, r, q, d = _step_parts(model)[:4]
    ap, rm = att._parameters, r._modules
    if isinstance(att, MultiHeadAdditiveAttention):
        out = att._modules["out"]._parameters
        attention = (att._modules["query"]._parameters["weight"], state["keys"], ap["v"], state["annotations"],
                     state["src_mask"], out["weight"], out["bias"], None, None)
        att_eps = 1e-5
    else:
        ln_w, ln_b, att_eps = att.fused_query_norm()
        attention = (att._modules["query"]._parameters["weight"], state["keys"].unsqueeze(2),
                     att._modules["v"]._parameters["weight"], state["annotations"], state["src_mask"], None, None,
                     ln_w, ln_b)
    ln_w, ln_b, ln_eps = r.stacked_norms()
    fy, fs, fc = (rm[k]._parameters for k in ("from_y", "from_s", "from_c"))
    out = rm["output"]._modules["proj"]._parameters
    readout = (fy["weight"], fy["bias"], fs["weight"], fs["bias"], fc["weight"], fc["bias"], ln_w, ln_b,
               out["weight"], out["bias"])
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
        y = self.embed_step(state, prev_tokens)
        if not self._fused_step_applies(y):
            parts, new = self.transition(state, y)
            return self.readout(self.features(y, *parts)), new
        drops = (self._drop(state, "drop_q"), self._drop(state, "drop_d"))
        log_probs, s, alpha = fused_step(self, y, state, state["s"], drops)
        return log_probs, step_state(state, alpha, True, s=s, pos=state["pos"] + 1)

    def _fused_step_applies(self, y: Tensor) -> bool:
        return fused_step_applies(self, y, AttentionalRNMT.transition)

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        """Query transition, attention and decoder transition: ((s_t, c_t), the new state)."""
        s_q = self.query_cell(y, state["s"], self._drop(state, "drop_q"))
        c, alpha = self.attention(s_q, state["keys"], state["annotations"], state["src_mask"])
        s = self.decoder_cell(c, s_q, self._drop(state, "drop_d"))
        return (s, c), step_state(state, alpha, keep_attention, s=s, pos=state["pos"] + 1)
