"""Every torch.ops.dtmt op called with perturbed arguments, each call in a forked child (issue 71, item 2).

    python tests/op_fuzz.py [--op NAME] [--verbose]

The valid calls are recorded from real use: a training step (forward and backward) and float32 and int8 decoding
(steps, the modules' encode, a beam search) of each system whose ops differ (dtmt, nematus, mce, gnmt-atr,
rnnsearch-atr), the first call of each op in each. Then every tensor argument (inside a Tensor[] list too) is
perturbed in turn: a dimension one shorter or longer, empty, one rank more or less, another dtype,
non-contiguous, out-of-range entries where the tensor holds integers; every int argument: negative, zero, 2^31,
2^62; every float: NaN, -1, 1e30. The calls run in a child process forked from this one, one after another, on
one thread, each under an alarm (a new child goes on after one that died): each must return or raise an ordinary
Python error (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError). A signal (SIGSEGV, SIGABRT
from heap corruption, ...) or the alarm (a hang) is a failure. Under an
AddressSanitizer build (DTMT_SANITIZE=address) a read or write past a tensor aborts the child too, so the same run
finds results that depend on memory past a tensor.

Prints one line per failure and a summary line `op_fuzz: N calls, F failures`; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

ALLOWED = (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError)
SECONDS = 20   # a call's alarm: the valid calls take milliseconds
SYSTEMS = ("dtmt", "nematus", "mce", "gnmt-atr", "rnnsearch-atr")


def record_calls():
    """{op name: [(op, args, kwargs), ...]}: the first call of each op in each system and mode."""
    from conftest import RecordOps
    from dtmt_models import build_model
    from dtmt_models.decoding.beam_search import beam_search

    calls = {}
    for system in SYSTEMS:
        for int8 in (False, True):
            torch.manual_seed(0)
            model = build_model(system, 40, 50, embed_dim=8, hidden_size=12)
            src, lengths = torch.randint(4, 40, (4, 6)), torch.tensor([6, 5, 3, 2])
            prev, target = torch.randint(4, 50, (4, 5)), torch.randint(4, 50, (4, 5))
            rec = RecordOps()
            with rec:
                if not int8:
                    loss, _, n = model(src, lengths, prev, target=target)
                    (loss / n).backward()
                model.eval()
                with torch.no_grad():
                    try:
                        decoder = model.inference_decoder(int8=int8)
                    except (ValueError, RuntimeError):
                        continue   # a system without int8 decoding
                    state = decoder.encode(src, lengths)
                    getattr(decoder, "model", decoder).encode(src, lengths)
                    for t in range(2):
                        _, state = decoder.step(state, prev[:, t])
                    beam_search(decoder, src, lengths, beam=2, max_len_a=0.0, max_len_b=3)
            for func, (args, kwargs) in rec.calls.items():
                calls.setdefault(func.__name__.split(".")[0], []).append((func, args, kwargs))
    # key_exps: no system calls it as an op of its own (the search makes its tables inside); the keys of a step
    keys = calls["rnmt_step"][0][1][2]
    calls["key_exps"] = [(torch.ops.dtmt.key_exps.default, [keys], {})]
    return calls


def tensor_variants(t: torch.Tensor):
    """(label, tensor) perturbations of one tensor argument."""
    out = []
    if t.dim() >= 1 and t.numel() > 0:
        for d in range(t.dim()):
            if t.shape[d] > 1:
                out.append((f"dim {d} - 1", t.narrow(d, 0, t.shape[d] - 1).contiguous()))
            grow = list(t.shape)
            grow[d] += 1
            bigger = torch.zeros(grow, dtype=t.dtype)
            bigger.narrow(d, 0, t.shape[d]).copy_(t)
            out.append((f"dim {d} + 1", bigger))
        out.append(("rank + 1", t.unsqueeze(0)))
        out.append(("rank - 1", t.reshape(-1) if t.dim() > 1 else t.reshape(())[()] if t.numel() == 1 else t[0]))
        if t.shape[-1] > 1:   # every other element of a wider tensor: the same values, strided
            nc = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)[..., ::2]
            nc.copy_(t)
            out.append(("non-contiguous", nc))
    out.append(("empty [0]", t.new_empty(0)))
    if t.numel() > 0:
        out.append(("empty along dim 0", t.new_empty((0, *t.shape[1:])) if t.dim() else t.new_empty(0)))
    for dtype in (torch.float64, torch.float32, torch.int64, torch.int8, torch.bool):
        if dtype != t.dtype:
            out.append((f"as {dtype}", t.to(dtype)))
    if not t.is_floating_point() and t.dtype not in (torch.bool,) and t.numel() > 0:
        big = int(t.max()) + 1 if t.numel() else 1
        for v in (-1, big, 2 ** 31, 2 ** 62) if t.dtype == torch.int64 else (-1, 127):
            bad = t.contiguous().clone()
            bad.view(-1)[-1] = v
            out.append((f"an entry = {v}", bad))
    return out


def int_variants(v: int):
    return [(f"= {x}", x) for x in (-1, 0, 2 ** 31, 2 ** 62) if x != v]


def perturbations(args, kwargs):
    """(label, args, kwargs) of every perturbed call."""
    slots = [(("a", i), a) for i, a in enumerate(args)] + [(("k", k), a) for k, a in kwargs.items()]
    for (where, key), value in slots:
        def put(new, where=where, key=key):
            a, k = list(args), dict(kwargs)
            if where == "a":
                a[key] = new
            else:
                k[key] = new
            return a, k
        name = f"arg {key}" if where == "a" else key
        if isinstance(value, torch.Tensor):
            for label, t in tensor_variants(value):
                yield (f"{name}: {label}", *put(t))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(x, torch.Tensor) for x in value):
            yield (f"{name}: list one shorter", *put(list(value[:-1])))
            yield (f"{name}: list one longer", *put(list(value) + [value[-1]]))
            yield (f"{name}: empty list", *put([]))
            for j, item in enumerate(value):
                for label, t in tensor_variants(item):
                    yield (f"{name}[{j}]: {label}", *put([*value[:j], t, *value[j + 1:]]))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            for label, x in int_variants(value):
                yield (f"{name} {label}", *put(x))
        elif isinstance(value, float):
            for x in (float("nan"), -1.0, 1e30):
                yield (f"{name} = {x}", *put(x))


def run_all(cases):
    """The outcome of each case (op, args, kwargs), in order: 'ok', 'error' (an allowed exception) or what went wrong
    ('exception TYPE: ...', 'signal N (NAME)', 'hang (alarm)'). The cases run in a child forked for them, one after
    another, each under an alarm; where a case kills the child, a new child goes on from the next case."""
    outcomes = []
    while len(outcomes) < len(cases):
        r, w = os.pipe()
        start = len(outcomes)
        pid = os.fork()
        if pid == 0:   # the child: each outcome a line, written as soon as known
            os.close(r)
            for op, args, kwargs in cases[start:]:
                signal.alarm(SECONDS)
                try:
                    op(*args, **kwargs)
                    msg = "ok"
                except ALLOWED:
                    msg = "error"
                except BaseException as e:   # noqa: BLE001 (what else escapes is the finding)
                    msg = f"exception {type(e).__name__}: {str(e)[:200]}".replace("\n", " ")
                signal.alarm(0)
                os.write(w, (msg + "\n").encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            for line in f:
                outcomes.append(line.rstrip("\n"))
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):   # the case after the last outcome killed the child
            sig = os.WTERMSIG(status)
            outcomes.append("hang (alarm)" if sig == signal.SIGALRM else f"signal {sig} ({signal.Signals(sig).name})")
        elif len(outcomes) < len(cases):
            outcomes.append(f"the child exited ({os.WEXITSTATUS(status)}) without a word")
    return outcomes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", action="append", help="only this op (repeatable)")
    p.add_argument("--verbose", action="store_true", help="print every call's outcome")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    calls = record_calls()
    cases, labels = [], []
    for name in sorted(calls):
        if a.op and name not in a.op:
            continue
        for op, args, kwargs in calls[name]:
            cases.append((op, args, kwargs))
            labels.append((name, "the recorded call itself", True))
            for label, pargs, pkwargs in perturbations(args, kwargs):
                cases.append((op, pargs, pkwargs))
                labels.append((name, label, False))
    failures = 0
    for (name, label, valid), outcome in zip(labels, run_all(cases)):
        bad = outcome != "ok" if valid else outcome not in ("ok", "error")
        failures += bad
        if bad or a.verbose:
            print(f"{'FAIL' if bad else 'ok  '} {name}: {label}: {outcome}", flush=True)
    total = len(cases)
    print(f"op_fuzz: {total} calls, {failures} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
