"""The small-row linear of decoding: torch.ops.dtmt.small_rows_linear (op.py). Reference: F.linear; kernel:
csrc/small_gemm_cpu.cpp (loops: csrc/isa/small_gemm_rows.cpp)."""
from .op import small_rows_applicable, small_rows_linear

__all__ = ["small_rows_applicable", "small_rows_linear"]
