"""The attentional RNMT skeleton that DTMT, SHALLOWRNMT, RNNSearch-ATR and Nematus' cGRU share:

    annotations C = encoder(embeddings of x)                         (subclass: `encode_source`)
    s_0          = tanh(W_init · mean of C over the real tokens)
    per step t:  s̃_t = query_cell(y_{t-1}, s_{t-1})                  (DTMT query transition, cGRU's GRU1)
                 c_t, α_t = attention(s̃_t, C)
                 s_t = decoder_cell(c_t, s̃_t)                       (DTMT decoder transition, cGRU's GRU2)
                 features = tanh(W_1 y_{t-1} + W_2 s_t + W_3 c_t)    (the Readout)

Subclasses create src_embed, tgt_embed, init_state, query_cell, attention, decoder_cell and readout. Cells
with candidate dropout get one mask per sentence, drawn at `encode` and kept (batch first) in the state.

For decoding, `inference_decoder()` (eval mode, cpp backend) exports the model to the engine's FusedRNMTDecoder
(dtmt_models.engine.rnmt), whose step runs everything after the embedding lookup as one C++ call,
`dtmt_models.engine.ops.rnmt_step`, the same arithmetic as the modules (why: docs/design/decoding.md, "The decoder
step as one call"). The class states it (`fused_step`); Nematus' one-level cGRU decoder uses the same decoder.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import torch
from torch import Tensor

import dtmt_kernels as dk
from dtmt_kernels.ops.transition import DEEP_TRANSITION_CELLS
from dtmt_models.engine.decoder import step_state
from dtmt_models.engine.forms import AttentionStep, FrozenReadout, FrozenTransitionCell, FrozenTransitionLayer
from dtmt_models.engine.rnmt import FusedRNMTDecoder, FusedStep
from dtmt_models.models.embeddings import TokenEmbedding
from dtmt_models.models.seq2seq import Seq2Seq, State, check_int8_flag, int8_unavailable, lengths_mask


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """x [B, S, D], mask [B, S] bool -> mean over the real positions [B, D]."""
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


SWAPPABLE_CELLS = ("atr",) + DEEP_TRANSITION_CELLS   # (the order of the messages naming them)


def _check_swappable(cell: str) -> None:
    if cell not in SWAPPABLE_CELLS:
        raise ValueError(f"cell must be one of {SWAPPABLE_CELLS}, got {cell!r}")


def recurrent_layer(cell: str, input_size: int, hidden_size: int, **options):
    """A one-cell recurrent layer of the given type (contract §4: systems swap GRU / LAU / L-GRU / ATR)."""
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
    S = annotations.shape[1]
    src_mask = lengths_mask(src_lengths, S)
    # with nothing padded (a sentence translated alone) the mean is the plain sum / S, the same values in fewer ops
    unpadded = dk.functional.host_reads_allowed() and all(n == S for n in dk.functional.host_list(src_lengths))
    s = torch.tanh(init_state(annotations.sum(1) / S if unpadded else masked_mean(annotations, src_mask)))
    if layers is not None:
        s = s.view(s.shape[0], layers, -1)
    return {"annotations": annotations, "keys": attention.precompute(annotations), "src_mask": src_mask, "s": s}


def fused_rnmt_decoder(prepared: Seq2Seq, int8: bool = False) -> Optional[FusedRNMTDecoder]:
    """The export of `prepared` (a model's inference copy, eval mode) to the engine's one-call step: a FusedRNMTDecoder,
    or None where its step is not the one the fused op computes: a class that does not state `fused_step`
    (Seq2Seq.fused_step); higher decoder levels (`levels`, Nematus'); a part without its inference form (another
    backend, dtype or device; a swapped-in module of another kind; a readout with deep layers); cells of different
    eps; with `int8`, weights that are not CPU float32. The class's FusedStep is narrowed here to what the model's
    modules allow: the one-call search where the target embedding is a TokenEmbedding (without positions where
    embed_step passes none), the source tables where the encoder reads a TokenEmbedding through one batch-first
    FrozenTransitionLayer."""
    step = type(prepared).fused_step
    if prepared.training or step is None or len(getattr(prepared, "levels", ())):
        return None
    q, d, att, r = prepared.query_cell, prepared.decoder_cell, prepared.attention, prepared.readout
    if not (isinstance(q, FrozenTransitionCell) and isinstance(d, FrozenTransitionCell) and q.eps == d.eps
            and isinstance(att, AttentionStep) and isinstance(r, FrozenReadout) and r.weights.w_out is not None):
        return None
    if int8 and (r.weights.w_out.dtype != torch.float32 or r.weights.w_out.device.type != "cpu"):
        return None
    emb, src_embed = prepared.tgt_embed, getattr(prepared, "src_embed", None)
    encoder = getattr(prepared, "encoder", None)
    step = replace(step,
                   embeds=step.embeds and isinstance(emb, TokenEmbedding) and (step.positions or not emb.positional),
                   tabled_encoder=step.tabled_encoder and isinstance(src_embed, TokenEmbedding)
                   and isinstance(encoder, FrozenTransitionLayer) and encoder.batch_first)
    return FusedRNMTDecoder(prepared, step, int8)


def fused_or_prepared(model: Seq2Seq, prepared: Seq2Seq, int8: bool = False):
    """What `model.inference_decoder(int8)` returns for a system that states a fused step: `fused_rnmt_decoder(
    prepared, int8)` where it applies, else `prepared` (model's inference copy); int8 decoding where it does not
    apply is a ValueError (int8_unavailable)."""
    check_int8_flag(model, int8)
    fused = fused_rnmt_decoder(prepared, int8)
    if int8 and fused is None:
        raise int8_unavailable(model)
    return fused or prepared


class AttentionalRNMT(Seq2Seq):
    # its step is the engine's one-call step, embedding the previous token with its position; its encode reads
    # encode_source (a subclass that redefines either loses what it covers: Seq2Seq.__init_subclass__)
    fused_step = FusedStep(positions=True)

    def encode_source(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        """Annotations [B, S, C] (zeros at padding)."""
        return self.encoder(self.src_embed(src), lengths=src_lengths)[0]

    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        self.check_batch(src, src_lengths)
        return self.state_from(self.encode_source(src, src_lengths), src_lengths)

    def state_from(self, annotations: Tensor, src_lengths: Tensor) -> State:
        """What `encode` makes of the source's annotations [B, S, C]: the decoder's first state."""
        B = annotations.shape[0]
        state = start_state(self.attention, self.init_state, annotations, src_lengths)
        state["pos"] = torch.zeros(B, dtype=torch.long, device=annotations.device)
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

    def inference_decoder(self, int8: bool = False):
        """Seq2Seq.inference_decoder, with the whole step as one C++ call where it applies (FusedRNMTDecoder);
        `int8`: its weight matrices as int8 rows (ValueError where the fused step does not apply)."""
        return fused_or_prepared(self, super().inference_decoder(), int8)

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        """Query transition, attention and decoder transition: ((s_t, c_t), the new state)."""
        s_q = self.query_cell(y, state["s"], self._drop(state, "drop_q"))
        c, alpha = self.attention(s_q, state["keys"], state["annotations"], state["src_mask"])
        s = self.decoder_cell(c, s_q, self._drop(state, "drop_d"))
        return (s, c), step_state(state, alpha, keep_attention, s=s, pos=state["pos"] + 1)
