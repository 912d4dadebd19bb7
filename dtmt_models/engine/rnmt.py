"""The attentional RNMT systems' decoder in the engine: each step one C++ call, and the whole beam search one more
(`FusedStep`, `FusedRNMTDecoder`; why: docs/design/decoding.md, "The decoder step as one call").

A system class declares `fused_step = FusedStep(...)` when its step is query cell -> attention -> decoder cell ->
readout -> projection and nothing else (dtmt_models.models.rnmt.AttentionalRNMT, Nematus' one-level cGRU); the
model's export (`rnmt.fused_rnmt_decoder`) checks that its parts have their frozen forms and builds the decoder
from them. The engine reads the model only through its Decoder-protocol members and the parts named below; it
imports no model."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import List, Optional, Tuple

import torch
from torch import Tensor

import dtmt_kernels as dk
from dtmt_models.data.vocabulary import BOS, EOS, never_output

from . import ops
from .decoder import State, check_step_tokens, step_state
from .forms import FrozenTransitionLayer, check_unconverted, inference_copy, weights_kind
from .options import EngineOptions


@dataclass(frozen=True)
class FusedStep:
    """What a system class states of its step for the engine's one-call step (a class attribute, `fused_step`; a
    subclass that redefines a method of the step without stating it again loses it: Seq2Seq.__init_subclass__).

    layered: the state's s is [B, levels, H] (Nematus) rather than [B, H].
    positions: `embed_step` adds the target embedding's scaled position of state["pos"] (AttentionalRNMT's);
        else it is the token's row alone.
    embeds: the previous token's embedding is one the ops compute (the TokenEmbedding's row, plus its scaled
        position where `positions` and the embedding has them), so the whole search can be one call.
    tabled_encoder: `encode` is check_batch -> encoder(src_embed(src)) -> state_from (AttentionalRNMT's), with a
        TokenEmbedding read by one batch-first FrozenTransitionLayer, so the source tables may serve it.
    A class states what its methods allow; the model's export narrows `embeds` and `tabled_encoder` to what its
    modules are (rnmt.fused_rnmt_decoder)."""

    layered: bool = False
    positions: bool = True
    embeds: bool = True
    tabled_encoder: bool = True


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
    decoder cell -> readout -> projection, nothing else: each `step` is one C++ call, `ops.rnmt_step`, the same
    arithmetic as the modules; `embed_step` and `reorder` are the prepared model's, and so is `encode` but for the
    source tables (EngineOptions.source_tables). Built by the model's export (rnmt.fused_rnmt_decoder) from its
    inference forms: the two FrozenTransitionCells (query_cell, decoder_cell), the AttentionStep's AttentionWeights
    (attention) and the FrozenReadout's ReadoutWeights (readout), with its embeddings (tgt_embed, src_embed) and
    encoder. `step` (kept as `step_form`): the FusedStep the export resolved. `int8`: the step's weight matrices
    (the cells', attention's, readout's and output projection's) as int8 rows with a float32 scale each, which
    the op multiplies by the activations quantized per row (dtmt_kernels.ops.linear.quantize.linear_int8), and
    the encoder's recurrent matrices likewise (FrozenTransitionLayer.int8, in a shallow copy of the model
    that `encode` runs); biases, layer norms, the embeddings and the encoder's input matrices (one GEMM over all
    positions) stay float32. A copy of them is made here. `options`: the switches of dtmt_models.engine.EngineOptions
    (all on by default). `search`: beam search's whole loop in one C++ call (see `_search`), or None where the op
    cannot embed the previous token as the system does (step.embeds). `prepared`: the model it was made from
    (`model` is that model or the copy `encode` runs); `variant` makes another decoder from it."""

    max_target_steps: Optional[int] = None   # (the Decoder protocol's: no bound on the target positions)

    def __reduce_ex__(self, protocol):   # (copy.copy, copy.deepcopy and pickle all come here)
        raise TypeError("FusedRNMTDecoder: a decoder holds weights gathered from one model in this process and is "
                        "neither copied nor pickled (a copy read other parameters than its model's and was refused "
                        "as changed); copy or send the model, then build its decoder (model.inference_decoder())")

    def __init__(self, model, step: FusedStep, int8: bool = False, options: EngineOptions = EngineOptions()):
        if not isinstance(options, EngineOptions):   # (a dict was an AttributeError: 'dict' object has no 'fold')
            raise TypeError(f"FusedRNMTDecoder: options must be an EngineOptions, got {type(options).__name__}")
        self.prepared, self.model, self.step_form, self.int8, self.options = model, model, step, int8, options
        self._built_as = weights_kind(model)   # (what a conversion of the model would change: check_unconverted)
        self.layered = step.layered
        self.query_cell, self.decoder_cell = model.query_cell, model.decoder_cell
        self.attention, self.readout = model.attention.weights, model.readout.weights
        if options.fold:   # the attention's output projection folded into the two matrices that read the context
            self.attention, self.decoder_cell, self.readout = ops.fold_context_projection(
                self.attention, self.decoder_cell, self.readout)
        if int8:
            part = "encoder"   # (which one a weight that quantize_rows refuses is of, for its message)
            try:
                # the encoder's recurrent matrices too: a copy of the model whose sequence layers are int8 forms
                self.model = _layers_copy(model, FrozenTransitionLayer.int8)
                part = "query cell"
                self.query_cell = ops.CellWeights.of(self.query_cell).int8()
                part = "decoder cell"
                self.decoder_cell = ops.CellWeights.of(self.decoder_cell).int8()
                part = "attention"
                self.attention = self.attention.int8()
                part = "readout"
                self.readout = self.readout.int8()
            except FloatingPointError as err:   # (a NaN weight, or a fold's product beyond float32)
                folded = (" (with the attention's output projection folded in)"
                          if part in ("decoder cell", "readout") and options.fold
                          and model.attention.weights.w_o is not None else "")
                raise FloatingPointError(f"int8 decoding of {type(model).__name__}: the {part}'s weight "
                                         f"matrices{folded}: {err}") from None
        if options.encoder_panels and not int8:   # the encoder's recurrent matrices for batch 1, in a shallow copy
            self.model = _layers_copy(self.model, FrozenTransitionLayer.with_row_panels)
        if options.huge_pages:   # the encoder's sequence layers too, in a shallow copy of the model (after int8's)
            self.model = _layers_copy(self.model, FrozenTransitionLayer.on_huge_pages)
            self.query_cell, self.decoder_cell, self.attention, self.readout = ops.step_weights_on_huge_pages(
                self.query_cell, self.decoder_cell, self.attention, self.readout)
        self.single_head = model.attention.single_head
        # the whole beam search as one C++ call (`search`), where the previous token's embedding is one the op
        # computes
        self.search = self._search if step.embeds else None
        # the previous token's products as tables for the search (step_tables; float weights): once here
        self.token_table = self._position_table = self.context_table = None
        if options.step_tables and self.search is not None:
            self.token_table = self._placed(ops.token_products(model.tgt_embed.weight, self.query_cell,
                                                               self.readout))
            if self.attention.w_o is None:   # the context read only through the two matrices (fold)
                heads = 1 if self.single_head else model.attention.heads
                self.context_table = ops.context_heads(self.decoder_cell, self.readout, heads)
        # the source tables (source_tables): what `encode` reads where the system's encode allows them
        self.source_table = self._source_position_table = None
        if options.source_tables and not int8 and step.tabled_encoder:
            self.source_table = self._placed(self.model.encoder.input_products(self.model.src_embed.weight))

    def variant(self, int8: Optional[bool] = None, options: Optional[EngineOptions] = None) -> "FusedRNMTDecoder":
        """A decoder of the same model and step with `int8` and / or `options` changed (the others kept)."""
        self.check_unconverted()   # (the prepared copy's forms hold the weights gathered from the model as it was)
        return FusedRNMTDecoder(self.prepared, self.step_form, self.int8 if int8 is None else int8,
                                self.options if options is None else options)

    @property
    def pad_id(self) -> int:
        """The model's padding id (beam_search never chooses it)."""
        return self.model.pad_id

    def inference_decoder(self, int8: bool = False) -> "FusedRNMTDecoder":
        """Itself, or with `int8` (and int8 not yet) its int8 form, with this decoder's other settings."""
        return self if not int8 or self.int8 else self.variant(int8=True)

    @torch.no_grad()   # inference only (the ops write into buffers: no autograd)
    def encode(self, src: Tensor, src_lengths: Tensor) -> State:
        """The model's encode: with source tables, the annotations from them (FrozenTransitionLayer.encode_tokens)."""
        self.check_unconverted()
        m = self.model
        if self.source_table is None:
            return m.encode(src, src_lengths)
        m.check_batch(src, src_lengths)
        positions = None
        if m.src_embed.positional:
            positions = self.source_position_table(src.shape[1])
        if m.src_embed.positional and positions is None:
            annotations = m.encode_source(src, src_lengths)
        else:
            annotations = m.encoder.encode_tokens(src, self.source_table, positions, lengths=src_lengths)[0]
        return m.state_from(annotations, src_lengths)

    def check_unconverted(self) -> None:
        """TypeError where the model was converted after this decoder was built, RuntimeError where its weights
        changed in place or were replaced (forms.check_unconverted)."""
        check_unconverted(self, self.model, self._built_as)

    def source_position_table(self, length: int) -> Optional[Tensor]:
        """The source positions' products with the encoder's input matrices (FrozenTransitionLayer.input_products
        of the source embedding's scaled position rows) for positions 0..length-1 at least (longer_table), or None
        where such a table would pass the layer's size bound. Kept for the next calls, but for one made while
        torch.compile or torch.export traces (fake tensors: an export left every later encode broken)."""
        emb, encoder = self.model.src_embed, self.model.encoder
        table = longer_table(self._source_position_table, length,
                             lambda rows: self._placed(encoder.input_products(emb.scaled_positions(rows, emb.weight))))
        if table is not None and not torch.compiler.is_compiling():   # (else the shorter one is kept for the
            self._source_position_table = table                         # sentences it serves; no fake one kept)
        return table

    def reorder(self, state: State, index: Tensor) -> State:
        return self.model.reorder(state, index)   # (which checks the index)

    # what AttentionalRNMT.encode / Nematus.encode make once per sentence (the candidate-dropout masks too)
    PER_SENTENCE = frozenset({"annotations", "keys", "src_mask", "drop_q", "drop_d"})

    def reorder_within(self, state: State, index: Tensor) -> State:
        """`reorder` for an index that keeps every row among its sentence's rows (beam_search): the entries made
        once per sentence are kept as they are."""
        return {k: v if k in self.PER_SENTENCE else v.index_select(0, index) for k, v in state.items()}

    @torch.no_grad()   # inference only (the ops write into buffers: no autograd)
    def step(self, state: State, prev_tokens: Tensor) -> Tuple[Tensor, State]:
        check_step_tokens(type(self.model).__name__, prev_tokens, state["s"].shape[0], self.model.tgt_vocab_size)
        y = self.model.embed_step(state, prev_tokens)
        s = state["s"][:, 0] if self.layered else state["s"]
        keys = state["keys"].unsqueeze(2) if self.single_head else state["keys"]
        log_probs, s, alpha = ops.rnmt_step(y, s, keys, state["annotations"], state["src_mask"], self.query_cell,
                                            self.decoder_cell, self.attention, self.readout)
        updates = {"s": s.unsqueeze(1) if self.layered else s}
        if "pos" in state:
            updates["pos"] = state["pos"] + 1
        return log_probs, step_state(state, alpha, True, **updates)

    @torch.no_grad()   # inference only (the ops write into buffers: no autograd)
    def _search(self, state: State, beam: int, alpha: float, max_len: Tensor, early_stop: bool = False,
                nbest: Optional[int] = None, penalty: str = "gnmt") -> List[List[Tuple[List[int], float, float]]]:
        """beam_search's loop (dtmt_models.decoding.beam_search, its reference) in one C++ call,
        ops.rnmt_beam_search, from the state `encode` made: for each sentence its finished hypotheses,
        best first, as (tokens, score, log_prob): up to `beam` of them, of which the first `nbest` are what a search
        run to max length would give (beam_search's rule; nbest None: beam). `early_stop`, `penalty`: beam_search's."""
        self.check_unconverted()   # (a state kept while the model's weights changed: the search read them mixed)
        if "drop_q" in state or "drop_d" in state:
            raise ValueError("FusedRNMTDecoder.search: the state has candidate-dropout masks (a model in training "
                             "mode); decode in eval mode")
        if not isinstance(max_len, torch.Tensor) or max_len.dim() != 1 or max_len.is_floating_point():
            got = (f"{max_len.dtype} {list(max_len.shape)}" if isinstance(max_len, torch.Tensor)
                   else type(max_len).__name__)
            raise ValueError(f"FusedRNMTDecoder.search: max_len is an integer tensor [B] (each sentence's bound), got "
                             f"{got}")
        B = state["s"].shape[0]
        if max_len.shape[0] != B:   # (an empty one beside sentences had been torch's "max(): Expected reduction dim")
            raise ValueError(f"FusedRNMTDecoder.search: max_len holds {max_len.shape[0]} bounds for a state of {B} "
                             f"sentences")
        if B == 0:   # (a state of no sentences: no search)
            return []
        emb = self.model.tgt_embed
        steps = int(max_len.max())
        if not 1 <= steps <= ops.MAX_SEARCH_STEPS:   # (before the position table of that many rows: 10^9 of them
            # filled the memory, where the op refuses them)
            raise ValueError(f"FusedRNMTDecoder.search: max_len must be in [1, {ops.MAX_SEARCH_STEPS:,}], got {steps}")
        positions = emb.scaled_positions(steps, emb.weight) if emb.positional and "pos" in state else None
        position_table = None if positions is None or self.token_table is None else self.position_table(steps)
        s = state["s"][:, 0] if self.layered else state["s"]
        keys = state["keys"].unsqueeze(2) if self.single_head else state["keys"]
        counts, lengths, tokens, scores, log_probs = ops.rnmt_beam_search(
            state["annotations"], keys, state["src_mask"], s, emb.weight, positions, self.query_cell,
            self.decoder_cell, self.attention, self.readout, beam, alpha, max_len, BOS, EOS, self.options.step_tables,
            early_stop, self.token_table, position_table, self.context_table, nbest,
            never_output(self.pad_id), penalty)
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
        if table is not None and not torch.compiler.is_compiling():   # (else the shorter one is kept for the
            self._position_table = table                                # sentences it serves; no fake one kept)
        return table

    def _placed(self, table: Optional[Tensor]) -> Optional[Tensor]:
        """A token or position table as the step reads it: with `huge_pages`, copied into 2 MiB pages (a step
        reads the rows of its beam's previous tokens, ~6 KB each, anywhere in a table of tens of MB: in 4 KiB
        pages each costs page walks; docs/design/cpu_kernels.md, "Weights on 2 MiB pages")."""
        if table is None or not self.options.huge_pages:
            return table
        return dk.ops.linear.huge_page_copies([table])[0]


def _layers_copy(model, form):
    """A shallow copy of `model` with every FrozenTransitionLayer replaced by `form(layer)` (the model where none)."""
    return inference_copy(model, lambda m: form(m) if isinstance(m, FrozenTransitionLayer) else m)
