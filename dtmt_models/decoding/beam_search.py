"""Batched beam search over the Seq2Seq interface (encode / step / reorder); beam 1 is greedy decoding.

A step ranks the 2 x beam best continuations of a sentence's open hypotheses (log P summed): the first `beam` that
are not EOS stay open; an EOS among the `beam` best finishes its hypothesis (fairseq's rule, as OpenNMT-py's,
Marian's and CTranslate2's: an EOS ranked below them is no hypothesis of the beam). Beam 1 ends a sentence at its
first finished hypothesis (`early_stop`): the argmax word at every step until EOS, as every peer's beam 1.
Hypotheses are ranked by log P(y|x) / lp(y) with the GNMT length penalty of paper 000's decoding,
lp(y) = ((5 + |y|) / 6) ** alpha (alpha = 0 ranks by raw log-probability), or with penalty "average" by the
log-probability per word, lp(y) = |y| (papers 001, 003 and 004: hypotheses.length_penalty). A sentence is finished
when no open hypothesis can still enter the `nbest` best complete ones (it has `nbest` and no open one can beat the nbest-th:
log-probabilities only decrease and the length penalty is at most that of the max length, so what is returned is
what running on would return), with `early_stop` as soon as it has `beam` complete hypotheses (the rule of
fairseq, CTranslate2 and Hugging Face's `early_stopping=True`), or at max length (source length * max_len_a +
max_len_b steps, EOS included, at least 2), where only EOS may follow the open hypotheses.

The decoder's state is reordered after every step: `reorder(state, index)` (rows taken by `index`, which drops
the rows of finished sentences). A decoder may also have `reorder_within(state, index)`, called instead when no
sentence finished, so that `index` keeps every row among its own sentence's rows: what is the same for all
rows of a sentence (the annotations, attention keys, source mask) may then be kept as it is.

A decoder whose `search` is not None (FusedRNMTDecoder: the attentional RNMT systems) runs this whole loop as one
C++ call, `search(state, beam, alpha, max_len, early_stop, nbest, penalty)`, after `encode`, without Python between
steps: the same decisions in the same arithmetic (the loop here is its reference in tests/test_beam_search.py) with
EngineOptions(step_tables=False); by default its steps read tables made once (per model, per sentence) instead of
recomputing their products, the same search up to the rounding of those sums.
`fused=False` keeps the loop here. Without a fused search, off the CPU (a GPU), the loop is device_search's: the
same decisions with the bookkeeping on the device, read every few steps instead of three times a step.

A model that scores a candidate NaN or +inf (weights that are finite but overflow float32 in its sums) stops the
search with NonFiniteScores naming the step and sentence, in the loop here and in the fused search alike: ranked
on, NaN scores gave empty or arbitrary translations without a word (issue 71 item 3).

A model in training mode is decoded in eval mode (no dropout) as an eval copy sharing its parameters: its own
modules keep their modes, also for another thread training it meanwhile (`evaluating`). PAD (the model's
`pad_id`) and BOS are never chosen (fairseq masks PAD too): their log-probabilities are -inf before the candidates
are ranked.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from dtmt_models.data.vocabulary import BOS, EOS, never_output
from dtmt_models.decoding.device_search import device_loop
from dtmt_models.decoding.hypotheses import (INF, MAX_ALPHA, MAX_BEAM, MAX_SEARCH_STEPS, NEG_INF,  # noqa: F401
                                             NON_FINITE_SCORE, Hypothesis, NonFiniteScores, check_banned,
                                             LENGTH_PENALTIES, bound_penalty, length_penalty)
from dtmt_models.engine.decoder import as_decoder
from dtmt_models.models.modes import evaluating




def check_search_arguments(beam, nbest, alpha, max_len_a, max_len_b, penalty="gnmt",
                           early_stop=False) -> Tuple[int, int]:
    """beam_search's numbers and switches (ValueError naming the argument; TypeError for an early_stop not a bool);
    returns (beam, nbest) as ints."""
    try:
        if isinstance(beam, bool) or isinstance(nbest, bool):   # (True was taken as beam 1)
            raise TypeError
        beam, nbest = operator.index(beam), operator.index(nbest)
    except TypeError:
        raise ValueError(f"beam and nbest must be integers, got beam={beam!r}, nbest={nbest!r}") from None
    if not 1 <= beam <= MAX_BEAM or not 1 <= nbest <= beam:
        raise ValueError(f"need 1 <= beam <= {MAX_BEAM} and 1 <= nbest <= beam, got beam={beam}, nbest={nbest}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite number, got {alpha!r}")
    if abs(alpha) > MAX_ALPHA:   # (the length penalty overflows float64 at long searches)
        raise ValueError(f"alpha must be within [-{MAX_ALPHA:g}, {MAX_ALPHA:g}] (larger powers overflow float64 at "
                         f"long searches), got {alpha!r}")
    if penalty not in LENGTH_PENALTIES:
        raise ValueError(f"penalty must be one of {', '.join(LENGTH_PENALTIES)}, got {penalty!r}")
    # (NaN fails the range; a bool, taken as 1, is no bound)
    if isinstance(max_len_a, bool) or not isinstance(max_len_a, numbers.Real) or not 0 <= max_len_a < math.inf:
        raise ValueError(f"max_len_a must be a finite number >= 0, got {max_len_a!r}")
    if isinstance(max_len_b, bool) or not isinstance(max_len_b, numbers.Integral) or max_len_b < 0:
        raise ValueError(f"max_len_b must be an integer >= 0, got {max_len_b!r}")
    if max_len_b >= 2 ** 63:   # (past int64 the tensor arithmetic overflowed; the search's bound is far below)
        raise ValueError(f"max_len_b must be below 2^63 (a search takes at most {MAX_SEARCH_STEPS:,} steps), got "
                         f"{max_len_b}")
    if not isinstance(early_stop, bool):   # (a string was truthy in the loop, and the fused op's schema refused it)
        raise TypeError(f"early_stop must be True or False, got {early_stop!r}")
    if max_len_a == 0 and max_len_b <= 1:   # (the API gave every sentence "" before the bound's least of 2)
        raise ValueError(f"max_len_a = 0, max_len_b = {max_len_b}: a bound below its least, 2 (a word and the "
                         f"end-of-sentence token, which the bound counts); give max_len_b >= 2")
    return beam, nbest


@torch.no_grad()
def beam_search(model, src: Tensor, src_lengths: Tensor, beam: int = 4, alpha: float = 0.6, nbest: int = 1,
                max_len_a: float = 2.0, max_len_b: int = 10, fused: bool = True, early_stop: bool = False,
                on_device: Optional[bool] = None, penalty: str = "gnmt") -> List[List[Hypothesis]]:
    """Translates a batch; returns for each sentence its `nbest` best hypotheses, best first. `model`: a Seq2Seq
    (decoded through its `inference_decoder()`, built here, or already built by the caller) or any object with
    encode / step / reorder. A sentence takes at most max_len_a x its source length + max_len_b steps, EOS
    included, at least 2 (a word and EOS), and never more than MAX_SEARCH_STEPS (16,384; fewer where the model's
    target positions end).
    `fused`: the decoder's one-call `search` where it has one (False: this loop).
    `early_stop`: end a sentence once it has `beam` finished hypotheses, without the check that no open one can still
    win (usually fewer steps; the default keeps the check; beam 1 always stops so: greedy decoding). Without it the
    `nbest` returned are exactly those a search run to max length would return (the check is on the nbest-th: a smaller
    nbest may end sooner, even before `beam` are finished). `on_device`: without a fused search, the loop whose
    bookkeeping stays on the device (device_search: the same decisions, a read every few steps) instead of the one here;
    None takes it where `src` is not on the CPU. `penalty`: the length penalty, "gnmt" (with `alpha`) or "average" (the
    module docstring). A model in training mode decodes in eval mode (see the module docstring). An empty batch (B = 0)
    translates to []."""
    beam, nbest = check_search_arguments(beam, nbest, alpha, max_len_a, max_len_b, penalty, early_stop)
    if not isinstance(fused, bool) or not (on_device is None or isinstance(on_device, bool)):   # (a string was truthy)
        raise TypeError(f"fused must be True or False and on_device True, False or None, got fused={fused!r}, "
                        f"on_device={on_device!r}")
    if not isinstance(src, Tensor):   # (its .device was read first: "'list' object has no attribute 'device'")
        raise ValueError(f"beam_search: src must be a LongTensor [B, S], got {type(src).__name__}")
    if src.is_meta:
        raise ValueError("beam_search: src is on the meta device, which holds no tokens to translate")
    if src.dim() == 2 and src.shape[0] == 0 and isinstance(src_lengths, Tensor) and tuple(src_lengths.shape) == (0,):
        return []   # (an empty batch: nothing to translate, as translate() of no sentences)
    if on_device is None:
        on_device = src.device.type != "cpu"
    with evaluating(model) as model:
        return _beam_search(model, src, src_lengths, beam, alpha, nbest, max_len_a, max_len_b, fused, early_stop,
                            on_device, penalty)


def _beam_search(model, src: Tensor, src_lengths: Tensor, beam: int, alpha: float, nbest: int, max_len_a: float,
                 max_len_b: int, fused: bool, early_stop: bool, on_device: bool,
                 penalty: str) -> List[List[Hypothesis]]:
    model = as_decoder(model)
    early_stop = early_stop or beam == 1   # greedy decoding (the module docstring)
    B, device = src.shape[0], src.device
    state = model.encode(src, src_lengths)
    # (in float64, bounded before the cast: max_len_b = 2^63 - 1 overflowed float32's cast to 1, so every translation
    # came out empty without a word; bounded by MAX_SEARCH_STEPS on every path, the fused searches' bound). At least
    # 2 steps, a word and EOS: a bound of 1 is EOS alone, so max_len_a = 1.2, max_len_b = 0 (a common setting) gave a
    # source of one subword an empty translation without a word.
    max_len = (src_lengths.double() * max_len_a + max_len_b).clamp(2, MAX_SEARCH_STEPS).long()
    most = model.max_target_steps   # a model whose target positions end (the transformer's)
    if most is not None:
        max_len = max_len.clamp_max(most)
    search = model.search if fused else None
    if search is not None:
        try:
            found = search(state, beam, alpha, max_len, early_stop=early_stop, nbest=nbest, penalty=penalty)
        except ValueError as exc:
            if NON_FINITE_SCORE not in str(exc):
                raise
            raise NonFiniteScores.from_op(exc) from None
        return [[Hypothesis(*h) for h in hyps[:nbest]] for hyps in found]
    banned_ids = never_output(model.pad_id)
    if on_device:
        return device_loop(model, state, max_len, beam, alpha, nbest, early_stop, banned_ids, penalty=penalty)
    state = model.reorder(state, torch.arange(B, device=device).repeat_interleave(beam))
    scores = torch.full((B, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0                                   # all beams start identical: keep one
    # each row's tokens so far (without BOS) as Python lists: a step needs only the last one as a tensor
    rows: List[List[int]] = [[] for _ in range(B * beam)]
    prev = torch.full((B * beam,), BOS, dtype=torch.long, device=device)
    max_len_list = max_len.tolist()
    finished: List[List[Hypothesis]] = [[] for _ in range(B)]
    # the sentences still being decoded, in the order of the state's row groups (beam rows each): a finished
    # sentence's rows leave the state at the next reorder, so the steps after it cost only the open sentences
    active = list(range(B))
    active_max_len = max_len
    reorder_within = model.reorder_within
    banned = torch.tensor(banned_ids, device=device)
    for t in range(int(max_len.max())):
        log_probs, state = model.step(state, prev)
        V = log_probs.shape[-1]
        n = len(active)
        log_probs = log_probs.view(n, beam, V).float()
        if t == 0:
            check_banned(banned_ids, V)
        at_limit = t + 1 >= active_max_len
        if bool(at_limit.any()):   # the last step allowed: only EOS may follow
            eos_only = torch.full_like(log_probs, float("-inf"))
            eos_only[..., EOS] = log_probs[..., EOS]
            log_probs = torch.where(at_limit.view(n, 1, 1), eos_only, log_probs)
        # PAD and BOS never chosen (in place: the sum is a fresh tensor)
        cand = (scores.unsqueeze(-1) + log_probs).index_fill_(-1, banned, float("-inf")).view(n, -1)
        top_scores, top_idx = cand.topk(min(2 * beam, cand.shape[1]), dim=1)
        # the bookkeeping below is per sentence and per candidate, on Python lists (three transfers a step), not
        # on tensor elements
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        select: List[int] = []
        next_words: List[int] = []
        next_scores: List[float] = []
        still: List[int] = []
        for i, b in enumerate(active):
            if not top_scores[i][0] < INF:   # NaN comes first (topk ranks it above every number), as does +inf
                raise NonFiniteScores(top_scores[i][0], t, b)
            new_scores, new_origin, new_word = [NEG_INF] * beam, [0] * beam, [EOS] * beam
            k = 0
            for r, (s, j) in enumerate(zip(top_scores[i], top_idx[i])):
                if s == NEG_INF or k == beam:
                    break
                o, w = divmod(j, V)
                if w != EOS:
                    new_scores[k], new_origin[k], new_word[k] = s, o, w
                    k += 1
                elif r < beam:   # an EOS below the beam best candidates is not a hypothesis of the beam
                    hyp = rows[i * beam + o]
                    finished[b].append(Hypothesis(hyp, s / length_penalty(len(hyp) + 1, alpha, penalty), s))
            finished[b].sort(key=lambda h: -h.score)
            del finished[b][beam:]
            # finished when no open hypothesis can still enter the nbest (bound_penalty), or with early_stop as soon
            # as it is full
            best_open = max(new_scores)
            bound = best_open / bound_penalty(max_len_list[b], alpha, penalty)
            if t + 1 >= max_len_list[b] or best_open == NEG_INF or (
                    len(finished[b]) >= beam if early_stop else
                    len(finished[b]) >= nbest and bound <= finished[b][nbest - 1].score):
                continue
            still.append(i)
            select.extend(i * beam + o for o in new_origin)
            next_words.extend(new_word)
            next_scores.extend(new_scores)
        if not still:
            break
        index, prev = torch.tensor([select, next_words], device=device)
        state = (reorder_within if len(still) == n else model.reorder)(state, index)
        rows = [rows[j] + [w] for j, w in zip(select, next_words)]
        scores = torch.tensor(next_scores, device=device).view(len(still), beam)
        if len(still) < n:
            active_max_len = active_max_len[torch.tensor(still, device=device)]
            active = [active[i] for i in still]
    return [hyps[:nbest] for hyps in finished]


def greedy(model, src: Tensor, src_lengths: Tensor, **kwargs) -> List[List[int]]:
    """Greedy decoding (beam 1: the argmax word at every step until EOS or max length); returns the token lists.
    `kwargs`: beam_search's other settings (max_len_a, max_len_b, fused, on_device, ...); not beam or alpha, which
    greedy decoding fixes (they were beam_search's "multiple values" TypeError)."""
    fixed = sorted({"beam", "alpha"} & set(kwargs))
    if fixed:
        raise TypeError(f"greedy: {' and '.join(fixed)} cannot be given: greedy decoding is beam 1 without a length "
                        f"penalty (call beam_search for others)")
    return [h[0].tokens if h else [] for h in beam_search(model, src, src_lengths, beam=1, alpha=0.0, **kwargs)]
