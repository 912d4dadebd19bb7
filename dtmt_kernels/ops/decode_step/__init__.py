"""The inference ops of a decoder step (op.py): attention_step, readout_features, rnmt_step, memory_encoder and the
named weight structures they take (mirrors of csrc/decode_step.h's structs)."""
from .op import (AttentionWeights, CellWeights, MemoryWeights, ReadoutWeights, attention_step, memory_encoder, readout_features,
                 rnmt_step)

__all__ = ["AttentionWeights", "CellWeights", "MemoryWeights", "ReadoutWeights", "attention_step", "memory_encoder",
           "readout_features", "rnmt_step"]
