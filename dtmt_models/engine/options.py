"""The fused decoder's switches in one place (dtmt_models.engine.rnmt.FusedRNMTDecoder). Each is on by default and
gives the same translations, to the bit or up to rounding as said; off only in tests (each against its plain
counterpart) and benchmarks (`benchmarks/bench_pages.py --option NAME` times one on against off, alternated in one
process). What each buys, measured: docs/design/decoding.md, "Engine options"; a switch whose gain measures under 3%
goes, with its code."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineOptions:
    """fold: the attention's output projection (multi-head attention) folded into the decoder cell's input matrix and
    the readout's context matrix (ops.fold_context_projection; before int8 rounding), so that a step reads
    two matrices instead of three; up to rounding.

    huge_pages: the step's weights copied, last, into one buffer of 2 MiB pages (ops.
    step_weights_on_huge_pages), the encoder's sequence layers' parameters likewise (forms.FrozenTransitionLayer.
    on_huge_pages, in a shallow copy of the model that `encode` runs), and the previous token's tables each in its
    own such buffer: the same values, fewer TLB misses.

    step_tables: the search's steps read what is made once instead of recomputing it (ops.
    rnmt_beam_search): per sentence, the context's products with the decoder cell's and readout's matrices where that
    pays (short sources, float weights, after `fold`) and the keys' exponentials for the attention scores; per
    decoder, tables of the previous token's products with the query cell's input matrix and the readout's y matrix
    (ops.token_products: float weights, up to its size bound), for every target token and, for a system
    with positions, each position, and the two matrices that read the context split by head; up to rounding.

    encoder_panels: the encoder's sequence layers also hold their recurrent matrices in the row-panel layout
    (forms.FrozenTransitionLayer.with_row_panels; float weights), from which a batch of one sentence is encoded; up
    to rounding.

    source_tables: where the system encodes a source as its TokenEmbedding read by one FrozenTransitionLayer
    (AttentionalRNMT's encode_source), the embedding's products with the layer's input matrices as tables, one row
    a source token (and one a position), from which `encode` reads each position's input products (forms.
    FrozenTransitionLayer.encode_tokens: no embedding lookup and no input GEMM a call; float weights, up to the
    layer's INPUT_TABLE_BYTES; not with int8, whose encoder quantizes its states); up to rounding."""

    fold: bool = True
    huge_pages: bool = True
    step_tables: bool = True
    encoder_panels: bool = True
    source_tables: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):   # (fold="no" folded: any truthy value switched it on)
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise TypeError(f"EngineOptions.{f.name} must be True or False, got {value!r}")
