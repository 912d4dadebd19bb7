"""The fused ops, one folder each, every one a torch.library custom op in the `dtmt` namespace (torch.ops.dtmt.*):

    transition/     the deep transition block / ATR over a sequence (forward, backward; C++ CPU and CUDA kernels,
                    Triton kernels) and the cells' row layout
    attention/      additive-attention scores and context of a decoder step
    linear/         the small-row linear of decoding, int8 rows, row panels, huge pages
    loss/           the label-smoothed cross-entropy of a training update, log-softmax and loss fused

Each folder holds its op's reference (reference.py: pure PyTorch, the executable spec; dtmt_kernels.reference
gathers them), its registration (fake implementation, autograd, autocast rule: _autocast.py) and its launchers.
The C++ and CUDA kernels live in csrc/ (registered by csrc/registration.cpp), their per-element math in shared
headers. Importing this package loads the extension and registers everything. The extension also holds the
inference engine's ops (csrc/engine/), which dtmt_models.engine.ops registers: this package knows nothing of NMT."""
from . import attention, linear, loss, transition  # noqa: F401
from ._extension import IMPORT_ERROR, _C, built

__all__ = ["IMPORT_ERROR", "_C", "built", "attention", "linear", "loss", "transition"]
