"""`mce`: the multi-channel encoder of paper 003 (Xiong et al.), on an RNNsearch decoder.

Encoder, per direction (forward, and backward from each sentence's own last token), with GRU state s and an
external memory M ∈ R^{S×H} per sentence initialised with the source embeddings (eq. 13-17):
    w_t  = softmax_i vᵀ tanh(U_a s_{t-1} + W_a M_{t-1}[i])      read/write weights over the memory cells
                                                                  (eq. 5-6; shared for reading and writing)
    R_t  = σ(W_r s_{t-1})                                         read gate (eq. 14)
    M̃_t[i] = R_t ⊙ M_{t-1}[i]                                    read memory (eq. 13)
    c_t  = Σ_i w_t[i] M̃_t[i]                                      read content (eq. 15)
    s_t  = GRU([e_t; c_t], s_{t-1})                               eq. 16, with the read content joining the input
    M_t[i] = M̃_t[i] + w_t[i] U_t,  U_t = σ(W_u s_t)              write (eq. 17)
Our reading of eq. 13, where "M_{t-1}(w ⊙ R)" mixes an [S]-vector and an [H]-vector: the gate R_t applies to
every cell and the weights w_t to the sum of eq. 15 (applying w in both would weight it twice). Eq. 16 writes
GRU(c_t, e_t); the parameter counts of the paper's Table 1 fit a GRU whose input is [e_t; c_t] and whose state is
the usual s_{t-1}, which is what we build. Padded steps leave s and M unchanged.

As the paper's baseline ("using the output of forward RNN as the input of the backward RNN"), the backward
direction reads the forward states by default (`backward_input="forward_states"`; "embeddings" for the
classic biRNN).

Channels: rnn = [→s_j; ←s_j], ntm = [→M_S[j]; ←M_S[j]] (the memories after the whole pass), emb = e_j. Only
what the selected channels need is built and run: with ntm, the read-write-memory GRU above (its states are the
rnn channel); with rnn and no ntm, a plain bidirectional GRU (eq. 8-12), the paper's RNN baseline (Table 1:
NTM − RNN = 3,674,114 parameters at 512, which is the memory machinery, 14·512² + 8·512 plus two scalars);
with emb alone, no recurrent encoder at all, and the annotation is W_e e_j (a projection to 2H wide). `annotation`
picks one channel or a gated combination (eq. 18-25):
    ntm-rnn      gate(M, h)                          rnn-emb      gate(E, h)
    ntm-emb      gate(E, M)                          ntm-rnn-emb  gate(E, gate(M, h))
    gate(a, b) = g ⊙ (A a) + (1 − g) ⊙ (B b),   g = σ(W_g a + U_g b + b_g)
Our reading of the gates: eqs. 18-25 combine the channels unprojected, yet E (512 wide) is combined with 1024-wide
channels, and Table 1 charges every gated channel one (width × 1024) matrix more than W_g and U_g: a gate with the
embeddings costs 3·1024² + 1024 (RNN-EMB − RNN = NTM-EMB − NTM = NTM-RNN-EMB − NTM-RNN = 3,146,752) and the
ntm-rnn gate 4·1024² + 1024 (NTM-RNN − NTM = 4,195,328). Projecting each channel into the annotation space (A, B,
no bias) before the gated sum is the one reading that fits all four gated rows exactly, so that is what we build.
The EMB row (58,416,131) fits no model that builds only what it uses: it is NTM − 1.5·1024², i.e. it still
counts memory-encoder variables an embeddings-only annotation never reads; ours has no encoder for "emb".
Decoder: RNNsearch as in eq. 1-6 (s'_j = GRU(y_{j-1}, s_{j-1}), attention queried by s'_j, s_j = GRU(c_j, s'_j),
t_j = tanh(s W + e_y W + c W)), dropout 0.5 on the output layer (paper §Experiments). Memory cells when
embed_dim != hidden_size: the embeddings are projected to H before initialising the memory.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn as nn
from torch import Tensor

import dtmt_kernels as dk
from dtmt_models.engine import ops
from dtmt_models.engine.forms import (FrozenMemoryEncoder, FrozenTransitionCell, inference_form, plain_linear,
                                     runs_fused_inference)
from dtmt_models.models.attention import AdditiveAttention, masked_softmax
from dtmt_models.models.embeddings import TokenEmbedding
from dtmt_models.models.registered import register_model
from dtmt_models.models.rnmt import AttentionalRNMT
from dtmt_models.models.seq2seq import Readout, lengths_mask

ANNOTATIONS = ("rnn", "ntm", "emb", "ntm-emb", "ntm-rnn", "rnn-emb", "ntm-rnn-emb")


class MemoryGRUEncoderDirection(nn.Module):
    """One direction of the read-write-memory GRU encoder."""

    def __init__(self, embed_dim: int, hidden_size: int, backend: str):
        super().__init__()
        H = hidden_size
        self.cell = dk.nn.DeepTransitionGRUCell(embed_dim + H, H, depth=0, cell="gru", layer_norm=False,
                                                backend=backend)
        self.address_state = dk.nn.Linear(H, H, bias=False)
        self.address_memory = dk.nn.Linear(H, H, bias=True)
        self.address_v = dk.nn.Linear(H, 1, bias=False)
        self.read_gate = dk.nn.Linear(H, H)
        self.write_gate = dk.nn.Linear(H, H)

    def inference_module(self) -> nn.Module:
        """This direction's form for decoding: a FrozenMemoryEncoder on the cpp backend with plain linears, else
        itself."""
        lin = (self.address_state, self.address_memory, self.address_v, self.read_gate, self.write_gate)
        cell = inference_form(self.cell)
        if type(cell) is not FrozenTransitionCell or not all(plain_linear(m) for m in lin) \
                or not runs_fused_inference(*lin):
            return self
        weights = ops.MemoryWeights(
            self.address_state.weight, self.address_memory.weight, self.address_memory.bias, self.address_v.weight,
            self.read_gate.weight, self.read_gate.bias, self.write_gate.weight, self.write_gate.bias)
        return FrozenMemoryEncoder(self, cell, weights)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, reverse: bool) -> Tuple[Tensor, Tensor]:
        """x [B, S, E], memory [B, S, H] (initial), src_mask [B, S] -> (states [B, S, H], final memory)."""
        B, S, _ = x.shape
        s = x.new_zeros(B, memory.shape[-1])
        states = [None] * S
        xs = x.unbind(1)   # one backward node for all steps (x[:, t] zero-fills a full gradient per step)
        for t in (range(S - 1, -1, -1) if reverse else range(S)):
            keys = self.address_memory(memory)
            w = masked_softmax(self.address_v(torch.tanh(keys + self.address_state(s).unsqueeze(1))).squeeze(-1),
                               src_mask)                                            # [B, S]
            read = memory * torch.sigmoid(self.read_gate(s)).unsqueeze(1)            # M̃_t
            c = torch.bmm(w.unsqueeze(1), read).squeeze(1)
            s_new = self.cell(torch.cat([xs[t], c], -1), s)
            written = read + w.unsqueeze(-1) * torch.sigmoid(self.write_gate(s_new)).unsqueeze(1)
            valid = src_mask[:, t].view(B, 1)
            s = torch.where(valid, s_new, s)
            memory = torch.where(valid.unsqueeze(-1), written, memory)
            states[t] = torch.where(valid, s_new, torch.zeros_like(s_new))
        return torch.stack(states, 1), memory


class Gate(nn.Module):
    """gate(a, b) = g ⊙ (A a) + (1 − g) ⊙ (B b), g = σ(W a + U b + bias).
    a [.., dim_a], b [.., dim_b] -> [.., dim]; the module docstring says why each channel has its own A, B."""

    def __init__(self, dim_a: int, dim_b: int, dim: int):
        super().__init__()
        self.w = dk.nn.Linear(dim_a, dim, bias=True)
        self.u = dk.nn.Linear(dim_b, dim, bias=False)
        self.proj_a = dk.nn.Linear(dim_a, dim, bias=False)
        self.proj_b = dk.nn.Linear(dim_b, dim, bias=False)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        g = torch.sigmoid(self.w(a) + self.u(b))
        return g * self.proj_a(a) + (1 - g) * self.proj_b(b)


@register_model("mce")
class MultiChannelEncoderNMT(AttentionalRNMT):
    @staticmethod
    def unused_options(o: dict) -> Dict[str, str]:
        """backward_input where the annotation has no recurrent encoder (registry.unused_options)."""
        return {"backward_input": "annotation='emb' has no backward encoder"} if o["annotation"] == "emb" else {}

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256,
                 annotation: str = "ntm-rnn-emb", backward_input: str = "forward_states", dropout: float = 0.5,
                 tie_embeddings: bool = False, pad_id: int = 0, backend: str = "auto"):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id)
        if annotation not in ANNOTATIONS:
            raise ValueError(f"mce: annotation must be one of {ANNOTATIONS}, got {annotation!r}")
        if backward_input not in ("forward_states", "embeddings"):
            raise ValueError(f"mce: backward_input must be 'forward_states' or 'embeddings', got {backward_input!r}")
        E, H = embed_dim, hidden_size
        self.annotation, self.backward_input = annotation, backward_input
        self.src_embed = TokenEmbedding(src_vocab_size, E, pad_id)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, E, pad_id)
        bwd_in = H if backward_input == "forward_states" else E
        if "ntm" in annotation:       # the read-write-memory GRU: memory channel, and its states for rnn
            self.memory_init = nn.Identity() if E == H else dk.nn.Linear(E, H, bias=False)
            self.encoder_fwd = MemoryGRUEncoderDirection(E, H, backend)
            self.encoder_bwd = MemoryGRUEncoderDirection(bwd_in, H, backend)
        elif "rnn" in annotation:     # the plain bidirectional GRU of the RNN baseline
            plain = dict(depth=0, cell="gru", layer_norm=False, backend=backend, batch_first=True)
            self.encoder_fwd = dk.nn.DeepTransitionGRU(E, H, **plain)
            self.encoder_bwd = dk.nn.DeepTransitionGRU(bwd_in, H, reverse=True, **plain)
        if annotation == "emb":
            self.emb_channel = dk.nn.Linear(E, 2 * H, bias=False)
        if annotation in ("ntm-rnn", "ntm-rnn-emb"):
            self.gate_ntm_rnn = Gate(2 * H, 2 * H, 2 * H)
        if annotation in ("rnn-emb", "ntm-emb", "ntm-rnn-emb"):
            self.gate_emb = Gate(E, 2 * H, 2 * H)
        gru = dict(depth=0, cell="gru", layer_norm=False, backend=backend)
        self.init_state = dk.nn.Linear(2 * H, H)
        self.query_cell = dk.nn.DeepTransitionGRUCell(E, H, **gru)
        self.attention = AdditiveAttention(H, 2 * H, H, backend=backend)
        self.decoder_cell = dk.nn.DeepTransitionGRUCell(2 * H, H, **gru)
        self.readout = Readout(E, H, 2 * H, E, tgt_vocab_size, dropout,
                               self.tgt_embed.weight if tie_embeddings else None)

    def encode_source(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        x = self.src_embed(src)
        src_mask = lengths_mask(src_lengths, src.shape[1])
        pad = src_mask.unsqueeze(-1)
        a = self.annotation
        rnn = ntm = None
        if "ntm" in a:
            memory0 = self.memory_init(x)
            h_f, m_f = self.encoder_fwd(x, memory0, src_mask, reverse=False)
            h_b, m_b = self.encoder_bwd(h_f if self.backward_input == "forward_states" else x, memory0, src_mask,
                                        reverse=True)
            rnn = torch.cat([h_f, h_b], -1)
            ntm = torch.cat([m_f, m_b], -1) * pad
        elif "rnn" in a:
            h_f = self.encoder_fwd(x, lengths=src_lengths)[0]
            h_b = self.encoder_bwd(h_f if self.backward_input == "forward_states" else x, lengths=src_lengths)[0]
            rnn = torch.cat([h_f, h_b], -1)
        if a == "rnn":
            return rnn
        if a == "ntm":
            return ntm
        if a == "emb":
            return self.emb_channel(x) * pad
        emb = x * pad if "emb" in a else None
        if a == "ntm-rnn":
            return self.gate_ntm_rnn(ntm, rnn)
        if a == "rnn-emb":
            return self.gate_emb(emb, rnn)
        if a == "ntm-emb":
            return self.gate_emb(emb, ntm)
        return self.gate_emb(emb, self.gate_ntm_rnn(ntm, rnn))   # ntm-rnn-emb
