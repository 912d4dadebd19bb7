"""What a search returns and how it is ranked: shared by the Python loop (beam_search) and the device loop
(device_search). A Hypothesis is ranked by log P(y|x) / lp(y), the GNMT length penalty of paper 000's decoding."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Union

from torch import Tensor

from dtmt_models.engine.ops import MAX_SEARCH_STEPS  # noqa: F401 (the fused search's bound, every search's)


@dataclass
class Hypothesis:
    tokens: List[int]      # without BOS / EOS
    score: float           # length-normalised
    log_prob: float


NEG_INF = float("-inf")
INF = float("inf")
MAX_BEAM = 1024   # the widest beam (csrc/op_checks.h's kMaxBeam: memory grows with it, quality does not)
# the largest |alpha| of the GNMT length penalty ((5 + n) / 6) ^ alpha: at MAX_SEARCH_STEPS words 2731.5 ^ 50 is
# 1e172, so a score (log-probability / penalty) stays finite and non-zero in float64. Past about 90 the penalty
# overflowed: the fused search scored every hypothesis -0.0 and ranked them by nothing, the Python loop raised
# OverflowError. Toolkits' values are 0 to 2. (csrc/op_checks.h's kMaxAlpha states the same one.)
MAX_ALPHA = 50.0
# the words that start the error (csrc/op_checks.h's kNonFiniteScore, which the fused search raises)
NON_FINITE_SCORE = "the model gave a non-finite score"


class NonFiniteScores(ArithmeticError):
    """The model scored a candidate NaN or +inf while decoding: its weights or activations overflow. `step` and
    `sentence` (the sentence's place in the batch) say where; `translate` names the input sentence instead, and
    the ensemble's `member` (from 1) that scores it so alone, where one does."""

    def __init__(self, score: float, step: int, sentence: int, where: str = "", member: Optional[int] = None):
        self.score, self.step, self.sentence, self.member = score, step, sentence, member
        whose = "its weights" if member is None else f"member {member} of the ensemble scores it so alone: its weights"
        super().__init__(f"{NON_FINITE_SCORE} ({score}) at step {step} of "
                         f"{where or f'sentence {sentence} of the batch'}: {whose} or activations overflow "
                         f"float32 (a diverged or damaged checkpoint?)")

    @classmethod
    def from_op(cls, exc: ValueError) -> "NonFiniteScores":
        """The fused search's error (csrc/engine/beam_search_cpu.cpp: "... (score) at step t of sentence b ...")."""
        m = re.search(r"\(([^)]*)\) at step (\d+) of sentence (\d+)", str(exc))
        if m is None:
            raise exc
        return cls(float(m.group(1)), int(m.group(2)), int(m.group(3)))


def check_banned(banned: List[int], vocab_size: int) -> None:
    """The words a search never chooses (PAD, BOS) must be words of the model's vocabulary (ValueError)."""
    if not all(0 <= w < vocab_size for w in banned):
        raise ValueError(f"beam_search: the model's pad_id {banned} is not one of its {vocab_size} words")


# the length penalties a search ranks by (the C++ search takes the same names: csrc/engine/registration.cpp)
LENGTH_PENALTIES = ("gnmt", "average")


def length_penalty(length: Union[int, Tensor], alpha: float, penalty: str = "gnmt") -> Union[float, Tensor]:
    """lp(y) for a hypothesis of `length` words, EOS included (an int gives a float, a tensor of lengths a float
    tensor): "gnmt" ((5 + |y|) / 6) ** alpha, paper 000's decoding (l.203, alpha 0.6); "average" |y|, the
    log-probability per word of papers 001 (l.177), 003 (l.237) and 004 (l.152), "normalized by sentence length"
    (alpha unused)."""
    if penalty == "average":
        return length / 1.0
    if penalty != "gnmt":
        raise ValueError(f"penalty must be one of {', '.join(LENGTH_PENALTIES)}, got {penalty!r}")
    return ((5.0 + length) / 6.0) ** alpha


def bound_penalty(max_len: int, alpha: float, penalty: str = "gnmt") -> float:
    """The divisor that bounds what an open hypothesis can still score, from the best open log-probability: lp at
    the max length where lp grows with the length (log-probabilities only decrease), else 1 (an upper bound)."""
    return max(length_penalty(max_len, alpha, penalty), 1.0)
