"""Beam search against exhaustive search on a toy model whose step distribution is a fixed table."""
import itertools
import math
from dataclasses import replace

import pytest
import torch

import dtmt_models as dm
from dtmt_models.decoding.beam_search import beam_search, greedy
from dtmt_models.decoding.hypotheses import length_penalty
from dtmt_models.data.vocabulary import BOS, EOS
from dtmt_models.engine import EngineOptions


class TableModel:
    """p(next | previous token) from a fixed random table (a bigram LM that ignores the source)."""

    def __init__(self, V=7, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(2.5 * torch.randn(V, V, generator=g), -1)
        self.table[:, 0] = -1e9    # never PAD
        self.table[:, BOS] = -1e9  # never BOS

    def encode(self, src, src_lengths):
        return {"dummy": torch.zeros(src.shape[0], 1)}

    def step(self, state, prev):
        return self.table[prev], state

    @staticmethod
    def reorder(state, index):
        return {k: v.index_select(0, index) for k, v in state.items()}

    @classmethod
    def by_hand(cls, V, rows):
        """A table worked by hand: rows {previous token: {next token: probability}}, 1e-12 elsewhere."""
        model = cls(V=V)
        probs = torch.full((V, V), 1e-12)
        for prev, nexts in rows.items():
            probs[prev, list(nexts)] = torch.tensor(list(nexts.values()), dtype=probs.dtype)
        model.table = probs.log()
        return model

    def sequence_logprob(self, seq):
        prev, total = BOS, 0.0
        for w in seq + [EOS]:
            total += self.table[prev, w].item()
            prev = w
        return total


def counted(model):
    """(`model` with its steps counted, the list that grows by one a step)."""
    steps = []
    decoder = type("Counting", (), dict(encode=model.encode, reorder=staticmethod(model.reorder),
                                        step=lambda self, state, prev: steps.append(1) or model.step(state, prev)))()
    return decoder, steps


def exhaustive_best(model, max_tokens, alpha, penalty="gnmt"):
    best = None
    words = [w for w in range(model.table.shape[0]) if w not in (0, BOS, EOS)]
    for n in range(max_tokens + 1):
        for seq in itertools.product(words, repeat=n):
            lp = model.sequence_logprob(list(seq))
            if penalty == "gnmt":
                s = lp / ((5 + n + 1) / 6) ** alpha   # GNMT's lp(Y) = (5 + |Y|)^α / 6^α, |Y| counting EOS
            else:
                s = lp / (n + 1)                       # the log-probability per word, EOS counted
            if best is None or s > best[0]:
                best = (s, list(seq))
    return best


@pytest.mark.parametrize("penalty", ["gnmt", "average"])
@pytest.mark.parametrize("seed", range(4))
def test_wide_beam_finds_the_exhaustive_best(seed, penalty):
    """A beam as wide as the table's choices finds the best sequence of every length by either penalty (paper 000's
    GNMT penalty at alpha 0.6; papers 001, 003 and 004's log-probability per word), stopping by the bound that no
    open hypothesis can still win."""
    model = TableModel(seed=seed)
    src, lengths = torch.ones(1, 2, dtype=torch.long), torch.tensor([2])
    hyps = beam_search(model, src, lengths, beam=12, alpha=0.6, nbest=3, max_len_a=0, max_len_b=4, penalty=penalty)[0]
    score, seq = exhaustive_best(model, 3, 0.6, penalty)    # max_len 4 steps = up to 3 words + EOS
    with pytest.raises(ValueError, match="penalty must be one of gnmt, average, got 'avg'"):
        length_penalty(3, 0.6, "avg")   # (the device loop's table is made by it: no name taken as GNMT's)
    assert hyps[0].tokens == seq and math.isclose(hyps[0].score, score, rel_tol=1e-5)
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    for h in hyps:
        assert math.isclose(h.log_prob, model.sequence_logprob(h.tokens), rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("on_device", [False, True])
def test_greedy_is_argmax_chain(on_device):
    """Beam 1 is greedy decoding, by every length penalty and stopping rule: the argmax word at each step until EOS
    (every peer's beam 1). It was not: an EOS ranked second was finished as well, so the search could end on an
    earlier, shorter hypothesis, or go past the argmax EOS to a longer one."""
    src, lengths = torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 1])
    differs = 0
    for seed in range(40):
        model = TableModel(V=6, seed=seed)
        prev, expect = BOS, []
        for _ in range(5):
            w = int(model.table[prev].argmax())
            if w == EOS:
                break
            expect.append(w)
            prev = w
        assert greedy(model, src, lengths, max_len_a=0, max_len_b=6, on_device=on_device) == [expect, expect], seed
        for alpha, penalty, early_stop in ((0.6, "gnmt", False), (1.0, "average", False), (0.6, "gnmt", True)):
            hyps = beam_search(model, src, lengths, beam=1, alpha=alpha, penalty=penalty, early_stop=early_stop,
                               max_len_a=0, max_len_b=6, on_device=on_device)
            assert [h[0].tokens for h in hyps] == [expect, expect], (seed, alpha, penalty, early_stop)
        wide = beam_search(model, src, lengths, beam=3, alpha=0.0, max_len_a=0, max_len_b=6, on_device=on_device)
        differs += wide[0][0].tokens != expect
    assert differs > 0   # (tables on which search beyond greedy finds another best: the test can tell them apart)


def test_an_eos_below_the_beam_best_candidates_finishes_nothing():
    """A table worked by hand (beam 2, alpha 0, nbest 2, early_stop). From BOS: a 0.5, b 0.3, EOS 0.2; after a or b:
    EOS 0.6, c 0.4; after c: EOS. Step 0 ranks a, b, EOS: the EOS ranks third, below the beam's two, and finishes
    nothing (it finished [] before, which filled the beam at step 1 with [a] and ended the search there). Step 1
    finishes a EOS (0.3, first) and keeps a c (0.2) and b c (0.12) open, its b EOS (0.18, third) again nothing;
    step 2 finishes a c EOS (0.2): the beam is full."""
    a, b, c = 4, 5, 6
    after = {EOS: 0.6, c: 0.4}
    counting, steps = counted(TableModel.by_hand(7, {BOS: {a: 0.5, b: 0.3, EOS: 0.2}, a: after, b: after,
                                                     c: {EOS: 1.0}}))
    src, lengths = torch.ones(1, 2, dtype=torch.long), torch.tensor([2])
    for on_device in (False, True):
        steps.clear()
        hyps = beam_search(counting, src, lengths, beam=2, alpha=0.0, nbest=2, early_stop=True, max_len_a=0,
                           max_len_b=6, on_device=on_device)[0]
        assert [h.tokens for h in hyps] == [[a], [a, c]], on_device
        assert [round(math.exp(h.log_prob), 6) for h in hyps] == [0.3, 0.2]
        if not on_device:   # (the device loop checks every few steps)
            assert len(steps) == 3


def test_the_largest_max_len_b_bounds_nothing_it_should_not():
    """max_len = source length x max_len_a + max_len_b, reckoned in float64 and bounded before the cast to an
    integer: with max_len_b = 2^63 - 1 the float32 cast overflowed to 1, and every translation came out empty
    without a word. A chain that ends after 3 words is found whole at any bound from 4 up."""
    a, b, c = 4, 5, 6
    model = TableModel.by_hand(7, {BOS: {a: 0.9, EOS: 0.1}, a: {b: 0.9, EOS: 0.1}, b: {c: 0.9, EOS: 0.1},
                                   c: {EOS: 1.0}})
    src, lengths = torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 1])
    for max_len_b in (4, 2 ** 31, 2 ** 63 - 1):
        out = greedy(model, src, lengths, max_len_a=0, max_len_b=max_len_b)
        assert out == [[a, b, c], [a, b, c]], max_len_b


def test_a_sentence_that_never_ends_stops_at_the_search_s_step_bound():
    """A model that never ends a sentence (after `a`, `a` again) with max_len_b = 2^63 - 1 ran for ~2^31 steps
    (hours) on the Python search, where the fused C++ searches refuse more than 16,384: max_len is bounded by
    MAX_SEARCH_STEPS on every path, so the search returns a translation of that many steps (16,383 tokens and the
    EOS the bound puts at the end) in about a second, the loop here and the device loop alike."""
    from dtmt_models.decoding.hypotheses import MAX_SEARCH_STEPS

    a = 4
    model = TableModel.by_hand(7, {BOS: {a: 1.0}, a: {a: 1.0}})
    src, lengths = torch.ones(1, 3, dtype=torch.long), torch.tensor([3])
    assert MAX_SEARCH_STEPS == 16384
    for on_device in (False, True):
        hyp = beam_search(model, src, lengths, beam=1, max_len_a=0, max_len_b=2 ** 63 - 1, on_device=on_device)[0][0]
        assert hyp.tokens == [a] * (MAX_SEARCH_STEPS - 1), (on_device, len(hyp.tokens))


def test_early_stop_must_be_a_bool_on_every_path():
    """early_stop="no" was truthy in the Python loop (an early stop) and a multi-line schema error in the fused
    search; now one TypeError naming it on both (translate's, shared)."""
    model = dm.build_model("dtmt", 20, 20, embed_dim=8, hidden_size=8).eval()
    src, lengths = torch.randint(4, 20, (2, 5), generator=torch.Generator().manual_seed(0)), torch.tensor([5, 3])
    for fused in (True, False):
        with pytest.raises(TypeError, match="^early_stop must be True or False, got 'no'$"):
            beam_search(model, src, lengths, beam=3, early_stop="no", fused=fused)


def test_early_stop_ends_a_sentence_once_the_beam_is_finished():
    """A table worked by hand (beam 2, alpha 0.6, max length 5). From BOS: EOS 0.4, w 0.4, x 0.2; after w: y 0.96,
    EOS 0.04; after x: EOS 0.9, y 0.1; after y: EOS. Step 0 finishes the empty hypothesis (log 0.4 / lp(1) =
    -0.916; the EOS ranks first, topk's order among equals) and keeps w and x open. Step 1 keeps w y (0.384) open
    and finishes x EOS (0.18, second: log 0.18 / lp(2) = -1.563): early_stop ends there, the beam (2) full, with [].
    The default rule goes on, since w y could still win (log 0.384 / lp(5) = -0.704 > -0.916), and at step 2
    finishes w y EOS: log 0.384 / lp(3) = -0.805, the better one."""
    w, x, y = 4, 5, 6
    counting, steps = counted(TableModel.by_hand(7, {BOS: {EOS: 0.4, w: 0.4, x: 0.2}, w: {y: 0.96, EOS: 0.04},
                                                     x: {EOS: 0.9, y: 0.1}, y: {EOS: 1.0}}))
    src, lengths = torch.ones(1, 2, dtype=torch.long), torch.tensor([2])
    kwargs = dict(beam=2, alpha=0.6, max_len_a=0, max_len_b=5)
    early = beam_search(counting, src, lengths, early_stop=True, **kwargs)[0]
    assert len(steps) == 2 and early[0].tokens == [] and math.isclose(early[0].log_prob, math.log(0.4), rel_tol=1e-6)
    steps.clear()
    full = beam_search(counting, src, lengths, **kwargs)[0]
    assert len(steps) == 3 and full[0].tokens == [w, y]
    assert math.isclose(full[0].score, math.log(0.384) / (8 / 6) ** 0.6, rel_tol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_early_stop_takes_no_more_steps_and_never_a_better_beam(seed):
    """Up to the step where early_stop ends a sentence the two rules decide alike; the default then only goes on
    to replace finished hypotheses by better ones. So on any table: no more steps, and each rank's score at most
    the default's."""
    model = TableModel(V=9, seed=seed)
    src, lengths = torch.ones(3, 4, dtype=torch.long), torch.tensor([4, 2, 3])
    for beam in (2, 4):
        kwargs = dict(beam=beam, alpha=0.6, nbest=beam, max_len_a=2.0, max_len_b=3)
        early = beam_search(model, src, lengths, early_stop=True, **kwargs)
        full = beam_search(model, src, lengths, **kwargs)
        for e, f in zip(early, full):
            assert len(e) == len(f) == beam
            assert all(a.score <= b.score + 1e-9 for a, b in zip(e, f)), (seed, beam)


def test_nbest_one_ends_once_nothing_open_can_beat_the_best():
    """A table worked by hand (beam 2, alpha 0: raw log-probabilities, max length 6). From BOS: EOS 0.5, a 0.3,
    b 0.2; after a or b: EOS 0.5, a 0.25, b 0.25. Step 0 finishes the empty hypothesis (log 0.5 = -0.693) and keeps
    a (-1.204) and b (-1.609) open: no open one can beat -0.693 any more, so with nbest 1 the search ends there.
    With nbest 2 it needs a second finished one: step 1 finishes a EOS (log 0.15 = -1.897), and the open a a
    (-2.590) can beat neither, so it ends after two steps, with the same best first."""
    a, b = 4, 5
    after = {EOS: 0.5, a: 0.25, b: 0.25}
    counting, steps = counted(TableModel.by_hand(6, {BOS: {EOS: 0.5, a: 0.3, b: 0.2}, a: after, b: after}))
    src, lengths = torch.ones(1, 2, dtype=torch.long), torch.tensor([2])
    kwargs = dict(beam=2, alpha=0.0, max_len_a=0, max_len_b=6)
    one = beam_search(counting, src, lengths, nbest=1, **kwargs)[0]
    assert len(steps) == 1 and len(one) == 1 and one[0].tokens == []
    assert math.isclose(one[0].score, math.log(0.5), rel_tol=1e-6)
    steps.clear()
    two = beam_search(counting, src, lengths, nbest=2, **kwargs)[0]
    assert len(steps) == 2 and [h.tokens for h in two] == [[], [a]]
    assert math.isclose(two[1].score, math.log(0.15), rel_tol=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_a_smaller_nbest_returns_the_same_best_in_no_more_steps(seed):
    """The search ends once no open hypothesis can enter the nbest best finished ones, so the nbest it returns are
    those of a search that went on (nbest = beam: the most steps), tokens and scores alike; it never takes more
    steps than a larger nbest. (A small vocabulary, so that some seeds' beams finish hypotheses of close scores:
    one that stopped on the best alone where nbest > 1 fails seeds 1, 7, 9 and 11.) The average penalty's bound too
    (the log-probability per word at the max length)."""
    model = TableModel(V=6, seed=seed)
    src, lengths = torch.ones(3, 4, dtype=torch.long), torch.tensor([4, 2, 3])
    for beam, alpha, penalty in ((2, 0.6, "gnmt"), (4, 0.6, "gnmt"), (4, 0.0, "gnmt"), (5, 1.0, "gnmt"),
                                 (4, 0.0, "average")):
        kwargs = dict(beam=beam, alpha=alpha, max_len_a=2.0, max_len_b=3, penalty=penalty)
        runs = []
        for nbest in range(beam, 0, -1):
            counting, steps = counted(model)
            runs.append((nbest, beam_search(counting, src, lengths, nbest=nbest, **kwargs), len(steps)))
        _, widest, _ = runs[0]
        for (nbest, hyps, n_steps), (_, _, before) in zip(runs, runs[:1] + runs):
            assert n_steps <= before, (seed, beam, nbest)
            for got, want in zip(hyps, widest):
                assert [(h.tokens, h.score, h.log_prob) for h in got] == \
                    [(h.tokens, h.score, h.log_prob) for h in want[:nbest]], (seed, beam, alpha, nbest)


def test_beam_search_on_a_real_system_is_batch_independent():
    torch.manual_seed(0)
    model = dm.build_model("dtmt", 20, 20, embed_dim=16, hidden_size=16).eval()
    src = torch.randint(4, 20, (3, 5))
    lengths = torch.tensor([5, 3, 4])
    batched = beam_search(model, src, lengths, beam=3, nbest=2)
    for b in range(3):
        alone = beam_search(model, src[b:b + 1, :int(lengths[b])], lengths[b:b + 1], beam=3, nbest=2)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]
        assert all(math.isclose(a.score, c.score, rel_tol=1e-6) for a, c in zip(alone, batched[b]))


def test_finished_sentences_leave_the_batch():
    """Sentences of one batch stopping at different steps (max length 1..6 from their source lengths): each
    decodes as it does alone, and the rows a step computes shrink as sentences finish."""
    torch.manual_seed(1)
    model = dm.build_model("rnnsearch-atr", 20, 20, embed_dim=16, hidden_size=16).eval()
    decoder = model.inference_decoder()
    rows = []

    class Counting:
        def encode(self, src, lengths):
            return decoder.encode(src, lengths)

        def step(self, state, prev):
            rows.append(prev.shape[0])
            return decoder.step(state, prev)

        def reorder(self, state, index):
            return decoder.reorder(state, index)

    lengths = torch.tensor([6, 1, 4, 2, 5, 3])
    src = torch.randint(4, 20, (6, 6))
    batched = beam_search(Counting(), src, lengths, beam=3, nbest=3, max_len_a=1.0, max_len_b=0)
    assert rows[0] == 6 * 3 and rows[-1] < rows[0] and all(a >= b for a, b in zip(rows, rows[1:]))
    # the sentences of 1 and 2 subwords (2 steps: a bound is at least 2) are gone at step 3
    assert len(rows) == 6 and rows[1] == 6 * 3 and rows[2] <= 4 * 3
    for b in range(6):
        alone = beam_search(decoder, src[b:b + 1, :int(lengths[b])], lengths[b:b + 1], beam=3, nbest=3,
                            max_len_a=1.0, max_len_b=0)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]
        assert all(math.isclose(a.score, c.score, rel_tol=1e-6) for a, c in zip(alone, batched[b]))


def test_reorder_within_sentences_keeps_the_per_sentence_state():
    """A decoder's reorder_within (called when no sentence finished: rows move only among their sentence's
    rows) keeps the annotations, keys and source mask as they are and gives exactly what reorder gives: the same
    hypotheses and scores as a decoder without it, for a batch whose sentences finish at different steps; and
    beam search calls it on the steps where no sentence finished, reorder on the others."""
    torch.manual_seed(2)
    model = dm.build_model("dtmt", 20, 20, embed_dim=16, hidden_size=16, depth=1, heads=2).eval()
    decoder = model.inference_decoder()
    calls = []

    class Plain:            # no reorder_within: beam search reorders everything every step
        def encode(self, src, lengths):
            return decoder.encode(src, lengths)

        def step(self, state, prev):
            return decoder.step(state, prev)

        def reorder(self, state, index):
            calls.append("reorder")
            return decoder.reorder(state, index)

    class Within(Plain):
        def reorder_within(self, state, index):
            calls.append("within")
            out = decoder.reorder_within(state, index)
            assert all(out[k] is state[k] for k in ("annotations", "keys", "src_mask"))
            torch.testing.assert_close(out, decoder.reorder(state, index), rtol=0, atol=0)
            return out

    lengths = torch.tensor([6, 1, 4, 2, 5, 3])
    src = torch.randint(4, 20, (6, 6))
    kwargs = dict(beam=3, nbest=3, max_len_a=1.0, max_len_b=2)
    plain = beam_search(Plain(), src, lengths, **kwargs)
    calls.clear()
    within = beam_search(Within(), src, lengths, **kwargs)
    assert [[(h.tokens, h.score) for h in s] for s in within] == [[(h.tokens, h.score) for h in s] for s in plain]
    assert calls[0] == "reorder" and "within" in calls and "reorder" in calls[1:]   # start, then both kinds


def _hyps(result):
    return [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in result]


def _assert_same_hypotheses(result, expected, rtol):
    """The same hypotheses (tokens) in the same order, their scores and log-probabilities equal to `rtol`."""
    assert [[h.tokens for h in s] for s in result] == [[h.tokens for h in s] for s in expected]
    for got, want in zip(result, expected):
        for a, b in zip(got, want):
            assert a.score == pytest.approx(b.score, rel=rtol) and a.log_prob == pytest.approx(b.log_prob, rel=rtol)


def _plain(decoder):
    """`decoder` (a FusedRNMTDecoder) with its steps reading no tables (step_tables=False): the search whose
    arithmetic is rnmt_step's, the Python loop's to the bit."""
    return decoder.variant(options=replace(decoder.options, step_tables=False))


@pytest.mark.parametrize("system, options", [
    ("dtmt", dict(depth=1, heads=2)),                       # positional target embedding, multi-head attention
    ("dtmt", dict(depth=2, heads=1, positional_encoding=False)),
    ("rnnsearch-atr", {}),
    ("shallow-rnmt", {}),
    ("nematus", {}),                                        # one-level cGRU (shallow): the layered state [B, 1, H]
    ("mce", {}),
])
def test_fused_search_equals_the_python_loop(system, options):
    """The decoder's one-call search (FusedRNMTDecoder.search, C++; step_tables=False, rnmt_step's arithmetic)
    against the loop of beam_search over the same decoder's steps (fused=False, the reference): the same hypotheses
    in the same order, the same scores and log-probabilities to the bit, for batches whose sentences finish at
    different steps, beams 1-5, with and without the GNMT length penalty and by the average (the log-probability per
    word), nbest up to the beam, either stopping rule; in
    float32 and float64, and with int8 weights; on one thread and on two, each against the loop on as many.
    Past 8 rows (7 sentences, beams 2-5) the steps' products are ATen's GEMM, whose operands lie elsewhere in the
    two (the search's state in its own buffers): the two are the same to the bit where that GEMM gives the same
    bits wherever its operands lie and on any thread count (conftest.aten_gemm_reproducible), else the same
    hypotheses with scores equal to rounding (1e-12 in float64, 2e-6 in float32). At beam 1 (7 rows) in float32
    (int8 too) the products are dtmt's own small-row kernel's and the two agree to the bit on any CPU. (The default decoder's tables:
    test_search_through_step_tables.)"""
    from conftest import aten_gemm_reproducible, at_thread_counts

    torch.manual_seed(3)
    model = dm.build_model(system, 24, 24, embed_dim=16, hidden_size=16, **options).eval()
    cases = [(1, 0.0, 1, 2.0, 10, False, "gnmt"), (3, 0.6, 3, 1.0, 2, False, "gnmt"),
             (4, 0.6, 2, 2.0, 10, False, "gnmt"), (5, 1.0, 5, 0.5, 3, False, "gnmt"),
             (3, 0.0, 1, 2.0, 10, False, "gnmt"), (4, 0.6, 2, 2.0, 10, True, "gnmt"),
             (2, 1.0, 2, 2.0, 10, True, "gnmt"), (4, 0.6, 2, 2.0, 10, False, "average"),
             (3, 0.0, 3, 1.0, 2, True, "average")]
    lengths = torch.tensor([6, 1, 4, 2, 5, 3, 6])
    src = torch.randint(4, 24, (7, 6))
    for dtype, int8 in ((torch.float32, False), (torch.float64, False), (torch.float32, True)):
        decoder = _plain(model.to(dtype).inference_decoder(int8=int8))
        assert decoder.search is not None, f"{system}: no fused search"
        for beam, alpha, nbest, a, b, early_stop, penalty in cases:
            kwargs = dict(beam=beam, alpha=alpha, nbest=nbest, max_len_a=a, max_len_b=b, early_stop=early_stop,
                          penalty=penalty)
            # the C++ search and the loop on 1 and 2 threads (the search's steps split the batch's rows)
            (one, loop_one), (two, loop_two) = at_thread_counts(
                lambda: (beam_search(decoder, src, lengths, **kwargs),
                         beam_search(decoder, src, lengths, fused=False, **kwargs)), 1, 2)
            for threads, (search, loop) in ((1, (one, loop_one)), (2, (two, loop_two))):
                own = dtype == torch.float32 and beam * len(lengths) <= 8   # (float32, ≤ 8 rows: dtmt's own kernel)
                if aten_gemm_reproducible(threads) or own:
                    assert _hyps(search) == _hyps(loop), (threads, dtype, int8, kwargs)
                else:
                    _assert_same_hypotheses(search, loop, 1e-12 if dtype == torch.float64 else 2e-6)
            assert all(len(s) == min(nbest, beam) for s in one)
        model.float()


def test_beam_search_takes_the_fused_search_by_default(monkeypatch):
    """A Seq2Seq with the fused step decodes through `search`: its step is never called from Python."""
    torch.manual_seed(4)
    model = dm.build_model("rnnsearch-atr", 20, 20, embed_dim=16, hidden_size=16).eval()
    decoder = model.inference_decoder()
    monkeypatch.setattr(decoder, "step", lambda *a: pytest.fail("the Python loop ran"))
    src, lengths = torch.randint(4, 20, (2, 4)), torch.tensor([4, 2])
    assert all(len(h) == 2 for h in beam_search(decoder, src, lengths, beam=3, nbest=2))


def test_fused_search_stops_on_its_nbest():
    """The op's own nbest: with nbest 1 some sentences end before `beam` hypotheses are finished (fewer returned)
    and each sentence's best is the one of the search with nbest = beam; an nbest of 0 or beyond the beam is
    refused in one line naming both (beam_search checks it before). (A seed whose untrained model puts enough
    weight on EOS for sentences to end early: 12 of the 16 with a single hypothesis.)"""
    torch.manual_seed(0)
    model = dm.build_model("rnnsearch-atr", 20, 20, embed_dim=16, hidden_size=16).eval()
    decoder = model.inference_decoder()
    src, lengths = torch.randint(4, 20, (16, 6)), torch.randint(1, 7, (16,))
    max_len = lengths * 2 + 3
    with torch.no_grad():
        state = decoder.encode(src, lengths)
        one = decoder.search(state, 4, 0.6, max_len, nbest=1)
        four = decoder.search(state, 4, 0.6, max_len)   # None: the beam
    assert len(one) == len(four) == 16
    assert all(1 <= len(a) <= len(b) == 4 for a, b in zip(one, four))
    assert any(len(a) < len(b) for a, b in zip(one, four))
    # the same best, its scores within rounding (the rows decoded a step differ once sentences end at other steps)
    assert [a[0][0] for a in one] == [b[0][0] for b in four]
    for a, b in zip(one, four):
        assert a[0][1:] == pytest.approx(b[0][1:], rel=1e-6, abs=1e-6)
    for bad in (0, 5):
        with torch.no_grad(), pytest.raises(RuntimeError, match=rf"need 1 <= nbest <= beam, got nbest={bad}, beam=4"):
            decoder.search(state, 4, 0.6, max_len, nbest=bad)


def test_no_fused_search_where_the_embedding_step_is_another():
    """A system whose embed_step is its own keeps the fused step but not the fused search (the op embeds the
    previous token as TokenEmbedding does), and beam search then runs the Python loop over its steps."""
    from dtmt_models.models.systems.atr import RNNSearchATR

    class Scaled(RNNSearchATR):
        def embed_step(self, state, prev_tokens):
            return 2.0 * super().embed_step(state, prev_tokens)

    torch.manual_seed(5)
    model = Scaled(20, 20, embed_dim=16, hidden_size=16).double().eval()
    plain = RNNSearchATR(20, 20, embed_dim=16, hidden_size=16).double().eval()
    plain.load_state_dict(model.state_dict())
    decoder = model.inference_decoder()
    assert decoder.search is None and decoder.step is not None
    src, lengths = torch.randint(4, 20, (2, 4)), torch.tensor([4, 2])
    hyps = beam_search(decoder, src, lengths, beam=2, nbest=2)
    others = beam_search(plain, src, lengths, beam=2, nbest=2)
    assert [[h.log_prob for h in n] for n in hyps] != [[h.log_prob for h in n] for n in others]

    def scored(m, b, tokens):   # the module's own steps (its embed_step, doubled) over BOS, tokens, EOS
        with torch.no_grad():
            state, total = m.encode(src[b:b + 1], lengths[b:b + 1]), 0.0
            for prev, nxt in zip([BOS] + tokens, tokens + [EOS]):
                lp, state = m.step(state, torch.tensor([prev]))
                total += float(lp[0, nxt])
        return total

    for b, nb in enumerate(hyps):
        assert len(nb) == 2
        for h in nb:
            assert h.log_prob == pytest.approx(scored(model, b, h.tokens), abs=1e-4)   # (the search sums in float32)
            assert h.log_prob != pytest.approx(scored(plain, b, h.tokens), abs=1e-3)


@pytest.mark.parametrize("system", ["rnnsearch-atr", "dtmt"])
def test_fused_search_breaks_ties_as_the_python_loop(system):
    """The one-call search picks each step's best candidates in one pass of its own where they are unambiguous and
    asks at::topk otherwise; with words whose log-probabilities are always equal (copies of one output row and
    embedding) ties reach the top candidates at every step, and the hypotheses must still be the loop's (torch.topk),
    in the same order."""
    torch.manual_seed(6)
    model = dm.build_model(system, 24, 24, embed_dim=16, hidden_size=16).eval()
    output = model.readout.output.proj
    with torch.no_grad():
        for copy, of in ((7, 9), (11, 9), (12, 13), (20, 21)):
            for weight in {model.tgt_embed.embed.weight, output.weight}:   # (one tensor where they are tied)
                weight[copy] = weight[of]
            output.bias[copy] = output.bias[of] = output.bias[of] + 3.0   # and likely: among the best every step
    lengths = torch.tensor([6, 1, 4, 2, 5])
    src = torch.randint(4, 24, (5, 6))
    tied = 0
    for int8 in (False, True):
        decoder = _plain(model.inference_decoder(int8=int8))
        for beam in (2, 4, 6):
            kwargs = dict(beam=beam, alpha=0.6, nbest=beam, max_len_a=1.5, max_len_b=3)
            fused = beam_search(decoder, src, lengths, **kwargs)
            loop = beam_search(decoder, src, lengths, fused=False, **kwargs)
            assert _hyps(fused) == _hyps(loop), (int8, beam)
            scores = [h.log_prob for s in loop for h in s]
            tied += len(scores) - len(set(scores))
    assert tied > 0, "no tied hypotheses: the test did not test ties"


@pytest.mark.parametrize("system, options", [
    ("dtmt", dict(depth=1, heads=2)),          # multi-head: the output projection folded first; target positions
    ("rnnsearch-atr", {}),                     # single head, no output projection, no target positions
])
def test_search_through_step_tables(system, options):
    """EngineOptions(step_tables=True), the default: the search's steps read tables made once instead of
    recomputing their products (csrc/engine/decode_step.h, StepTables): the previous token's products from per-token (and
    per-position) tables (TokenProducts), the attention scores from the keys' exponentials (key_exps), and where the
    sources are short (sentences x heads x positions <= C / 2) the context through its per-position products
    (SourceProducts); the same sums in another order. Batches of one, two and three sentences (each sentence's rows
    among the others' columns; sentences finishing at different steps), a source past the products' threshold, int8
    weights (no token tables) and, multi-head, the output projection kept (fold=False: no products); float32 and
    float64: the hypotheses of the plain search (step_tables=False) in the same order, scores within rounding, and
    in float64 those of the Python loop; in float32 some log-probabilities differ in their last bits (the tables
    were used; the weights doubled, so that the other rounding reaches the scores rather than rounding away)."""
    torch.manual_seed(11)
    model = dm.build_model(system, 24, 24, embed_dim=16, hidden_size=64, **options).eval()   # C = 128
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    heads = options.get("heads", 1)
    kwargs = dict(beam=4, alpha=0.6, nbest=4, max_len_a=1.5, max_len_b=3)

    def scores(result):
        return torch.tensor([[h.score, h.log_prob] for s in result for h in s], dtype=torch.float64)

    def tokens(result):
        return [[h.tokens for h in s] for s in result]

    def alike(fast, src, lengths, python_loop=False):
        got, ref = beam_search(fast, src, lengths, **kwargs), beam_search(_plain(fast), src, lengths, **kwargs)
        assert tokens(got) == tokens(ref), lengths
        torch.testing.assert_close(scores(got), scores(ref), rtol=1e-5, atol=1e-4)
        if python_loop:
            assert tokens(beam_search(_plain(fast), src, lengths, fused=False, **kwargs)) == tokens(ref)
        return int((scores(got) != scores(ref)).sum())

    long = torch.randint(4, 24, (1, 128 // (2 * heads) + 1))   # past the products' threshold
    for dtype in (torch.float64, torch.float32):
        fast = model.to(dtype).inference_decoder()
        assert fast.token_table is not None
        differ = 0
        for lengths in ([7], [6, 3], [5, 2, 4], [long.shape[1]]):
            lengths = torch.tensor(lengths)
            src = long if len(lengths) == 1 and lengths[0] == long.shape[1] else \
                torch.randint(4, 24, (len(lengths), int(lengths.max())))
            differ += alike(fast, src, lengths, python_loop=dtype == torch.float64)
        if dtype == torch.float32:
            assert differ > 0, "the tables were not used"
    model.float()
    src, lengths = torch.randint(4, 24, (2, 5)), torch.tensor([5, 3])
    int8 = model.inference_decoder(int8=True)
    assert int8.token_table is None   # (int8 weights: no token tables)
    alike(int8, src, lengths)
    if heads > 1:   # the output projection kept (float32 weights, their tables), and int8 likewise
        alike(model.inference_decoder().variant(options=EngineOptions(fold=False)), src, lengths)
        alike(int8.variant(options=EngineOptions(fold=False)), src, lengths)


def test_token_tables_hold_the_products_of_the_embeddings():
    """engine.ops.token_products: the query cell's input matrix and the readout's y matrix times every row of the
    target embedding (and of its scaled positions), side by side, as float64 products rounded once; None for int8
    weights and past its size bound. A search whose tables are shuffled (rows of other tokens) translates otherwise
    than one with the decoder's own: the tables are what the steps read."""
    torch.manual_seed(12)
    model = dm.build_model("dtmt", 24, 24, embed_dim=16, hidden_size=32, depth=1, heads=2).eval()
    decoder = model.inference_decoder()
    w = torch.cat([decoder.query_cell.params[0], decoder.readout.w_y]).double()
    emb = model.tgt_embed
    torch.testing.assert_close(decoder.token_table, (emb.weight.double() @ w.t()).float(), rtol=0, atol=0)
    positions = decoder.position_table(40)
    assert positions.shape[0] >= 40
    torch.testing.assert_close(positions, (emb.scaled_positions(positions.shape[0], emb.weight).double()
                                           @ w.t()).float(), rtol=0, atol=0)
    assert decoder.position_table(10) is positions                 # kept for shorter sentences
    assert model.inference_decoder(int8=True).token_table is None
    from dtmt_models.engine import ops as op
    bound = op.TOKEN_TABLE_BYTES
    try:
        op.TOKEN_TABLE_BYTES = decoder.token_table.numel() * 4 - 1
        assert model.inference_decoder().token_table is None
    finally:
        op.TOKEN_TABLE_BYTES = bound
    src, lengths = torch.randint(4, 24, (3, 6)), torch.tensor([6, 4, 5])
    kwargs = dict(beam=3, alpha=0.6, nbest=3, max_len_a=1.5, max_len_b=3)
    own = _hyps(beam_search(decoder, src, lengths, **kwargs))
    decoder.token_table = decoder.token_table[torch.randperm(24)]
    assert _hyps(beam_search(decoder, src, lengths, **kwargs)) != own


def test_context_table_holds_the_two_context_matrices_by_head():
    """engine.ops.context_heads: [decoder cell's w_ih; readout's w_c] [N, C] split by head, W[:, h] as
    [heads, C / heads, N], made once by the decoder (its context_table; none for int8 weights or an unfolded
    output projection). A search through it finds the hypotheses of one that splits the matrices every sentence
    (context_table None), scores equal up to the GEMM's rounding; a table with its heads swapped translates
    otherwise: the table is what the context's products are made from; one of another shape is refused."""
    torch.manual_seed(14)
    heads = 2
    model = dm.build_model("dtmt", 24, 24, embed_dim=16, hidden_size=64, depth=1, heads=heads).eval()   # C = 128
    decoder = model.inference_decoder()
    w = torch.cat([decoder.decoder_cell.params[0], decoder.readout.w_c])
    table = decoder.context_table
    assert table is not None and table.is_contiguous() and table.shape == (heads, 128 // heads, w.shape[0])
    for h in range(heads):
        assert torch.equal(table[h], w[:, h * 64:(h + 1) * 64].t())
    assert model.inference_decoder(int8=True).context_table is None
    assert decoder.variant(options=EngineOptions(fold=False)).context_table is None
    assert decoder.variant(options=EngineOptions(step_tables=False)).context_table is None
    src, lengths = torch.randint(4, 24, (3, 6)), torch.tensor([6, 4, 5])
    assert 3 * heads * 6 * 2 <= 128   # the context's products pay for this batch
    kwargs = dict(beam=3, alpha=0.6, nbest=3, max_len_a=1.5, max_len_b=3)
    own = beam_search(decoder, src, lengths, **kwargs)
    split = decoder.variant()
    split.context_table = None
    ref = beam_search(split, src, lengths, **kwargs)
    assert [[h.tokens for h in s] for s in own] == [[h.tokens for h in s] for s in ref]
    torch.testing.assert_close(torch.tensor([h.score for s in own for h in s]),
                               torch.tensor([h.score for s in ref for h in s]), rtol=1e-5, atol=1e-5)
    decoder.context_table = table.flip(0).contiguous()
    assert _hyps(beam_search(decoder, src, lengths, **kwargs)) != _hyps(own)
    decoder.context_table = table[..., :-1].contiguous()   # not these weights' table: an error, not ignored
    with pytest.raises(RuntimeError, match="context_heads must be a contiguous"):
        beam_search(decoder, src, lengths, **kwargs)


def test_step_tables_weigh_each_sentence_on_its_own():
    """The weighing of SourceProducts (csrc/isa/attention_loops.cpp, weigh_products) reads each row's own sentence
    and sums a row's columns in one order whatever rows stand beside it: a sentence searched beside one neighbour
    and beside another of the same length (both batches through the products: sentences x heads x positions
    <= C / 2), with the neighbours finishing at other steps, gets the same hypotheses, scores and log-probabilities
    to the bit, at beams 2-4 (a sentence's rows taken 2-4 at a time); and the plain search's hypotheses."""
    torch.manual_seed(5)
    heads = 2
    model = dm.build_model("dtmt", 24, 24, embed_dim=16, hidden_size=64, depth=1, heads=heads).eval()   # C = 128
    fast = model.inference_decoder()
    plain = fast.variant(options=EngineOptions(step_tables=False))
    src = torch.randint(4, 24, (3, 6))
    lengths = torch.tensor([6, 6])
    assert len(lengths) * heads * int(lengths.max()) * 2 <= 128   # both batches through the products
    for beam in (2, 3, 4):
        kwargs = dict(beam=beam, alpha=0.6, nbest=beam, max_len_a=1.5, max_len_b=3)
        first = beam_search(fast, src[[0, 1]], lengths, **kwargs)
        second = beam_search(fast, src[[0, 2]], lengths, **kwargs)
        assert _hyps(first[:1]) == _hyps(second[:1]), beam
        ref = beam_search(plain, src[[0, 1]], lengths, **kwargs)
        assert [[h.tokens for h in s] for s in first] == [[h.tokens for h in s] for s in ref]


def test_the_transformer_s_target_bound_stops_at_its_positions():
    """A target bound past the transformer's positional encodings (max_len) failed at that step, after the work,
    with "sequence longer than max_len"; the search now ends there (as fairseq clamps to the model's positions)."""
    torch.manual_seed(0)
    model = dm.build_model("transformer", 30, 30, embed_dim=16, hidden_size=32, heads=2, encoder_layers=1,
                           decoder_layers=1, max_len=16).eval()
    with torch.no_grad():
        model.tgt_embed.weight[EOS].fill_(-3.0)   # (tied output: EOS unlikely, so that the search runs to the bound)
    src = torch.randint(4, 30, (2, 10), generator=torch.Generator().manual_seed(1))
    from dtmt_models.decoding.ensemble import Ensemble

    for decoded in (model, Ensemble([model, model])):   # (an ensemble stops at its members' last position)
        hyps = beam_search(decoded, src, torch.tensor([10, 10]), beam=2)
        assert max(len(h[0].tokens) for h in hyps) == 15, [len(h[0].tokens) for h in hyps]   # 16 positions: BOS + 15



def test_the_transformer_takes_a_batch_padded_past_its_positions():
    """A batch padded past the transformer's positions (max_len), no sentence that long: the padding is cut, the
    same hypotheses and scores as the batch padded to its longest sentence. It was refused as a "sequence longer
    than max_len=12", which no sentence was; a sentence that long still is."""
    torch.manual_seed(0)
    model = dm.build_model("transformer", 30, 30, embed_dim=16, hidden_size=32, heads=2, encoder_layers=1,
                           decoder_layers=1, max_len=12).eval()
    src = torch.randint(4, 30, (2, 20), generator=torch.Generator().manual_seed(1))
    src[0, 10:], src[1, 5:] = 0, 0
    lengths = torch.tensor([10, 5])
    padded = beam_search(model, src, lengths, beam=2, nbest=2, max_len_b=3)
    tight = beam_search(model, src[:, :10].clone(), lengths, beam=2, nbest=2, max_len_b=3)
    assert [[h.tokens for h in s] for s in padded] == [[h.tokens for h in s] for s in tight]
    assert [h.score for s in padded for h in s] == pytest.approx([h.score for s in tight for h in s])
    with pytest.raises(ValueError, match="transformer: sequence longer than max_len=12"):
        beam_search(model, torch.randint(4, 30, (2, 13)), torch.tensor([13, 5]), beam=2)

@pytest.mark.parametrize("name, pad", [("dtmt", 0), ("dtmt", 1), ("deeplau", 0), ("transformer", 0)])
def test_pad_and_bos_are_never_chosen(name, pad):
    """An output layer that favours PAD (the model's pad_id) and BOS (an untrained model can): the search never
    returns them, in the C++ search and the loop (for dtmt both; deeplau and the transformer have the loop only),
    and both give the same hypotheses (fairseq masks PAD the same way); an ensemble bans its members' PAD."""
    from dtmt_models.decoding.ensemble import Ensemble

    torch.manual_seed(0)
    options = dict(heads=2, encoder_layers=1, decoder_layers=1, hidden_size=32) if name == "transformer" else {}
    model = dm.build_model(name, 30, 30, pad_id=pad, **{"embed_dim": 16, "hidden_size": 16, **options}).eval()
    bias = [p for n, p in model.named_parameters() if n.endswith("bias") and p.shape == (30,)][-1]
    with torch.no_grad():
        bias[pad] += 8.0
        bias[BOS] += 7.0
    src = torch.randint(4, 30, (3, 6), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([6, 4, 5])
    with torch.no_grad():   # what the model would choose without the mask
        log_probs, _ = model.step(model.encode(src, lengths), torch.full((3,), BOS))
    assert set(log_probs.argmax(-1).tolist()) <= {pad, BOS}
    results = [beam_search(model, src, lengths, beam=4, nbest=4, fused=fused) for fused in (True, False)]
    results.append(beam_search(Ensemble([model, model]), src, lengths, beam=4, nbest=4))
    for hyps in results:
        tokens = [t for sentence in hyps for h in sentence for t in h.tokens]
        assert tokens and pad not in tokens and BOS not in tokens
    for other in results[1:]:
        assert [[h.tokens for h in s] for s in results[0]] == [[h.tokens for h in s] for s in other]


@pytest.mark.parametrize("system", ["dtmt", "mce", "gnmt-atr"])
def test_an_empty_batch_translates_to_nothing_and_a_meta_one_is_refused(system):
    """beam_search on B = 0 sentences gave a RuntimeError from inside the fused search's length bound (mce) or a
    ValueError from the encoder (dtmt); on `src` of the meta device (no values), torch's NotImplementedError from the
    id check. Now an empty batch returns [] on every path (as translate() of no sentences), and a meta `src` is a
    one-line ValueError."""
    model = dm.build_model(system, 24, 24, embed_dim=16, hidden_size=16).eval()
    src, lengths = torch.randint(4, 24, (2, 5)), torch.tensor([5, 3])
    for fused, on_device in ((True, False), (False, False), (False, True)):
        assert beam_search(model, src[:0], lengths[:0], beam=2, fused=fused, on_device=on_device) == []
    assert len(beam_search(model, src, lengths, beam=2)) == 2
    with pytest.raises(ValueError, match="^beam_search: src is on the meta device"):
        beam_search(model, src.to("meta"), lengths, beam=2)
    # src that is no tensor (its .device was read first: "'list' object has no attribute 'device'"); greedy's fixed
    # settings given again (beam_search's "got multiple values for keyword argument 'alpha'")
    for bad in (src.tolist(), src.numpy()):
        with pytest.raises(ValueError, match=rf"^beam_search: src must be a LongTensor \[B, S\], got "
                                             rf"{type(bad).__name__}$"):
            beam_search(model, bad, lengths, beam=2)
    with pytest.raises(TypeError, match=r"^greedy: alpha and beam cannot be given: greedy decoding is beam 1 without "
                                        r"a length penalty \(call beam_search for others\)$"):
        greedy(model, src, lengths, beam=4, alpha=0.6)
    assert greedy(model, src, lengths, max_len_b=3) == [h[0].tokens for h in beam_search(model, src, lengths,
                                                                                           beam=1, max_len_b=3)]


def test_a_one_subword_source_may_always_give_a_word():
    """The bound a * source length + b counts EOS; it is at least 2 steps (a word and EOS): with max_len_a = 1.2 and
    max_len_b = 0 (a common setting) a source of one subword had a bound of 1, EOS alone, and came out empty without
    a word. A decoder that prefers word 5 to EOS at every step gives [5] for it, in the Python loop and on the device
    loop."""
    V = 8

    class PrefersFive:
        def encode(self, src, lengths):
            return torch.zeros(src.shape[0], 1)

        def step(self, state, prev):
            scores = torch.full((prev.shape[0], V), -10.0)
            scores[:, 5], scores[:, EOS] = 0.0, -4.0
            return scores.log_softmax(-1), state

        def reorder(self, state, index):
            return state[index]

    src, lengths = torch.tensor([[7, 0], [7, 7]]), torch.tensor([1, 2])
    for on_device in (False, True):
        found = beam_search(PrefersFive(), src, lengths, beam=2, max_len_a=1.2, max_len_b=0, on_device=on_device)
        assert [h[0].tokens for h in found] == [[5], [5]], on_device   # (2 and 2.4 steps: one word, then EOS)
