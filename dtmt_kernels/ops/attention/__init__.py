"""The additive-attention ops: scores and context of one decoder step (op.py: torch.ops.dtmt.additive_scores,
torch.ops.dtmt.attention_context, fakes, autograd and autocast rule). Reference: reference.py here (additive_scores,
attention_context); kernels: csrc/attention_cpu.cpp (loops: csrc/isa/attention_loops.cpp)."""
from . import op  # noqa: F401
