"""Whether code may read tensor values on the host now (host_reads_allowed), and a tensor's values read once a
batch (host_list, host_reads_kept): a leaf module, read by the ops, the functional API and dtmt_models' checks
alike. Re-exported by dtmt_kernels.functional."""
import contextlib
import threading
from typing import Iterator, List

import torch


_AS_CAPTURED = threading.local()   # .on: inside as_captured, in this thread


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream, or the code runs as if one were (as_captured)."""
    return getattr(_AS_CAPTURED, "on", False) or (torch.cuda.is_available()
                                                  and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """The block runs as under a CUDA graph capture, in this thread: host reads forbidden (host_reads_allowed), so
    the shortcuts that read values (no padding in a batch, a source trimmed to its longest sentence) are not taken.
    For the eager warm-up before a capture (it had taken them, and the capture met shapes and kernels no warm-up had
    set up), and for the CPU's stand-in for a capture (training.graphs.StandInCapture, the tests)."""
    was = getattr(_AS_CAPTURED, "on", False)
    _AS_CAPTURED.on = True
    try:
        yield
    finally:
        _AS_CAPTURED.on = was


def host_reads_allowed() -> bool:
    """Whether code may read tensor values on the host now: not while torch.compile traces (a data-dependent `if`
    would end the graph), nor while torch.jit.trace records (a value read would be a constant of the trace: the
    example's lengths, applied to every later batch), nor while a CUDA graph is captured (a read synchronises the
    stream, which a capture refuses; issue 73, updates as CUDA graphs). Where not, the checks of the inputs are
    device-side asserts (torch._assert_async, with the same messages but not the values; under torch.jit.trace,
    which drops such an assert, `checked_lengths`) and no result depends on the values: a mask is made even where
    nothing is padded, counts stay tensors."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing() or _capturing())


def check_length_values(owner: str, values: List[int], T: int) -> None:
    """ValueError naming `owner` unless every one of the lengths `values` (read on the host) is in [1, T]: the one
    check of lengths given as values, a tensor read or a list, and of a trace's `checked_lengths`."""
    if values and (min(values) < 1 or max(values) > T):
        raise ValueError(f"{owner}: every length must be in [1, T={T}], got min {min(values)}, max {max(values)}")


@torch.library.custom_op("dtmt::checked_lengths", mutates_args=())
def checked_lengths(lengths: torch.Tensor, steps: torch.Tensor, owner: str) -> torch.Tensor:
    """`lengths` [B] (int64) as they are, after a ValueError naming `owner` where one is outside [1, T], T =
    steps.numel(). The lengths check of a torch.jit.trace: a trace drops an op whose result nothing reads (an
    _assert_async: invalid lengths ran without a word, a length 0 giving zeros), and keeps this one, whose result
    the mask reads; T comes from a tensor, so a trace called with another T checks against that one."""
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        # (1.5 had passed, a 2-D or 0-d tensor had been a TypeError of a comparison)
        raise ValueError(f"{owner}: lengths must be a 1-D tensor of integers, got {lengths.dtype} "
                         f"{list(lengths.shape)}")
    check_length_values(owner, lengths.tolist(), steps.numel())
    return lengths.clone()


@checked_lengths.register_fake
def _(lengths: torch.Tensor, steps: torch.Tensor, owner: str) -> torch.Tensor:
    return torch.empty_like(lengths)


_KEPT = threading.local()   # .values: {id(tensor): (tensor, its values)} inside host_reads_kept, else absent


@contextlib.contextmanager
def host_reads_kept() -> Iterator[None]:
    """Within the block (one batch's forward, whose tensors do not change), host_list reads each tensor once: a
    batch's lengths, which the input checks, the encoder's mask and the decoder's start all need, cost one read (one
    synchronisation on a GPU) instead of one each. Blocks nest (the outer one holds); per thread."""
    if torch.compiler.is_compiling() or getattr(_KEPT, "values", None) is not None:   # (no reads when compiling)
        yield
        return
    _KEPT.values = {}
    try:
        yield
    finally:
        _KEPT.values = None


def host_list(t: torch.Tensor) -> List:
    """t.tolist(); inside host_reads_kept, read once for the block (the block keeps `t` alive, so its id is not
    reused). Only where host_reads_allowed()."""
    kept = getattr(_KEPT, "values", None)
    if kept is None:
        return t.tolist()
    hit = kept.get(id(t))
    if hit is None or hit[0] is not t:
        hit = kept[id(t)] = (t, t.tolist())
    return list(hit[1])
