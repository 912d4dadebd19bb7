"""The beam search whose bookkeeping stays on the device (decoding/device_search.py) against the Python loop of
beam_search (its reference): the same hypotheses, scores and log-probabilities, decision for decision, on the CPU;
and what makes it a device loop: one read of the tensors every `check_every` steps, not three a step."""
import math

import pytest
import torch

import dtmt_models as dm
from dtmt_models.data.vocabulary import BOS, EOS
from dtmt_models.decoding import device_search
from dtmt_models.decoding.beam_search import NonFiniteScores, beam_search
from test_beam_search import TableModel
from test_host_reads import HostReads

# (beam, alpha, nbest, max_len_a, max_len_b, early_stop[, penalty]): beam 1 to 6, with and without the GNMT length
# penalty, nbest up to the beam, short and long limits, either stopping rule; the last two rank by the average
CASES = [(1, 0.0, 1, 2.0, 10, False), (3, 0.6, 3, 1.0, 2, False), (4, 0.6, 2, 2.0, 10, False),
         (5, 1.0, 5, 0.5, 3, False), (3, 0.0, 1, 2.0, 10, False), (4, 0.6, 2, 2.0, 10, True),
         (2, 1.0, 2, 2.0, 10, True), (6, 0.2, 1, 1.5, 4, False), (4, 0.0, 2, 2.0, 10, False, "average"),
         (3, 0.0, 3, 1.0, 2, True, "average")]


def _hyps(result):
    return [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in result]


def _kwargs(case):
    beam, alpha, nbest, a, b, early_stop, *penalty = case
    return dict(beam=beam, alpha=alpha, nbest=nbest, max_len_a=a, max_len_b=b, early_stop=early_stop,
                penalty=penalty[0] if penalty else "gnmt")


def _both(model, src, lengths, monkeypatch, check_every, **kwargs):
    """(the Python loop's result, the device loop's with reads every `check_every` steps)."""
    monkeypatch.setattr(device_search, "CHECK_EVERY", check_every)
    return (beam_search(model, src, lengths, fused=False, on_device=False, **kwargs),
            beam_search(model, src, lengths, fused=False, on_device=True, **kwargs))


@pytest.mark.parametrize("check_every", [1, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_equals_the_python_loop_on_a_table_model(seed, check_every, monkeypatch):
    """A bigram table (no batch arithmetic at all: every difference would be a decision): the same hypotheses in
    the same order with the same scores and log-probabilities, to the bit, for sentences that stop at different
    steps (max lengths 1 to 22), with the done ones leaving the batch at the checks only."""
    model = TableModel(V=7 + seed, seed=seed)
    lengths = torch.tensor([6, 1, 4, 2, 5, 3, 6])
    src = torch.zeros(7, 6, dtype=torch.long)
    for case in CASES:
        loop, device = _both(model, src, lengths, monkeypatch, check_every, **_kwargs(case))
        assert _hyps(device) == _hyps(loop), case
        assert all(len(s) == min(case[2], case[0]) for s in loop)


def test_breaks_ties_as_the_python_loop(monkeypatch):
    """A table whose rows hold equal probabilities (ties among the open candidates, among the finished ones and
    between the kept finished and a new one): the same choices as the loop, whose order is topk's, then the
    stable sort with the kept finished first."""
    model = TableModel.by_hand(8, {BOS: {4: 0.25, 5: 0.25, 6: 0.25, EOS: 0.25},
                                   4: {EOS: 0.5, 5: 0.5}, 5: {EOS: 0.5, 6: 0.5}, 6: {EOS: 0.5, 4: 0.5}})
    src, lengths = torch.zeros(3, 4, dtype=torch.long), torch.tensor([4, 2, 3])
    tied = 0
    for case in CASES:
        for check_every in (1, 4):
            loop, device = _both(model, src, lengths, monkeypatch, check_every, **_kwargs(case))
            assert _hyps(device) == _hyps(loop), (case, check_every)
            tied += sum(a.score == b.score and a.tokens != b.tokens for s in loop for a, b in zip(s, s[1:]))
    assert tied > 0   # (the case has ties to break)


@pytest.mark.parametrize("system, options", [
    ("dtmt", dict(depth=1, heads=2)), ("dtmt", dict(depth=2, cell="lau")), ("rnnsearch-atr", {}),
    ("gnmt-atr", {}), ("shallow-rnmt", {}), ("nematus", {}), ("deeplau", {}), ("mce", {}), ("transformer", {}),
])
def test_equals_the_python_loop_on_every_system(system, options, monkeypatch):
    """Every system's decoder in float64: the same hypotheses with the same scores to the bit (its rows do not
    depend on the batch's other rows, up to rounding that float64 keeps below every decision here); in float32 the
    same hypotheses, scores to 1e-5 (the batch a step computes differs between the two: the done sentences' rows
    leave at the checks instead of at once, and a GEMM over another number of rows may round otherwise)."""
    torch.manual_seed(3)
    model = dm.build_model(system, 24, 24, embed_dim=16, hidden_size=16, **options).eval()
    lengths = torch.tensor([6, 1, 4, 2, 5, 3, 6])
    src = torch.randint(4, 24, (7, 6))
    for dtype in (torch.float64, torch.float32):
        model.to(dtype)
        for case in CASES[:6] + CASES[-2:-1]:
            loop, device = _both(model, src, lengths, monkeypatch, 3, **_kwargs(case))
            if dtype == torch.float64:
                assert _hyps(device) == _hyps(loop), (dtype, case)
            else:
                assert [[h.tokens for h in s] for s in device] == [[h.tokens for h in s] for s in loop], case
                for got, want in zip(device, loop):
                    for a, b in zip(got, want):
                        assert math.isclose(a.score, b.score, rel_tol=1e-5, abs_tol=1e-6), case


class Counted:
    """A decoder's steps and the rows each one computes, counted."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def encode(self, src, lengths):
        return self.model.encode(src, lengths)

    def step(self, state, prev):
        self.rows.append(prev.shape[0])
        return self.model.step(state, prev)

    def reorder(self, state, index):
        return self.model.reorder(state, index)


@pytest.mark.parametrize("check_every", [1, 2, 5])
def test_reads_the_device_only_at_the_checks(check_every, monkeypatch):
    """One read before the loop (the longest max length) and at most two at each check (the done flags with the
    first non-finite step; the done sentences' hypotheses), and no read besides these (HostReads counts them all,
    a direct .item() too), where the Python loop reads three a step; the steps
    it takes are the loop's plus at most check_every - 1 (a sentence found done at the next check), and the rows a
    step computes shrink only at the checks."""
    model = TableModel(V=9, seed=1)
    lengths = torch.tensor([9, 1, 7, 2, 8, 3, 9, 4])
    src = torch.zeros(8, 9, dtype=torch.long)
    reads = []

    def host(x):
        reads.append(tuple(x.shape))
        return x.tolist()

    monkeypatch.setattr(device_search, "to_host", host)
    kwargs = dict(beam=3, alpha=0.6, nbest=3, max_len_a=2.0, max_len_b=2)
    loop, device = Counted(model), Counted(model)
    expected = beam_search(loop, src, lengths, fused=False, on_device=False, **kwargs)
    monkeypatch.setattr(device_search, "CHECK_EVERY", check_every)
    every = HostReads()   # (any read of a tensor's values, to_host's or not)
    with every:
        got = beam_search(device, src, lengths, fused=False, on_device=True, **kwargs)
    assert sum(every.where.values()) == len(reads), (dict(every.where), len(reads))
    assert _hyps(got) == _hyps(expected)
    steps = len(device.rows)
    assert len(loop.rows) <= steps <= len(loop.rows) + check_every - 1
    checks = math.ceil(steps / check_every)
    assert len(reads) <= 1 + 2 * checks
    assert steps >= 2 * check_every, "the case must span several checks"
    for t in range(1, steps):   # rows change only right after a check
        if device.rows[t] != device.rows[t - 1]:
            assert t % check_every == 0, (t, device.rows)
    if check_every == 1:
        assert device.rows == loop.rows   # done sentences leave at once, as in the loop


class Overflowing(TableModel):
    """The table model, EOS improbable (no sentence ends before its limit), whose sentences `sentences` score
    `value` for word 4 from step `step` on."""

    def __init__(self, sentences, step, value):
        super().__init__(V=7, seed=2)
        self.table[:, EOS] = -30.0
        self.sentences, self.at, self.value = sentences, step, value

    def encode(self, src, src_lengths):
        self.t = 0
        return {"id": torch.arange(src.shape[0], dtype=torch.float64).unsqueeze(1)}

    def step(self, state, prev):
        out = self.table[prev].clone()
        if self.t >= self.at:
            for sentence in self.sentences:
                out[state["id"].squeeze(1) == sentence, 4] = self.value
        self.t += 1
        return out, state


@pytest.mark.parametrize("check_every", [1, 4])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_scores_stop_as_in_the_python_loop(check_every, value, monkeypatch):
    """Sentences that score NaN or +inf from step 2 on: NonFiniteScores naming the same step, sentence and score
    as the loop's, found at the next check; with two such sentences, the first in batch order."""
    monkeypatch.setattr(device_search, "CHECK_EVERY", check_every)
    src, lengths = torch.zeros(4, 5, dtype=torch.long), torch.tensor([5, 5, 5, 5])
    for sentences, first in (([2], 2), ([3, 1], 1), ([0], 0)):
        errors = []
        for on_device in (False, True):
            with pytest.raises(NonFiniteScores) as info:
                beam_search(Overflowing(sentences, 2, value), src, lengths, beam=3, fused=False,
                            on_device=on_device)
            errors.append(info.value)
        loop, device = errors
        assert (device.step, device.sentence, str(device)) == (loop.step, loop.sentence, str(loop))
        assert (loop.step, loop.sentence) == (2, first)


def test_a_pad_id_outside_the_vocabulary_is_refused_as_in_the_loop():
    model = TableModel(V=7, seed=0)
    model.pad_id = 9
    src, lengths = torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2])
    messages = []
    for on_device in (False, True):
        with pytest.raises(ValueError) as info:
            beam_search(model, src, lengths, fused=False, on_device=on_device)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and f"pad_id {[BOS, 9]}" in messages[0]


def test_the_cpu_default_is_the_python_loop(monkeypatch):
    """on_device=None takes the device loop only off the CPU: on the CPU the loop here (or the fused search)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the device loop ran on the CPU")

    monkeypatch.setattr("dtmt_models.decoding.beam_search.device_loop", refuse)
    model = TableModel(V=7, seed=0)
    result = beam_search(model, torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2]), beam=2)
    assert len(result) == 2 and all(result)


def test_check_every_must_be_a_positive_integer():
    """0 is refused; NaN was taken and never checked before the last step (every sentence ran to max_len), True was
    read as 1."""
    for check_every in (0, -1, float("nan"), 2.5, True):
        with pytest.raises(ValueError, match="check_every must be an integer >= 1"):
            device_search.device_loop(TableModel(), {"x": torch.zeros(1, 1)}, torch.tensor([3]), 2, 0.0, 1, False,
                                      [0, BOS], check_every=check_every)
    assert EOS not in (0, BOS)


def test_graphs_asked_for_off_a_cuda_device_are_refused_in_one_line():
    """graphs=True on a CPU search was torch.cuda's traceback at the first step; graphs=None there is the eager
    loop (the default), and graphs=False too."""
    model = TableModel(V=7, seed=0)
    state = model.encode(torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="graphs=True replays the steps as CUDA graphs: the search is on cpu"):
        device_search.device_loop(model, state, torch.tensor([4, 4]), 2, 0.0, 1, False, [0, BOS], graphs=True)
    for graphs in (None, False):
        assert len(device_search.device_loop(model, state, torch.tensor([4, 4]), 2, 0.0, 1, False, [0, BOS],
                                             graphs=graphs)) == 2


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr", "nematus", "deeplau", "mce", "transformer",
                                    "ensemble"])
def test_a_step_keeps_the_carry_s_shapes_where_a_graph_can_replay_it(system):
    """keeps_shapes, which decides whether a CUDA graph replays the steps (StepGraph.of): after one step the
    recurrent decoders' state keeps its entries, shapes and dtypes from step to step; the transformer's cache grows
    by a position a step, so its steps stay eager. The trial step runs on copies: the carry is left as it was. An
    ensemble's state, a tuple of its models' states, is taken apart and put together as it was (before, the first
    captured step of an ensemble on a GPU failed there)."""
    from dtmt_models.decoding.ensemble import Ensemble

    torch.manual_seed(0)
    if system == "ensemble":
        model = Ensemble([dm.build_model(name, 24, 24, embed_dim=16, hidden_size=16).eval()
                          for name in ("dtmt", "rnnsearch-atr")])
    else:
        model = dm.build_model(system, 24, 24, embed_dim=16, hidden_size=16).eval()
    decoder = model.inference_decoder()
    src, lengths = torch.randint(4, 24, (3, 5)), torch.tensor([5, 2, 4])
    search = device_search.DeviceSearch(decoder, 2, 0.6, 1, False, [0, BOS], 12, torch.device("cpu"))
    carry = search.advance(search.start(decoder.encode(src, lengths), torch.tensor([12, 5, 9])))
    before = {k: v.clone() for k, v in device_search._flat(carry).items()}
    assert device_search.keeps_shapes(search, carry) == (system != "transformer")
    assert all(torch.equal(v, before[k]) for k, v in device_search._flat(carry).items())
    again = device_search._unflat(device_search._flat(carry))
    _assert_same_carry(again, carry)
    if system == "ensemble":
        assert isinstance(carry["state"], tuple) and len(carry["state"]) == 2


def _assert_same_carry(got, want, path=()):
    """got, put together from want's tensors, is want: the same nesting of dicts (same keys, in order) and tuples
    (same length, in order), and at every leaf the very tensor (not a copy, so its value too)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for k in want:
            _assert_same_carry(got[k], want[k], path + (k,))
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, tuple) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_carry(g, w, path + (i,))
    else:
        assert got is want, path


class CopyingStepGraph(device_search.StepGraph):
    """StepGraph on the CPU: made where a CUDA graph would be (keeps_shapes), its replay runs `search.advance` on its
    own copy of the carry and writes the next carry into it in place, as the graph does; so the loop's graph branch
    (the done rows kept until half the batch is done, the sentences already read, a new graph after rows leave) runs
    without a GPU."""
    made = 0

    @classmethod
    def of(cls, search, c):
        if not device_search.keeps_shapes(search, c):
            return None
        CopyingStepGraph.made += 1
        static = {k: v.clone() for k, v in device_search._flat(c).items()}

        def replay():
            out = device_search._flat(search.advance(device_search._unflat(static)))
            for k, v in static.items():
                v.copy_(out[k])
        return cls(type("Graph", (), {"replay": staticmethod(replay)})(), static)


@pytest.mark.parametrize("check_every", [1, 3, 8])
def test_the_graph_branch_equals_the_python_loop(check_every, monkeypatch):
    """The device loop with its steps replayed as graphs (stood in for on the CPU by CopyingStepGraph): the Python
    loop's hypotheses, scores and log-probabilities to the bit on the table models of every case, and on a recurrent
    system (float64); the graph branch had never run without a GPU (a review ran this probe)."""
    import functools

    from dtmt_models.decoding import beam_search as beam_search_module

    monkeypatch.setattr(device_search, "StepGraph", CopyingStepGraph)
    monkeypatch.setattr(beam_search_module, "device_loop", functools.partial(device_search.device_loop, graphs=True))
    CopyingStepGraph.made = 0
    lengths = torch.tensor([6, 1, 4, 2, 5, 3, 6])
    for seed in range(3):
        model = TableModel(V=7 + seed, seed=seed)
        for case in CASES:
            loop, device = _both(model, torch.zeros(7, 6, dtype=torch.long), lengths, monkeypatch, check_every,
                                 **_kwargs(case))
            assert _hyps(device) == _hyps(loop), (seed, case)
    torch.manual_seed(3)
    model = dm.build_model("rnnsearch-atr", 24, 24, embed_dim=16, hidden_size=16).eval().double()
    for case in CASES[:4]:
        loop, device = _both(model, torch.randint(4, 24, (7, 6)), lengths, monkeypatch, check_every,
                             **_kwargs(case))
        assert _hyps(device) == _hyps(loop), case
    assert CopyingStepGraph.made > 3 * len(CASES)   # (a graph per search at least, and again after rows left)
