"""Whether code may read tensor values on the host now (host_reads_allowed): a leaf module, read by the ops, the
functional API and dtmt_models' checks alike. Re-exported as dtmt_kernels.functional.host_reads_allowed."""
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
