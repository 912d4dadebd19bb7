"""The inference ops of a decoder step (op.py): attention_step, readout_features, rnmt_step,
rnmt_beam_search, memory_encoder, the named weight structures they take (mirrors of csrc/decode_step.h's structs) and
fold_context_projection (rnmt_step's weights with the attention's output projection folded in),
step_weights_on_huge_pages (the same weights copied into 2 MiB pages), token_products (rnmt_beam_search's
tables of the previous token's products) and context_heads (its per-head matrices of the context)."""
from .op import (AttentionWeights, CellWeights, MemoryWeights, ReadoutWeights, attention_step, context_heads,
                 fold_context_projection, memory_encoder, readout_features, rnmt_beam_search,
                 rnmt_step, step_weights_on_huge_pages, token_products)

__all__ = ["AttentionWeights", "CellWeights", "MemoryWeights", "ReadoutWeights", "attention_step", "context_heads",
           "fold_context_projection", "memory_encoder", "readout_features", "rnmt_beam_search",
           "rnmt_step", "step_weights_on_huge_pages", "token_products"]
