"""The pure-PyTorch references, the executable spec every fused backend is tested against, gathered in one
namespace (dk.reference). Each lives in its op's folder:

    ops/transition/reference.py   the cells and the deep transition block / ATR over a sequence (contract §2), the
                                  parameter layout (TransitionWeights)
    ops/attention/reference.py    additive-attention scores and context of a decoder step (contract §4)
    ops/loss/reference.py         the label-smoothed cross-entropy of a training update
"""
from .ops.attention.reference import additive_scores, attention_context
from .ops.loss.reference import smoothed_cross_entropy
from .ops.transition.reference import (BASE_CELLS, TransitionWeights, atr_cell, gate, gru_cell, lau_cell, lgru_cell,
                                       tgru_cell, transition_sequence, transition_step)

__all__ = ["BASE_CELLS", "TransitionWeights", "additive_scores", "atr_cell", "attention_context", "gate", "gru_cell",
           "lau_cell", "lgru_cell", "smoothed_cross_entropy", "tgru_cell", "transition_sequence",
           "transition_step"]
