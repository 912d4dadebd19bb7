"""The small-row linear of decoding: torch.ops.dtmt.small_rows_linear (op.py). Reference: F.linear; kernel:
csrc/small_gemm_cpu.cpp (loops: csrc/isa/small_gemm_rows.cpp). Its weights' int8 form: quantize.py; their
placement in 2 MiB pages: placement.py; the row-panel layout of products with one row (an encoder's at batch 1):
panels.py."""
from .op import float64_products, small_rows_applicable, small_rows_linear
from .panels import PANEL_WIDTH, row_panels
from .placement import huge_page_copies, huge_pages_offered

__all__ = ["PANEL_WIDTH", "float64_products", "huge_page_copies", "huge_pages_offered", "row_panels", "small_rows_applicable",
           "small_rows_linear"]
