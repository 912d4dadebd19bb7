"""The label-smoothed cross-entropy of a training update, log-softmax and loss fused (op.py:
torch.ops.dtmt.smoothed_cross_entropy, its fake and autograd, and the portable one-node autograd Function for the
devices and dtypes the C++ kernel does not take). Reference: reference.py here; kernel: csrc/loss_cpu.cpp (loop:
csrc/isa/loss_rows.cpp)."""
from . import op  # noqa: F401
