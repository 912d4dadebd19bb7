"""The attentional RNMT skeleton that DTMT, SHALLOWRNMT, RNNSearch-ATR and Nematus' cGRU share:

    annotations C = encoder(embeddings of x)                         (subclass: `encode_source`)
    s_0          = tanh(W_init · mean of C over the real tokens)
    per step t:  s̃_t = query_cell(y_{t-1}, s_{t-1})                  (DTMT query transition, cGRU's GRU1)
                 c_t, α_t = attention(s̃_t, C)
                 s_t = decoder_cell(c_t, s̃_t)                       (DTMT decoder transition, cGRU's GRU2)
                 features = tanh(W_1 y_{t-1} + W_2 s_t + W_3 c_t)    (the Readout)

Subclasses create src_embed, tgt_embed, init_state, query_cell, attention, decoder_cell and readout. Cells
with candidate dropout get one mask per sentence, drawn at `encode` and kept (batch first) in the state.

For decoding, `inference_decoder()` (eval mode, cpp backend) gives a FusedRNMTDecoder whose step runs everything
after the embedding lookup as one C++ call, `dtmt_models.engine.ops.rnmt_step`, the same arithmetic as the
modules (why: docs/design/decoding.md, "The decoder step as one call"). Nematus' one-level cGRU decoder uses the
same decoder.
"""
from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Tuple

import torch
from torch import Tensor

import dtmt_kernels as dk
from dtmt_kernels.ops.transition import DEEP_TRANSITION_CELLS
from dtmt_models.data.vocabulary import BOS, EOS, never_output
from dtmt_models.engine import EngineOptions, ops
from dtmt_models.engine.forms import AttentionStep, FrozenReadout, FrozenTransitionCell, FrozenTransitionLayer
from dtmt_models.models.embeddings import TokenEmbedding
from dtmt_models.models.seq2seq import (
    Seq2Seq,
    State,
    check_step_tokens,
    inference_copy,
    int8_unavailable,
    lengths_mask,
    step_state,
)


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


def longer_table(table: Optional[Tensor], length: int, make) -> Optional[Tensor]:
    """A per-position table with at least `length` rows: `table` where it has them, else `make(rows)` for
    max(length, 256, twice the table's rows) rows (so that a run of longer sentences makes few tables, as the
    positions' own table grows), or for `length` rows where that one is refused (make returns None: past a size
    bound); None where both are. A table made once is kept by its caller and reused."""
    if table is not None and table.shape[0] >= length:
        return table
    for rows in (max(length, 256 if table is None else 2 * table.shape[0]), length):
        made = make(rows)
        if made is not None:
            return made
    return None


class FusedRNMTDecoder:
    """The inference decoder (Seq2Seq.inference_decoder) of an attentional RNMT whose step is query cell -> attention ->
    decoder cell -> readout -> projection, nothing else: each `step` is one C++ call,
    `dtmt_models.engine.ops.rnmt_step`, the same arithmetic as the modules; `embed_step` and `reorder` are the
    prepared model's, and so is `encode` but for the source tables (EngineOptions.source_tables). Built by
    `fused_rnmt_decoder`, from the model's inference forms: the two FrozenTransitionCells, the AttentionStep's
    AttentionWeights and the FrozenReadout's ReadoutWeights.
    `layered`: the state's s is [B, levels, H] (Nematus) rather than [B, H]. `int8`: the step's weight matrices
    (the cells', attention's, readout's and output projection's) as int8 rows with a float32 scale each, which
    the op multiplies by the activations quantized per row (dtmt_kernels.ops.linear.quantize.linear_int8), and
    the encoder's recurrent matrices likewise (FrozenTransitionLayer.int8, in a shallow copy of the model
    that `encode` runs); biases, layer norms, the embeddings and the encoder's input matrices (one GEMM over all
    positions) stay float32. A copy of them is made here. `options`: the switches of dtmt_models.engine.EngineOptions
    (all on by default). `search`: beam search's whole loop in one C++ call (see `_search`), or None where the op
    cannot embed the previous token as the system does. `prepared`: the model it was made from (`model` is that
    model or the copy `encode` runs)."""

    max_target_steps: Optional[int] = None   # (the Decoder protocol's: no bound on the target positions)

    def __init__(self, model: Seq2Seq, layered: bool = False, int8: bool = False,
                 options: EngineOptions = EngineOptions()):
        self.prepared, self.model, self.layered, self.int8, self.options = model, model, layered, int8, options
        fold, huge_pages, step_tables = options.fold, options.huge_pages, options.step_tables
        self.query_cell, self.decoder_cell = model.query_cell, model.decoder_cell
        self.attention, self.readout = model.attention.weights, model.readout.weights
        if fold:   # the attention's output projection folded into the two matrices that read the context
            self.attention, self.decoder_cell, self.readout = ops.fold_context_projection(
                self.attention, self.decoder_cell, self.readout)
        if int8:
            # the encoder's recurrent matrices too: a copy of the model whose sequence layers are int8 forms
            self.model = inference_copy(model, lambda m: m.int8() if isinstance(m, FrozenTransitionLayer)
                                        else m)
            self.query_cell = ops.CellWeights.of(self.query_cell).int8()
            self.decoder_cell = ops.CellWeights.of(self.decoder_cell).int8()
            self.attention, self.readout = self.attention.int8(), self.readout.int8()
        if options.encoder_panels and not int8:   # the encoder's recurrent matrices for batch 1, in a shallow copy
            self.model = inference_copy(self.model, lambda m: m.with_row_panels()
                                        if isinstance(m, FrozenTransitionLayer) else m)
        if huge_pages:   # the encoder's sequence layers too, in a shallow copy of the model (after int8's)
            self.model = inference_copy(self.model, lambda m: m.on_huge_pages()
                                        if isinstance(m, FrozenTransitionLayer) else m)
            self.query_cell, self.decoder_cell, self.attention, self.readout = \
                ops.step_weights_on_huge_pages(self.query_cell, self.decoder_cell, self.attention,
                                                         self.readout)
        self.single_head = model.attention.single_head
        # the whole beam search as one C++ call (`search`), where the previous token's embedding is one the op
        # computes: TokenEmbedding's row, plus its scaled position when the system's embed_step passes them
        embed_step, emb = type(model).embed_step, model.tgt_embed
        embeds = isinstance(emb, TokenEmbedding) and (embed_step is AttentionalRNMT.embed_step or (
            embed_step is Seq2Seq.embed_step and not emb.positional))
        self.search = self._search if embeds else None
        # the previous token's products as tables for the search (step_tables; float weights): once here
        self.token_table = self._position_table = self.context_table = None
        if step_tables and self.search is not None:
            self.token_table = self._placed(ops.token_products(emb.weight, self.query_cell,
                                                                         self.readout))
            if self.attention.w_o is None:   # the context read only through the two matrices (fold)
                heads = 1 if self.single_head else model.attention.heads
                self.context_table = ops.context_heads(self.decoder_cell, self.readout, heads)
        # what `encode` runs, decided here: where the system's encode is AttentionalRNMT's (check_batch,
        # encode_source, state_from), the source tables (source_tables)
        cls, encoder = type(model), getattr(self.model, "encoder", None)
        src_embed = getattr(self.model, "src_embed", None)
        self._own_encode = cls.encode is AttentionalRNMT.encode
        self.source_table = self._source_position_table = None
        if (options.source_tables and not int8 and self._own_encode
                and cls.encode_source is AttentionalRNMT.encode_source and type(src_embed) is TokenEmbedding
                and type(encoder) is FrozenTransitionLayer and encoder.batch_first):
            self.source_table = self._placed(encoder.input_products(src_embed.weight))

    @property
    def pad_id(self) -> int:
        """The model's padding id (beam_search never chooses it)."""
        return self.model.pad_id

    def inference_decoder(self, int8: bool = False) -> "FusedRNMTDecoder":
        """Itself, or with `int8` (and int8 not yet) its int8 form, with this decoder's other settings."""
        if not int8 or self.int8:
            return self
        return FusedRNMTDecoder(self.prepared, self.layered, True, self.options)

    @torch.no_grad()   # inference only (the ops write into buffers: no autograd)
    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        """The model's encode: with source tables, the annotations from them (FrozenTransitionLayer.encode_tokens)."""
        m = self.model
        if not self._own_encode:
            return m.encode(src, src_lengths)
        m.check_batch(src, src_lengths)
        positions = None
        if self.source_table is not None and m.src_embed.positional:
            positions = self.source_position_table(src.shape[1])
        if self.source_table is None or (m.src_embed.positional and positions is None):
            annotations = m.encode_source(src, src_lengths)
        else:
            annotations = m.encoder.encode_tokens(src, self.source_table, positions, lengths=src_lengths)[0]
        return m.state_from(annotations, src_lengths)

    def source_position_table(self, length: int) -> Optional[Tensor]:
        """The source positions' products with the encoder's input matrices (FrozenTransitionLayer.input_products
        of the source embedding's scaled position rows) for positions 0..length-1 at least (longer_table), or None
        where such a table would pass the layer's size bound."""
        emb, encoder = self.model.src_embed, self.model.encoder
        table = longer_table(self._source_position_table, length,
                             lambda rows: self._placed(encoder.input_products(emb.scaled_positions(rows, emb.weight))))
        if table is not None:   # (else the shorter one is kept for the sentences it serves)
            self._source_position_table = table
        return table

    def reorder(self, state: State, index: Tensor) -> State:
        return self.model.reorder(state, index)

    # what AttentionalRNMT.encode / Nematus.encode make once per sentence (the candidate-dropout masks too)
    PER_SENTENCE = frozenset({"annotations", "keys", "src_mask", "drop_q", "drop_d"})

    def reorder_within(self, state: State, index: Tensor) -> State:
        """`reorder` for an index that keeps every row among its sentence's rows (beam_search): the entries made
        once per sentence are kept as they are."""
        return {k: v if k in self.PER_SENTENCE else v.index_select(0, index) for k, v in state.items()}

    @torch.no_grad()   # inference only (the ops write into buffers: no autograd)
    def step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        check_step_tokens(type(self.model).__name__, prev_tokens, state["s"].shape[0])
        y = self.model.embed_step(state, prev_tokens)
        s = state["s"][:, 0] if self.layered else state["s"]
        keys = state["keys"].unsqueeze(2) if self.single_head else state["keys"]
        log_probs, s, alpha = ops.rnmt_step(y, s, keys, state["annotations"], state["src_mask"],
                                                      self.query_cell, self.decoder_cell, self.attention,
                                                      self.readout)
        updates = {"s": s.unsqueeze(1) if self.layered else s}
        if "pos" in state:
            updates["pos"] = state["pos"] + 1
        return log_probs, step_state(state, alpha, True, **updates)

    @torch.no_grad()   # inference only (the ops write into buffers: no autograd)
    def _search(self, state: State, beam: int, alpha: float, max_len: Tensor, early_stop: bool = False,
                nbest: Optional[int] = None) -> List[List[Tuple[List[int], float, float]]]:
        """beam_search's loop (dtmt_models.decoding.beam_search, its reference) in one C++ call,
        ops.rnmt_beam_search, from the state `encode` made: for each sentence its finished hypotheses,
        best first, as (tokens, score, log_prob): up to `beam` of them, of which the first `nbest` are what a search
        run to max length would give (beam_search's rule; nbest None: beam). `early_stop`: beam_search's."""
        if "drop_q" in state or "drop_d" in state:
            raise ValueError("FusedRNMTDecoder.search: the state has candidate-dropout masks (a model in training "
                             "mode); decode in eval mode")
        emb = self.model.tgt_embed
        steps = int(max_len.max())
        positions = emb.scaled_positions(steps, emb.weight) if emb.positional and "pos" in state else None
        position_table = None if positions is None or self.token_table is None else self.position_table(steps)
        s = state["s"][:, 0] if self.layered else state["s"]
        keys = state["keys"].unsqueeze(2) if self.single_head else state["keys"]
        counts, lengths, tokens, scores, log_probs = ops.rnmt_beam_search(
            state["annotations"], keys, state["src_mask"], s, emb.weight, positions, self.query_cell,
            self.decoder_cell, self.attention, self.readout, beam, alpha, max_len, BOS, EOS, self.options.step_tables,
            early_stop, self.token_table, position_table, self.context_table, nbest,
            never_output(self.pad_id))
        flat, sizes = tokens.tolist(), lengths.tolist()
        hyps = [(flat[end - n:end], score, lp) for n, end, score, lp in zip(sizes, accumulate(sizes), scores.tolist(),
                                                                           log_probs.tolist())]
        out, i = [], 0
        for n in counts.tolist():
            out.append(hyps[i:i + n])
            i += n
        return out


    def position_table(self, steps: int) -> Optional[Tensor]:
        """The previous token's products with its scaled position for positions 0..steps-1 at least
        (ops.token_products of the target embedding's position rows; longer_table), or None where such a
        table would pass token_products' size bound."""
        emb = self.model.tgt_embed
        table = longer_table(self._position_table, steps,
                             lambda rows: self._placed(ops.token_products(
                                 emb.scaled_positions(rows, emb.weight), self.query_cell, self.readout)))
        if table is not None:   # (else the shorter one is kept for the sentences it serves)
            self._position_table = table
        return table

    def _placed(self, table: Optional[Tensor]) -> Optional[Tensor]:
        """A token or position table as the step reads it: with `huge_pages`, copied into 2 MiB pages (a step
        reads the rows of its beam's previous tokens, ~6 KB each, anywhere in a table of tens of MB: in 4 KiB
        pages each costs page walks; docs/design/cpu_kernels.md, "Weights on 2 MiB pages")."""
        if table is None or not self.options.huge_pages:
            return table
        return dk.ops.linear.huge_page_copies([table])[0]


def fused_rnmt_decoder(prepared: Seq2Seq, transition, layered: bool = False, int8: bool = False
                       ) -> Optional[FusedRNMTDecoder]:
    """A FusedRNMTDecoder for `prepared` (a model's inference copy, eval mode), or None where its step is not the
    one the fused op computes: a class whose transition is not `transition` (the system's own, as the caller
    names it) or that changes the features, decoder step or step; higher decoder levels (`levels`, Nematus'); a
    part without its inference form (another backend, dtype or device; a swapped-in module of another kind; a
    readout with deep layers); cells of different eps; with `int8`, weights that are not CPU float32."""
    cls = type(prepared)
    if (prepared.training or cls.transition is not transition or cls.features is not Seq2Seq.features
            or cls.decoder_step is not Seq2Seq.decoder_step or cls.step is not Seq2Seq.step
            or len(getattr(prepared, "levels", ()))):
        return None
    q, d, att, r = prepared.query_cell, prepared.decoder_cell, prepared.attention, prepared.readout
    if not (type(q) is type(d) is FrozenTransitionCell and q.eps == d.eps and type(att) is AttentionStep
            and type(r) is FrozenReadout and r.weights.w_out is not None):
        return None
    if int8 and (r.weights.w_out.dtype != torch.float32 or r.weights.w_out.device.type != "cpu"):
        return None
    return FusedRNMTDecoder(prepared, layered, int8)


def fused_or_prepared(model: Seq2Seq, prepared: Seq2Seq, transition, layered: bool = False, int8: bool = False):
    """What `model.inference_decoder(int8)` returns for a system with a fused step: `fused_rnmt_decoder(prepared,
    ...)` where it applies, else `prepared` (model's inference copy); int8 decoding where it does not apply is a
    ValueError (int8_unavailable)."""
    fused = fused_rnmt_decoder(prepared, transition, layered, int8)
    if int8 and fused is None:
        raise int8_unavailable(model)
    return fused or prepared


class AttentionalRNMT(Seq2Seq):
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
        return fused_or_prepared(self, super().inference_decoder(), AttentionalRNMT.transition, int8=int8)

    def transition(self, state: State, y: Tensor, keep_attention: bool = True) -> Tuple[Tuple[Tensor, ...], State]:
        """Query transition, attention and decoder transition: ((s_t, c_t), the new state)."""
        s_q = self.query_cell(y, state["s"], self._drop(state, "drop_q"))
        c, alpha = self.attention(s_q, state["keys"], state["annotations"], state["src_mask"])
        s = self.decoder_cell(c, s_q, self._drop(state, "drop_d"))
        return (s, c), step_state(state, alpha, keep_attention, s=s, pos=state["pos"] + 1)
