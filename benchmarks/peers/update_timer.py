"""Where a training update's time goes, the same way for dtmt and for a peer toolkit (needs only torch, so the
peer's environment can import it too; used by `bench_peers.py --profile` and `peers/onmt_profile.py`).

`profile_updates(update, batches, parts)` runs `update(batch)` over the batches (after `warmup` of them) and
returns milliseconds per update: the whole update, the forward time of each named part (modules timed by forward
hooks; a part is a list of modules whose calls are summed, nested calls counted once), and the times of the
phases the caller marks with `timer.phase(name)` (backward, optimizer). It also counts, with torch's profiler
over one more update, the ATen operator calls per update (the cost of running many small ops from Python) and
lists the operators that take the most self time.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Sequence

import torch


class UpdateTimer:
    def __init__(self, parts: Dict[str, Sequence[torch.nn.Module]]):
        self.totals: Dict[str, float] = {}
        self._depth = 0
        self._handles = []
        for name, modules in parts.items():
            for m in modules:
                self._handles.append(m.register_forward_pre_hook(self._pre(name)))
                self._handles.append(m.register_forward_hook(self._post(name)))
        self._start: Dict[str, List[float]] = {}

    def _pre(self, name):
        def hook(module, args):
            self._depth += 1
            if self._depth == 1:
                self._start.setdefault(name, []).append(time.perf_counter())
        return hook

    def _post(self, name):
        def hook(module, args, out):
            if self._depth == 1:
                self.add(name, time.perf_counter() - self._start[name].pop())
            self._depth -= 1
        return hook

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def profile_updates(update: Callable[[object, UpdateTimer], int], batches: Sequence, parts, warmup: int = 3,
                    top: int = 12) -> dict:
    """update(batch, timer) runs one training update and returns its number of target tokens."""
    timer = UpdateTimer(parts)
    for b in batches[:warmup]:
        update(b, timer)
    timer.totals.clear()
    tokens, t0 = 0, time.perf_counter()
    for b in batches[warmup:]:
        tokens += update(b, timer)
    total = time.perf_counter() - t0
    n = max(len(batches) - warmup, 1)
    result = {"updates": n, "tokens_per_update": tokens / n, "ms_per_update": 1e3 * total / n,
              "tokens_per_s": tokens / total, "parts_ms": {k: 1e3 * v / n for k, v in timer.totals.items()}}
    timer.remove()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update(batches[warmup], UpdateTimer({}))
    events = prof.key_averages()
    result["aten_calls"] = sum(e.count for e in events if e.key.startswith("aten::"))
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    result["top_ops"] = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in rows]
    return result
