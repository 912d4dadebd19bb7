"""Whether code may read tensor values on the host now (host_reads_allowed), and a tensor's values read once
(host_list): a leaf module, read by the ops, the functional API and dtmt_models' checks alike. Re-exported by
dtmt_kernels.functional."""
from typing import List

import torch


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (tests stand in for a GPU by replacing this)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_reads_allowed() -> bool:
    """Whether code may read tensor values on the host now: not while torch.compile traces (a data-dependent `if`
    would end the graph) nor while a CUDA graph is captured (a read synchronises the stream, which a capture refuses;
    issue 73, updates as CUDA graphs). Where not, the checks of the inputs are device-side asserts
    (torch._assert_async, with the same messages but not the values) and no result depends on the values: a mask
    is made even where nothing is padded, counts stay tensors."""
    return not (torch.compiler.is_compiling() or _capturing())


def host_list(t: torch.Tensor) -> List:
    """t.tolist(), read from its device once for as long as `t` is not changed in place (kept on the tensor itself,
    with its version): a batch's lengths, which the input checks, the encoder's mask and the decoder's start all
    need, cost one read (one synchronisation on a GPU) a batch instead of one each. Only where host_reads_allowed()."""
    hit = t.__dict__.get("_dtmt_host_list")
    if hit is not None and hit[0] == t._version:
        return hit[1]
    values = t.tolist()
    t.__dict__["_dtmt_host_list"] = (t._version, values)
    return values
