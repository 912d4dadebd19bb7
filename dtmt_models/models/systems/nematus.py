"""`nematus`: the deep architectures of paper 002 (Miceli Barone et al. 2017), BiDeep included.

Transition depths count every GRU step of a time step (Nematus' convention): a block of transition depth L
is a DeepTransitionGRU with `depth = L - 1` T-GRUs. Layer norm is on everywhere by default (paper §3.1).

Encoders (`encoder=`):
  shallow            bidirectional GRU, C_i = [→h_i; ←h_i]
  deep-transition    bidirectional deep-transition GRU of depth `enc_transition_depth`
  alternating        two chains (one starting left→right, one right→left) of `enc_depth` GRU levels, each
                     level reading the previous one's output in the opposite direction, residual sums at
                     every level >= 2; C_i = [top of chain 1; top of chain 2]
  biunidirectional   a bidirectional level, then enc_depth - 1 left→right GRUs of width 2H with residuals
  bideep             alternating, with deep-transition blocks (`enc_transition_depth`) as levels
Decoders (`decoder=`); level 1 is always the conditional GRU  s₁ = GRU(y, s), c = ATT(C, s₁),
s = DT-GRU(c, s₁) with `dec_base_transition_depth` (>= 2) transitions:
  shallow            cGRU (base depth 2)           deep-transition   cGRU with base depth `dec_base_transition_depth`
  gru                + levels k >= 2: GRU(r_{k-1})                   rgru   + GRU([r_{k-1}; c₁])
  cgru               + levels with their own attention: GRU(r_{k-1}) → ATT_k → GRU(c_k); every level's
                     attention is independent of the others (paper 002 §2.3 "Stacked cGRU"): its own query,
                     key projection (keys computed once per batch in `encode`, state["level_keys"]), v and LN
  crgru              + like cgru but reusing the base context c₁
  bideep             stacked `dec_high_cell` levels whose cells are deep-transition blocks
Every level's output is summed with the one below (r_k = out_k + r_{k-1}); each level carries its own
state, all starting from s_0 = tanh(W · mean C). The readout sees the top output, the base context and
y_{t-1} (with LN on each projection), `output_depth - 1` extra tanh layers ("deep output"), and a softmax
tied to the target embeddings by default. Dropout is off by default (the released configs use none).
Paper typos followed as the authors' code does: residuals at every level >= 2 including the top; higher
cGRU levels feed GRU_{k,2} with their own s_{j,k,1}.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

import dtmt_kernels as dk
from dtmt_models.engine.decoder import step_state
from dtmt_models.engine.rnmt import FusedStep
from dtmt_models.models.attention import AdditiveAttention
from dtmt_models.models.embeddings import TokenEmbedding
from dtmt_models.models.registered import register_model
from dtmt_models.models.rnmt import fused_or_prepared, start_state
from dtmt_models.models.seq2seq import Readout, Seq2Seq, State

ENCODERS = ("shallow", "deep-transition", "alternating", "biunidirectional", "bideep")
DECODERS = ("shallow", "deep-transition", "gru", "rgru", "cgru", "crgru", "bideep")


class _Level(nn.Module):
    """A higher decoder level (k >= 2) of the given cell type."""

    def __init__(self, kind: str, H: int, transition_depth: int, layer_norm: bool, backend: str):
        super().__init__()
        self.kind = kind
        gru = dict(cell="gru", layer_norm=layer_norm, backend=backend)
        if kind in ("gru", "rgru"):
            self.cell = dk.nn.DeepTransitionGRUCell(H if kind == "gru" else 3 * H, H, depth=transition_depth - 1,
                                                    **gru)
        else:
            if transition_depth < 2:
                raise ValueError(f"nematus: a {kind} level needs transition depth >= 2, got {transition_depth}")
            self.first = dk.nn.DeepTransitionGRUCell(H, H, depth=0, **gru)
            self.second = dk.nn.DeepTransitionGRUCell(2 * H, H, depth=transition_depth - 2, **gru)
            if kind == "cgru":
                self.attention = AdditiveAttention(H, 2 * H, 2 * H, layer_norm, backend)

    def forward(self, below: Tensor, state: Tensor, c1: Tensor, annotations: Tensor, keys: Optional[Tensor],
                src_mask: Tensor) -> Tensor:
        """One step; `keys` are this level's own precomputed attention keys (cgru only, else unused)."""
        if self.kind == "gru":
            return self.cell(below, state)
        if self.kind == "rgru":
            return self.cell(torch.cat([below, c1], -1), state)
        s1 = self.first(below, state)
        c = self.attention(s1, keys, annotations, src_mask)[0] if self.kind == "cgru" else c1
        return self.second(c, s1)


@register_model("nematus")
class Nematus(Seq2Seq):
    # its one-level step is the engine's one-call step, with s [B, levels, H] and the previous token's row alone;
    # its own encode
    fused_step = FusedStep(layered=True, positions=False, tabled_encoder=False)

    @staticmethod
    def unused_options(o: dict) -> Dict[str, str]:
        """The options that the encoder and decoder `o` names leave unused, with why (registry.unused_options)."""
        enc, dec, unused = o["encoder"], o["decoder"], {}
        if enc in ("shallow", "deep-transition"):
            unused["enc_depth"] = f"the {enc} encoder has one level"
        if enc not in ("deep-transition", "bideep"):
            unused["enc_transition_depth"] = "only the deep-transition and bideep encoders read it"
        if dec in ("shallow", "deep-transition"):
            unused["dec_depth"] = f"the {dec} decoder has one level"
        if dec not in ("deep-transition", "bideep"):
            unused["dec_base_transition_depth"] = "only the deep-transition and bideep decoders read it"
        if dec != "bideep":
            unused["dec_high_cell"] = unused["dec_high_transition_depth"] = "only the bideep decoder reads it"
        return unused

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256,
                 encoder: str = "shallow", decoder: str = "shallow", enc_depth: int = 2,
                 enc_transition_depth: int = 2, dec_depth: int = 2, dec_base_transition_depth: int = 4,
                 dec_high_transition_depth: int = 2, dec_high_cell: str = "rgru", output_depth: int = 1,
                 layer_norm: bool = True, dropout: float = 0.0, tie_embeddings: bool = True, pad_id: int = 0,
                 backend: str = "auto"):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        if encoder not in ENCODERS:
            raise ValueError(f"nematus: encoder must be one of {ENCODERS}, got {encoder!r}")
        if decoder not in DECODERS:
            raise ValueError(f"nematus: decoder must be one of {DECODERS}, got {decoder!r}")
        if dec_high_cell not in ("gru", "rgru", "cgru", "crgru"):
            raise ValueError(f"nematus: dec_high_cell must be gru, rgru, cgru or crgru, got {dec_high_cell!r}")
        for name, v in (("enc_depth", enc_depth), ("enc_transition_depth", enc_transition_depth),
                        ("dec_depth", dec_depth), ("dec_high_transition_depth", dec_high_transition_depth),
                        ("output_depth", output_depth)):
            if v < 1:
                raise ValueError(f"nematus: {name} must be >= 1, got {v}")
        if dec_base_transition_depth < 2:
            raise ValueError("nematus: dec_base_transition_depth counts GRU1 and GRU2, so it must be >= 2")
        # a block of transition depth L is one GRU (a cGRU level two) and T-GRUs, at most MAX_DEPTH of them: bounded
        # here even where encoder / decoder leave it unused (enc_transition_depth=10**9 with the shallow encoder
        # built without a word)
        for name, v, grus in (("enc_transition_depth", enc_transition_depth, 1),
                              ("dec_base_transition_depth", dec_base_transition_depth, 2),
                              ("dec_high_transition_depth", dec_high_transition_depth, 2)):
            if v > dk.nn.MAX_DEPTH + grus:
                raise ValueError(f"nematus: {name} must be at most {dk.nn.MAX_DEPTH + grus} ({dk.nn.MAX_DEPTH} "
                                 f"T-GRUs), got {v}")
        E, H = embed_dim, hidden_size
        self.encoder_kind, self.decoder_kind = encoder, decoder
        gru = dict(cell="gru", layer_norm=layer_norm, backend=backend, batch_first=True)
        # ---- encoder
        levels = 1 if encoder in ("shallow", "deep-transition") else enc_depth
        trans = enc_transition_depth if encoder in ("deep-transition", "bideep") else 1
        if encoder == "biunidirectional":
            self.encoder = nn.ModuleList([dk.nn.DeepTransitionGRU(E, H, depth=trans - 1, bidirectional=True, **gru)])
            self.encoder.extend(dk.nn.DeepTransitionGRU(2 * H, 2 * H, depth=trans - 1, **gru)
                                for _ in range(levels - 1))
        else:
            # chain c (0: starts left->right, 1: starts right->left), level j reverses when (c + j) is odd
            self.encoder = nn.ModuleList(
                dk.nn.DeepTransitionGRU(E if j == 0 else H, H, depth=trans - 1, reverse=bool((c + j) % 2), **gru)
                for c in range(2) for j in range(levels))
        self.enc_levels = levels
        # ---- decoder
        if decoder in ("shallow", "deep-transition"):
            dec_levels, base_depth, high, high_depth = 1, (2 if decoder == "shallow" else dec_base_transition_depth), None, 0
        elif decoder == "bideep":
            dec_levels, base_depth, high, high_depth = dec_depth, dec_base_transition_depth, dec_high_cell, dec_high_transition_depth
        else:
            dec_levels, base_depth, high = dec_depth, 2, decoder
            high_depth = 1 if decoder in ("gru", "rgru") else 2
        self.src_embed = TokenEmbedding(src_vocab_size, E, pad_id, dropout=dropout)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, E, pad_id, dropout=dropout)
        self.init_state = dk.nn.Linear(2 * H, H)
        cell = dict(cell="gru", layer_norm=layer_norm, backend=backend)
        self.query_cell = dk.nn.DeepTransitionGRUCell(E, H, depth=0, **cell)
        self.attention = AdditiveAttention(H, 2 * H, 2 * H, layer_norm, backend)
        self.decoder_cell = dk.nn.DeepTransitionGRUCell(2 * H, H, depth=base_depth - 2, **cell)
        self.levels = nn.ModuleList(_Level(high, H, high_depth, layer_norm, backend) for _ in range(dec_levels - 1))
        self.readout = Readout(E, H, 2 * H, E, tgt_vocab_size, dropout,
                               self.tgt_embed.weight if tie_embeddings else None, layer_norm, output_depth - 1)

    def encode_source(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        x = self.src_embed(src)
        if self.encoder_kind == "biunidirectional":
            w = self.encoder[0](x, lengths=src_lengths)[0]
            for layer in self.encoder[1:]:
                w = w + layer(w, lengths=src_lengths)[0]
            return w
        tops = []
        for c in range(2):
            w = x
            for j in range(self.enc_levels):
                out = self.encoder[c * self.enc_levels + j](w, lengths=src_lengths)[0]
                w = out + w if j > 0 else out
            tops.append(w)
        return torch.cat(tops, -1)

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        state = start_state(self.attention, self.init_state, self.encode_source(src, src_lengths), src_lengths)
        state["s"] = state["s"].unsqueeze(1).repeat(1, 1 + len(self.levels), 1)  # every level starts from s_0
        own = [level.attention.precompute(state["annotations"]) for level in self.levels if level.kind == "cgru"]
        if own:
            state["level_keys"] = torch.stack(own, 1)   # [B, cGRU levels, S, 2H]: each level's own keys
        return state

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        prev = state["s"]
        s1 = self.query_cell(y, prev[:, 0])
        c1, alpha = self.attention(s1, state["keys"], state["annotations"], state["src_mask"])
        states = [self.decoder_cell(c1, s1)]
        r, own = states[0], 0
        for k, level in enumerate(self.levels, start=1):
            keys = None
            if level.kind == "cgru":
                keys, own = state["level_keys"][:, own], own + 1
            out = level(r, prev[:, k], c1, state["annotations"], keys, state["src_mask"])
            states.append(out)
            r = out + r
        return (r, c1), step_state(state, alpha, keep_attention, s=torch.stack(states, 1))

    def inference_decoder(self, int8: bool = False):
        """Seq2Seq.inference_decoder; a decoder of one level (the cGRU: shallow and deep-transition decoders) runs
        the whole step as one C++ call (engine.rnmt.FusedRNMTDecoder), with int8 weight matrices if asked."""
        return fused_or_prepared(self, super().inference_decoder(), int8)
