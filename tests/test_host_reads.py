"""A training update reads nothing on the host while a CUDA graph is captured (issue 73 item 1: updates as CUDA
graphs; dtmt_kernels.functional.host_reads_allowed). On the CPU the capture is stood in for by replacing
dtmt_kernels.ops._host_reads._capturing, and the reads are counted by a TorchFunctionMode that sees every
Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / numpy call: each is a synchronisation on a GPU,
which a capture refuses. Beneath it a TorchDispatchMode counts the ATen operators that synchronise without such a
call: those whose result's shape or value the host must read (nonzero, masked_select, a boolean mask's index,
equal, unique, ...), which a Python-level counter does not see."""
import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import dtmt_models as dm
import dtmt_kernels as dk
from dtmt_kernels.functional import host_list, host_reads_kept
from dtmt_kernels.ops import _host_reads
from dtmt_models.data.batching import collate

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy}
RECURRENT = ["dtmt", "rnnsearch-atr", "gnmt-atr", "shallow-rnmt", "deeplau", "mce", "nematus"]
PAIRS = [([5, 6, 7, 8], [9, 10, 11]), ([5, 6], [9, 10, 11, 12, 13]), ([7, 8, 9, 10], [10])]


aten = torch.ops.aten
# the operators whose result the host must read on a GPU (a value, or a shape that depends on values)
SYNCING = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select, aten.argwhere,
           aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.bincount}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}   # (with a boolean mask: nonzero)


def _syncs(func, args, kwargs) -> bool:
    op = func.overloadpacket
    if op in SYNCING:
        return True
    if op in INDEXING:
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1])
    return op is aten.repeat_interleave and torch.is_tensor(args[0 if len(args) == 1 else 1]) and \
        kwargs.get("output_size") is None


def _line() -> str:
    """The line of dtmt's code (the innermost) that called what is counted."""
    ours = [f for f in traceback.extract_stack()[:-2] if "dtmt_" in f.filename]
    return f"{ours[-1].filename}:{ours[-1].lineno}" if ours else "elsewhere"


class _Syncs(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _syncs(func, args, kwargs or {}):
            self.counter[f"{func}@{_line()}"] += 1
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensor values made under it, by the line of dtmt's code that made them: `where`,
    the Python-level reads (READS); `syncs`, the ATen operators that read (_syncs), by operator and line (an .item()
    is in both: Tensor.item, then aten._local_scalar_dense)."""

    def __init__(self):
        super().__init__()
        self.where, self.syncs = collections.Counter(), collections.Counter()
        self._beneath = _Syncs(self.syncs)

    def __enter__(self):
        self._beneath.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._beneath.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.where[_line()] += 1
        return func(*args, **(kwargs or {}))


def _update(model, capturing, monkeypatch):
    """The loss and gradients of one training update's forward and backward, with its host reads."""
    monkeypatch.setattr(_host_reads, "_capturing", lambda: capturing)
    src, lengths, prev, target = collate(PAIRS)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)   # (the same dropout masks in both updates)
    reads = HostReads()
    with reads:
        loss_sum, nll_sum, ntok = model(src, lengths, prev, target=target, smoothing=0.1)
        (loss_sum / ntok).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss_sum.detach(), grads, ntok, reads.where, reads.syncs


@pytest.mark.parametrize("system", RECURRENT + ["transformer"])
def test_an_update_reads_nothing_on_the_host_while_captured(system, monkeypatch):
    """Eager, the update reads the lengths and the ids' range on the host (its one-line errors for bad input need
    them); while captured, nothing: the checks are device-side asserts, the mask is made on the device, the token
    count stays a tensor. The loss and every gradient are the eager ones (the mask made where nothing is padded adds
    zeros only: to float rounding)."""
    torch.manual_seed(0)
    model = dm.build_model(system, 60, 60, embed_dim=16, hidden_size=24)
    eager_loss, eager_grads, eager_ntok, eager_reads, eager_syncs = _update(model, False, monkeypatch)
    assert sum(eager_reads.values()) >= 1 and isinstance(eager_ntok, int) and sum(eager_syncs.values()) >= 1
    loss, grads, ntok, reads, syncs = _update(model, True, monkeypatch)
    assert dict(reads) == {}, f"{system} reads on the host while captured: {dict(reads)}"
    assert dict(syncs) == {}, f"{system} synchronises while captured: {dict(syncs)}"
    assert torch.is_tensor(ntok) and int(ntok) == eager_ntok
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(eager_grads)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("system", RECURRENT + ["transformer"])
def test_an_eager_update_reads_the_lengths_once(system, monkeypatch):
    """Issue 75 item 5: an eager update reads the lengths on the host once (dk.functional.host_list), though the
    input checks, the encoder's mask and the decoder's start all use them, and checks the batch once, though its
    encode checks it too (checked_batch): a recurrent system's update makes three reads, the lengths, the ids'
    range (both sides in one), the token count; the transformer too (its decoder's causal mask is declared causal,
    so torch does not compare it with one on the host: a fourth read until 2026-11-30, which a CUDA graph's capture
    refused on the GPU)."""
    torch.manual_seed(0)
    model = dm.build_model(system, 60, 60, embed_dim=16, hidden_size=24)
    _, _, _, reads, _ = _update(model, False, monkeypatch)
    lengths = sum(n for where, n in reads.items() if "_host_reads.py" in where)
    assert lengths == 1, dict(reads)
    assert sum(reads.values()) == 3, dict(reads)


def test_host_list_keeps_a_read_only_inside_a_block():
    """host_list reads a tensor once inside host_reads_kept (one batch's forward), every time outside it, and works on
    tensors without a version counter (made under torch.inference_mode)."""
    t = torch.tensor([3, 1, 2])
    with host_reads_kept():
        reads = HostReads()
        with reads:
            assert host_list(t) == [3, 1, 2] and host_list(t) == [3, 1, 2]
        assert sum(reads.where.values()) == 1
    t[1] = 5
    assert host_list(t) == [3, 5, 2]
    with torch.inference_mode():
        u = torch.tensor([4, 2])
        with host_reads_kept():
            assert host_list(u) == [4, 2]
        layer = dk.nn.DeepTransitionGRU(3, 4, depth=1, batch_first=True)
        out, _ = layer(torch.randn(2, 4, 3), lengths=u)
        assert out[1, 2:].abs().max() == 0


def test_bad_input_still_fails_while_captured(monkeypatch):
    """The device-side asserts keep the eager checks' messages: a length outside [1, S] and an id outside the
    vocabulary fail (on the CPU at once; on a GPU at the stream's next synchronisation)."""
    monkeypatch.setattr(_host_reads, "_capturing", lambda: True)
    model = dm.build_model("dtmt", 60, 60, embed_dim=16, hidden_size=24)
    src, lengths, prev, target = collate(PAIRS)
    with pytest.raises(RuntimeError, match=r"src_lengths must be in \[1, S=4\]"):
        model(src, torch.tensor([4, 0, 4]), prev, target=target)
    with pytest.raises(RuntimeError, match="src holds an id outside the vocabulary's 60"):
        model(src.masked_fill(src == 7, 99), lengths, prev, target=target)


def test_the_counter_sees_the_reads_that_no_python_call_makes():
    """The dispatch-level counter sees what synchronises on a GPU below Python: a boolean mask's index (forward
    and backward), equal, nonzero, repeat_interleave without output_size; and .item() at both levels. It does not
    count what reads nothing: arithmetic, a long index, repeat_interleave given output_size, nonzero_static."""
    x = torch.randn(6, requires_grad=True)
    reads = HostReads()
    with reads:
        x[x > 0].sum().backward()
        torch.equal(x, x)
        x.detach().nonzero()
        x.sum().item()
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0]))
        (x * 2 + 1)[torch.tensor([0, 2])].sum().backward()
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0]), output_size=3)
        torch.nonzero_static(x.detach(), size=6)
    assert dict(reads.where) == {"elsewhere": 1}
    assert sorted(k.split("@")[0] for k in reads.syncs.elements()) == [
        "aten._local_scalar_dense.default", "aten.equal.default", "aten.index.Tensor", "aten.index_put.default",
        "aten.nonzero.default", "aten.repeat_interleave.Tensor"]
