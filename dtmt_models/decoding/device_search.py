"""Beam search whose loop stays on the tensors' device: no transfer to the host between two checks.

The Python loop of `beam_search` reads every step's best candidates to the host (three transfers a step) and does
the bookkeeping on lists: on a GPU that is a synchronisation per step, and the device idles while Python works.
Here the same bookkeeping is done with tensor operations over fixed shapes [sentences, beam, ...]: the candidates a
sentence takes in rank order, its open hypotheses, its finished ones (kept sorted, `beam` of them at most), whether
it is done. A sentence that is done keeps its rows until the next check (its steps then cost rows whose results are
ignored: the state's rows stay where they are, its finished hypotheses do not change); every `check_every` steps
one transfer reads which sentences are done, ends the search when all are, drops their rows from the state and
takes their hypotheses, and raises NonFiniteScores for the first step and sentence (in batch order) where the model
gave a non-finite score, as the Python loop does at that step. With GRAPHS on (the default), on a CUDA device, the
steps between two checks are replayed as a CUDA graph (StepGraph: one launch a step, no Python) where a step keeps the
state's shapes, as the recurrent decoders' does; then the done sentences' rows leave only once half of the batch is
done (a capture for each batch size), where eager steps drop them at every check.

The decisions are the Python loop's, decision for decision (its module docstring has the rules: the candidates of a step
in rank order, the first `beam` other than EOS open, an EOS among the `beam` best finishing; the stopping rules, the
last step allowing only EOS, PAD and BOS banned): the scores in the same float32 sums, normalised and compared in
float64 as Python's floats are, the length penalty taken from a table made by the same function; ties broken the same
way (topk's order, then a stable sort of the finished ones, those already finished first). Only the batch a step
computes differs (rows of done sentences stay until the next check), which changes nothing for a model whose rows do not
depend on each other, up to the rounding of a GEMM over another number of rows. tests/test_device_search.py checks it
against the loop.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from dtmt_models.data.vocabulary import BOS, EOS
from dtmt_models.engine.decoder import as_decoder
from dtmt_models.decoding.hypotheses import Hypothesis, NonFiniteScores, check_banned, length_penalty

CHECK_EVERY = 8   # steps between two reads of which sentences are done (a transfer, on a GPU a synchronisation)
# The steps as CUDA graphs on a CUDA device (where a step keeps the state's shapes and does not synchronise with the
# host, both seen in a warm-up step before any capture; otherwise, with a warning, the steps stay eager). On by default since its first GPU run (H200, 2026-11-30, bench_decode.py, beam 4): the
# graph loop 2.2-2.5x the host loop for rnnsearch-atr and nematus, the eager device loop 0.61-0.77x it (a step's
# bookkeeping is some sixty small launches); hypotheses and scores those of the eager steps
# (tests/test_gpu_systems.py). dtmt's step did not capture then (its positional encoding read the host), mended since.
GRAPHS = True
NEG_INF = float("-inf")
Carry = Dict[str, object]   # the search's tensors between steps, the decoder's state under "state"


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`values` as a tensor on `device`, without waiting for the device: on a GPU copied from pinned memory in the
    stream's order (`torch.tensor(values, device=...)` copies from pageable memory, which synchronises: the index
    copies of a check did, seen with torch's sync debug mode on an H200, 2026-12-04)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)


def to_host(x: Tensor) -> list:
    """The search's only reads of device tensors (counted by the tests)."""
    return x.tolist()


class DeviceSearch:
    """One batch's search: its constants, and `advance`, one step from the carried tensors to the next ones. A
    step has fixed shapes and reads nothing to the host, so that on a GPU it can be captured as a CUDA graph
    (StepGraph): the step number t is a tensor too. A carry holds, for n sentences of K rows each: t [1]; the
    decoder's state (n K rows); prev [n K] the last words; scores [n, K] the open hypotheses' log-probabilities
    (float32, the loop's sums); history [n K, steps] their words; fin_score / fin_logp [n, K] (float64, sorted, best
    first), fin_len, fin_tokens [n, K, steps], fin_count [n]: the finished ones; active [n]; bad_step / bad_score
    [n]: the first step whose best candidate was not finite (steps: none); max_len [n] and lp_bound [n], the
    length penalty at max_len (at least 1: hypotheses.bound_penalty)."""

    def __init__(self, model, beam: int, alpha: float, nbest: int, early_stop: bool, banned: Sequence[int],
                 steps: int, device: torch.device, penalty: str = "gnmt"):
        model = as_decoder(model)
        self.model, self.K, self.nbest, self.early_stop = model, beam, nbest, early_stop
        self.banned, self.steps, self.device = list(banned), steps, device
        self.banned_t = to_device(self.banned, torch.long, device)
        self.reorder_within = model.reorder_within
        # lp(n) for every length, by the function the Python loop calls (Python's pow, not the device's)
        self.lp = to_device([length_penalty(n, alpha, penalty) for n in range(steps + 1)], torch.float64, device)

    def start(self, state, max_len: Tensor) -> Carry:
        B, K, steps, dev = max_len.shape[0], self.K, self.steps, self.device
        scores = torch.full((B, K), NEG_INF, device=dev)
        scores[:, 0] = 0.0                                               # all beams start identical: keep one
        return dict(
            t=torch.zeros(1, dtype=torch.long, device=dev),
            state=self.model.reorder(state, torch.arange(B, device=dev).repeat_interleave(K)),
            prev=torch.full((B * K,), BOS, dtype=torch.long, device=dev), scores=scores,
            history=torch.zeros((B * K, steps), dtype=torch.long, device=dev),
            fin_score=torch.full((B, K), NEG_INF, dtype=torch.float64, device=dev),
            fin_logp=torch.zeros((B, K), dtype=torch.float64, device=dev),
            fin_len=torch.zeros((B, K), dtype=torch.long, device=dev),
            fin_tokens=torch.zeros((B, K, steps), dtype=torch.long, device=dev),
            fin_count=torch.zeros((B,), dtype=torch.long, device=dev),
            active=torch.ones((B,), dtype=torch.bool, device=dev),
            bad_step=torch.full((B,), steps, dtype=torch.long, device=dev),
            bad_score=torch.zeros((B,), device=dev),
            max_len=max_len, lp_bound=self.lp[max_len].clamp_min(1.0))   # (hypotheses.bound_penalty)

    def advance(self, c: Carry) -> Carry:
        """One step of every sentence (a done one's results do not change; its rows stay where they are)."""
        K, t, max_len, active, fin_count = self.K, c["t"], c["max_len"], c["active"], c["fin_count"]
        log_probs, state = self.model.step(c["state"], c["prev"])
        n, V, dev = active.shape[0], log_probs.shape[-1], self.device
        check_banned(self.banned, V)
        log_probs = log_probs.view(n, K, V).float()
        at_limit = (t + 1 >= max_len).view(n, 1, 1)                     # the last step allowed: only EOS may follow
        eos_only = torch.full_like(log_probs, NEG_INF)
        eos_only[..., EOS] = log_probs[..., EOS]
        log_probs = torch.where(at_limit, eos_only, log_probs)
        cand = (c["scores"].unsqueeze(-1) + log_probs).index_fill_(-1, self.banned_t, NEG_INF).view(n, -1)
        top_s, top_i = cand.topk(min(2 * K, cand.shape[1]), dim=1)
        bad_step = c["bad_step"]
        first_bad = active & ~(top_s[:, 0] < float("inf")) & (bad_step == self.steps)   # NaN ranks first, as +inf
        origin, word = top_i // V, top_i % V
        is_eos = word == EOS
        # the Python loop's scan in rank order: a candidate is looked at while no -inf came before it; the first
        # `beam` words other than EOS stay open, an EOS among the `beam` best candidates finishes its hypothesis
        seen = torch.cumprod((top_s != NEG_INF).to(torch.long), 1).bool()
        opens = torch.cumsum(~is_eos, 1)
        take = seen & ~is_eos & (opens <= K)
        ends = seen & is_eos & (torch.arange(is_eos.shape[1], device=dev) < K) & active.unsqueeze(1)
        slot = torch.where(take, opens - 1, K)                             # slot K: the discarded
        new_scores = torch.full((n, K + 1), NEG_INF, device=dev).scatter_(1, slot, top_s)[:, :K]
        new_origin = torch.zeros((n, K + 1), dtype=torch.long, device=dev).scatter_(1, slot, origin)[:, :K]
        new_word = torch.full((n, K + 1), EOS, dtype=torch.long, device=dev).scatter_(1, slot, word)[:, :K]
        # the finished: those kept and those ending here, sorted (stable: the kept first among equals), `beam` kept
        all_score = torch.cat([c["fin_score"], torch.where(ends, top_s.double() / self.lp[t + 1], NEG_INF)], 1)
        order = torch.sort(all_score, dim=1, descending=True, stable=True).indices[:, :K]
        from_new, kept = order >= K, order.clamp_max(K - 1)
        new_k = (order - K).clamp_min(0)
        rows = (torch.arange(n, device=dev).unsqueeze(1) * K + origin.gather(1, new_k)).view(-1)
        steps = self.steps
        fin_tokens = torch.where(from_new.unsqueeze(-1), c["history"][rows].view(n, K, steps),
                                 c["fin_tokens"].gather(1, kept.unsqueeze(-1).expand(n, K, steps)))
        fin_score = all_score.gather(1, order)
        fin_count = (fin_count + ends.sum(1)).clamp_max(K)
        # done when no open hypothesis can still enter the nbest, or with early_stop once `beam` are finished
        best_open = new_scores.max(1).values
        bound = best_open.double() / c["lp_bound"]
        nbest = self.nbest
        full = fin_count >= K if self.early_stop else (fin_count >= nbest) & (bound <= fin_score[:, nbest - 1])
        active = active & ~((t + 1 >= max_len) | (best_open == NEG_INF) | full)
        go = active.unsqueeze(1)
        select = torch.where(go, torch.arange(n, device=dev).unsqueeze(1) * K + new_origin,
                             torch.arange(n * K, device=dev).view(n, K)).view(-1)   # a done group stays put
        word = torch.where(go, new_word, EOS).view(-1)
        history = c["history"][select].index_copy_(1, t, word.unsqueeze(1))
        return dict(
            t=t + 1, state=self.reorder_within(state, select), prev=word,
            scores=torch.where(go, new_scores, NEG_INF), history=history,
            fin_score=fin_score, fin_tokens=fin_tokens, fin_count=fin_count, active=active,
            fin_logp=torch.where(from_new, top_s.double().gather(1, new_k), c["fin_logp"].gather(1, kept)),
            fin_len=torch.where(from_new, t, c["fin_len"].gather(1, kept)),
            bad_step=torch.where(first_bad, t, bad_step), bad_score=torch.where(first_bad, top_s[:, 0], c["bad_score"]),
            max_len=max_len, lp_bound=c["lp_bound"])

    def keep(self, c: Carry, groups: List[int]) -> Carry:
        """The carry of these sentences only (their rows taken from the state with the decoder's reorder)."""
        g = to_device(groups, torch.long, self.device)
        rows = (g.unsqueeze(1) * self.K + torch.arange(self.K, device=self.device)).view(-1)
        out = {k: (v if k == "t" else v[rows] if k in ("prev", "history") else v[g]) for k, v in c.items()
               if k != "state"}
        out["state"] = self.model.reorder(c["state"], rows)
        return out

    def hypotheses(self, c: Carry, groups: List[int], host: Callable[[Tensor], list]) -> List[List[Hypothesis]]:
        """The finished hypotheses of these groups, best first, nbest at most (one read)."""
        g = to_device(groups, torch.long, self.device)
        # count, then per hypothesis (score, log-prob, length, tokens), all exact in float64
        packed = host(torch.cat([c["fin_count"][g].unsqueeze(1).double(),
                                 torch.cat([c["fin_score"][g].unsqueeze(2), c["fin_logp"][g].unsqueeze(2),
                                            c["fin_len"][g].unsqueeze(2).double(), c["fin_tokens"][g].double()],
                                           2).flatten(1)], 1))
        width = 3 + self.steps
        out = []
        for row in packed:
            hyps = [row[1 + k * width:1 + (k + 1) * width] for k in range(min(int(row[0]), self.nbest))]
            out.append([Hypothesis([int(w) for w in h[3:3 + int(h[2])]], h[0], h[1]) for h in hyps])
        return out


def device_loop(model, state, max_len: Tensor, beam: int, alpha: float, nbest: int, early_stop: bool,
                banned: Sequence[int], check_every: Optional[int] = None,
                host: Optional[Callable[[Tensor], list]] = None, graphs: Optional[bool] = None,
                penalty: str = "gnmt") -> List[List[Hypothesis]]:
    """The search after `model.encode`: `state` (B rows), `max_len` [B] (long, on the state's device: the steps
    each sentence may take, EOS included), `banned` the words never chosen (PAD, BOS). Returns for each sentence its
    `nbest` best hypotheses, best first, as beam_search does. `check_every` >= 1: steps between two reads of the
    done flags (1 reads every step, as the Python loop does; None: CHECK_EVERY). `host`: the function that reads a
    tensor to a list (to_host). `graphs`: the steps between two checks replayed as a CUDA graph (StepGraph) where
    the decoder's state keeps its shapes from step to step; None: GRAPHS, on a CUDA device. `penalty`: the length
    penalty (hypotheses.length_penalty)."""
    host = host or to_host
    check_every = CHECK_EVERY if check_every is None else check_every
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be an integer >= 1, got {check_every!r}")   # (NaN never checked)
    device = max_len.device
    graphs = GRAPHS and device.type == "cuda" if graphs is None else graphs
    steps = int(max(host(max_len)))   # one read before the loop
    search = DeviceSearch(model, beam, alpha, nbest, early_stop, banned, steps, device, penalty)
    c = search.start(state, max_len)
    ids = list(range(max_len.shape[0]))   # the sentence of each group of K rows
    results: List[List[Hypothesis]] = [[] for _ in ids]
    taken = set()   # the sentences whose hypotheses are read (under a graph their rows may stay a while)
    step = search.advance
    for t in range(steps):
        c = step(c)
        if t == 0 and graphs:   # (after one step: the state has all its entries)
            step = StepGraph.of(search, c) or step
        if (t + 1) % check_every and t + 1 < steps:
            continue
        flags, first = host(torch.stack([c["active"].long(), c["bad_step"]]))
        if min(first) < steps:
            raise _first_non_finite(first, host(c["bad_score"]), ids)
        keep = [g for g, f in enumerate(flags) if f]
        done = [g for g, f in enumerate(flags) if not f and ids[g] not in taken]
        if done:
            for g, hyps in zip(done, search.hypotheses(c, done, host)):
                results[ids[g]] = hyps
            taken.update(ids[g] for g in done)
        if not keep:
            break
        if done and (not isinstance(step, StepGraph) or 2 * len(keep) <= len(ids)):
            # the done groups' rows leave the state (under a graph, once half have: a graph per batch size)
            c, ids = search.keep(c, keep), [ids[g] for g in keep]
            if isinstance(step, StepGraph):
                step = StepGraph.of(search, c) or search.advance
    return results


class StepGraph:
    """`search.advance` captured as one CUDA graph (torch.cuda.CUDAGraph) for the shapes of a carry: a call
    replays it, reading the graph's own copy of the carry and writing the next carry into it, so the steps between
    two checks launch nothing from Python. `of` returns None (the steps stay eager) where a step changes the
    state's shapes (the transformer's growing cache), synchronises with the host (a warm-up step under torch's sync
    debug mode tells, before any capture), or the capture fails (each but the first with a warning)."""

    def __init__(self, graph, static: Carry):
        self.graph, self.static = graph, static

    @classmethod
    def of(cls, search: DeviceSearch, c: Carry) -> Optional["StepGraph"]:
        if torch.device(search.device).type != "cuda":   # (device_loop(graphs=True) on the CPU: torch.cuda's traceback)
            raise ValueError(f"graphs=True replays the steps as CUDA graphs: the search is on {search.device}, not a "
                             f"CUDA device")
        with torch.cuda.device(search.device):   # (the streams below are the current device's: a search on cuda:1
            return cls._of(search, c)              # had warmed up and captured on cuda:0's)

    @classmethod
    def _of(cls, search: DeviceSearch, c: Carry) -> Optional["StepGraph"]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # a warm-up step on copies (lazy initialisations) tells the shapes, and, with torch's sync debug mode raising,
        # whether the step synchronises with the host (a read, a copy from pageable memory): such a step would fail
        # its capture, and a failed capture can leave torch's CUDA state behind (its random generator still
        # expecting a graph: the transformer's training update on the H200, 2026-11-30), so it is not attempted
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                steady = keeps_shapes(search, c)
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            warnings.warn(f"dtmt: the decoder step synchronises with the host ({exc}); it runs eagerly, not as a "
                          f"CUDA graph")
            return None
        finally:
            torch.cuda.set_sync_debug_mode(before)
            torch.cuda.current_stream().wait_stream(side)
        if not steady:
            return None
        static = {k: v.clone() for k, v in _flat(c).items()}
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = _flat(search.advance(_unflat(static)))
                for k, v in static.items():
                    v.copy_(out[k])
        except RuntimeError as exc:
            warnings.warn(f"dtmt: the decoder step could not be captured as a CUDA graph ({exc}); it runs eagerly")
            return None
        return cls(graph, static)

    def __call__(self, c: Carry) -> Carry:
        self.graph.replay()
        return _unflat(self.static)


def keeps_shapes(search: DeviceSearch, c: Carry) -> bool:
    """Whether a step from a copy of `c` gives a carry of the same entries, shapes and dtypes (what a graph
    replayed in place needs): true for the recurrent decoders, whose state is fixed once it has its attention
    weights (after one step), false for the transformer's cache, which grows by a position a step."""
    before = _flat(c)
    after = _flat(search.advance(_unflat({k: v.clone() for k, v in before.items()})))
    return after.keys() == before.keys() and all(after[k].shape == v.shape and after[k].dtype == v.dtype
                                                 for k, v in before.items())


def _flat(c) -> Dict[tuple, Tensor]:
    """The carry's tensors by their path (a tuple of dict keys and sequence indices): the decoder's state may nest
    dicts in tuples (an ensemble's is a tuple of its models' states)."""
    out: Dict[tuple, Tensor] = {}

    def walk(v, path):
        if isinstance(v, dict):
            for k, item in v.items():
                walk(item, path + (k,))
        elif isinstance(v, (tuple, list)):
            for i, item in enumerate(v):
                walk(item, path + (i,))
        else:
            out[path] = v
    walk(c, ())
    return out


def _unflat(flat: Dict[tuple, Tensor]):
    """_flat's inverse: a level whose keys are all indices is a tuple, any other a dict."""
    if list(flat) == [()]:
        return flat[()]
    groups: Dict[object, Dict[tuple, Tensor]] = {}
    for path, v in flat.items():
        groups.setdefault(path[0], {})[path[1:]] = v
    if all(isinstance(k, int) for k in groups):
        return tuple(_unflat(groups[i]) for i in sorted(groups))
    return {k: _unflat(g) for k, g in groups.items()}


def _first_non_finite(first: List[int], scores: List[float], ids: List[int]) -> NonFiniteScores:
    """The error the Python loop raises: at the first step where some sentence's best candidate was not finite,
    the first such sentence in batch order."""
    step = min(first)
    sentence = min(ids[g] for g, s in enumerate(first) if s == step)
    return NonFiniteScores(scores[ids.index(sentence)], step, sentence)
