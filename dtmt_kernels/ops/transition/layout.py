"""The conventions every backend of the transition op shares. First the one table of the recurrent cells' row
layout, which every backend reads (nn.py's parameters, the Triton launches, the op fakes) or is tested against
(csrc/cell_math.h's cell_input_rows / cell_hidden_rows / cell_ln_groups, through _C.CELL_ROWS). reference.py's
module docstring draws the same layout with the rows' names.

A cell's input projection W x and recurrent projection U h are stacked by rows, H each; the gates come first and
are the rows layer norm normalises (per gate). An absent optional tensor (mask, dropout, layer norm, T-GRUs) is None
or empty (`present`); kernels compute and keep states in `acc_dtype` of the input dtype."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

CELL_KINDS = ("gru", "lgru", "lau", "atr")          # the base cells a layer may have
KINDS: Dict[str, int] = {"gru": 0, "lgru": 1, "lau": 2, "atr": 3, "tgru": 4}   # the kernels' `kind` numbers
KIND_TGRU = KINDS["tgru"]

# kind -> (input rows, recurrent rows, layer-normalised gates), in units of H
ROWS: Dict[int, Tuple[int, int, int]] = {
    KINDS["gru"]: (3, 3, 2),    # W: r z c          U: r z c
    KINDS["lgru"]: (5, 4, 3),   # W: r z l c lin    U: r z l c
    KINDS["lau"]: (5, 4, 3),    # W: r z g c lin    U: r z g c
    KINDS["atr"]: (1, 1, 2),    # W: p              U: q          (LN on p and q separately)
    KINDS["tgru"]: (0, 3, 2),   # no input          U: r z c
}
CELL_ROWS: Dict[str, Tuple[int, int, int]] = {name: ROWS[k] for name, k in KINDS.items()}


def present(t: Optional[Tensor]) -> bool:
    """Whether an optional tensor of the op is given: absent ones are None or empty."""
    return t is not None and t.numel() > 0


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in and keep the states in (hs) for inputs of `dtype`: float64 for float64,
    float32 otherwise (16-bit inputs then also keep hs_lp, the states in their own dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
