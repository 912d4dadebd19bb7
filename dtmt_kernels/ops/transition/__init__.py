"""The transition op: a deep transition block (GRU / L-GRU / LAU + T-GRUs) or ATR over a sequence, one direction.

    layout.py           the cells' row layout, the one table every backend reads
    op.py               torch.ops.dtmt.transition_forward / _backward (C++ CPU and CUDA kernels) and their Triton
                        twins: fakes, the one autograd definition, flat_params, fused_sequence
    triton.py           the Triton launchers (triton_kernels.py: the kernels)
    persistent.py       the cuda backend's persistent launches: whether a layer fits a GPU (persistent_plan)
    reference.py        the pure-PyTorch reference, the executable spec (transition_sequence, the cells)
The C++ kernels
are csrc/transition_cpu.cpp and csrc/transition_cuda.cu, their per-element math csrc/cell_math.h."""
from .layout import CELL_KINDS, CELL_ROWS, CELLS, DEEP_TRANSITION_CELLS, KIND_TGRU, KINDS, ROWS
from .op import PARAM_NAMES, flat_params, fused_sequence
from .persistent import PersistentPlan, persistent_plan

__all__ = ["CELL_KINDS", "CELL_ROWS", "CELLS", "DEEP_TRANSITION_CELLS", "KIND_TGRU", "KINDS", "ROWS", "PARAM_NAMES", "PersistentPlan", "flat_params",
           "fused_sequence", "persistent_plan"]
