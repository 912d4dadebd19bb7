"""The persistent launches' envelope (issue 72 item 3): whether a layer runs as one persistent launch a direction on
a GPU, or the per-step path, and why. The arithmetic is the CUDA driver's own (csrc/persistent_plan.h, compiled into
the CPU extension too), so the decision stated here on any machine is the one the driver makes; the design note
docs/design/persistent_recurrence.md, "The envelope", has the table for an H100 / H200.

    >>> import dtmt_kernels as dk
    >>> print(dk.persistent_plan("lgru", 4, 64, 512, multiprocessors=132,
    ...                          shared_memory=232448))  # doctest: +NORMALIZE_WHITESPACE
    persistent: 128 blocks of 4 units; 220 / 226 KB of shared memory a block (forward / backward) of 227 KB; FMA,
    staging 160 / 160 columns a row
    >>> print(dk.persistent_plan("lgru", 4, 64, 1024, "bfloat16", multiprocessors=132, shared_memory=232448,
    ...                          l2_cache=52428800))  # doctest: +NORMALIZE_WHITESPACE
    persistent: 128 blocks of 8 units; 192 / 199 KB of shared memory a block (forward / backward) of 227 KB; the
    matrices of 2 / 2 of 5 sub-cells read from L2 (12.1 / 12.0 MiB of the 25 MiB allowed); tensor cores

The cuda backend takes the persistent launches where DTMT_CUDA_RECURRENCE=persistent (read once a process) and the
plan fits; where it does not, the per-step path, with a warning naming the sizes. DTMT_CUDA_RECURRENCE=
persistent-cluster asks for the cluster form first (thread-block clusters of at most 16 blocks, their barrier the
cluster's, each cluster the whole layer for its own batch rows, as many clusters as the SMs hold; `cluster=16` here),
and where that does not fit, the grid form:

    >>> print(dk.persistent_plan("gru", 0, 8, 512, multiprocessors=132, shared_memory=232448,
    ...                          cluster=16))  # doctest: +NORMALIZE_WHITESPACE
    persistent, 8 clusters each of its own batch rows: 16 blocks of 32 units; 198 / 200 KB of shared memory a block
    (forward / backward) of 227 KB; FMA, staging 512 / 1536 columns a row

`python benchmarks/bench_persistent.py --envelope [--multiprocessors 132 --shared-memory 232448 --l2-cache 52428800]`
prints the envelope table (envelope_table) of the current GPU, or of the numbers given."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .._extension import _C
from .layout import CELL_KINDS, KINDS

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PersistentPlan:
    """A layer's persistent plan on a device: `fits` (else the per-step path runs), `grid` blocks of `slice` hidden
    units each (one block per SM, at most one per unit), the shared memory a block needs forward and backward
    against what a block may opt into, and whether the products run on tensor cores (TF32 / f16 / bf16). Where the
    matrices do not all fit in shared memory, those of the top sub-cells are read from L2 at each use: of the
    `subcells` (depth + 1), `forward_resident` / `backward_resident` stay in shared memory, and the others take
    `forward_spill` / `backward_spill` bytes of global memory (every block's), at most a share of `l2_cache` (the
    driver's: half). `cluster`: the cluster form, `groups` thread-block clusters of `grid` blocks each, whose barrier is
    the cluster's, each cluster the whole layer for ceil(batch / groups) rows of the batch (else one block per SM and
    the grid's barrier; docs/design/persistent_recurrence.md, "Clusters of batch rows"). `forward_stage` /
    `backward_stage`: with FMA products, the columns of each batch row of the vectors every product reads (the state;
    the gradients, as long as the longest U-path) that the block stages in the shared memory the matrices leave (at most
    32 KB: whole rows, or a multiple of 32 columns at a time; 0: none, the products read them from global memory).
    `multicast` > 1: the grid form in thread-block clusters of that many blocks, which read each chunk of the stage from
    L2 once a cluster (docs/design/persistent_recurrence.md, "The stage read once a cluster"); 1: each block its own."""

    fits: bool
    grid: int
    slice: int
    forward_bytes: int
    backward_bytes: int
    shared_memory: int
    multiprocessors: int
    tensor_cores: bool
    subcells: int = 1
    forward_resident: int = 1
    backward_resident: int = 1
    forward_spill: int = 0
    backward_spill: int = 0
    l2_cache: int = 0
    cluster: bool = False
    forward_stage: int = 0
    backward_stage: int = 0
    multicast: int = 1
    groups: int = 1

    def __str__(self) -> str:
        kb = lambda n: f"{n / 1024:.0f}"   # noqa: E731
        mib = lambda n: f"{n / 2 ** 20:.1f}"   # noqa: E731
        need = (f"{kb(self.forward_bytes)} / {kb(self.backward_bytes)} KB of shared memory a block (forward / "
                f"backward) of {kb(self.shared_memory)} KB")
        if self.forward_spill or self.backward_spill:
            need += (f"; the matrices of {self.subcells - self.forward_resident} / "
                     f"{self.subcells - self.backward_resident} of {self.subcells} sub-cells read from L2 "
                     f"({mib(self.forward_spill)} / {mib(self.backward_spill)} MiB of the "
                     f"{self.l2_cache // _C.PERSISTENT_SPILL_L2_SHARE // 2 ** 20} MiB allowed)")
        staged = self.forward_stage or self.backward_stage
        products = ("tensor cores" if self.tensor_cores else "FMA" if not staged else
                    f"FMA, staging {self.forward_stage or 'none'} / {self.backward_stage or 'none'} columns a row")
        form = ((", one cluster" if self.groups == 1 else f", {self.groups} clusters each of its own batch rows")
                if self.cluster else
                f", in clusters of {self.multicast} reading the stage once" if self.multicast > 1 else "")
        if self.fits:
            return f"persistent{form}: {self.grid} blocks of {self.slice} units; {need}; {products}"
        return f"per-step: {self.grid} blocks of {self.slice} units would need {need}; {products}"


def _device_limits(device) -> tuple:
    """(SMs, shared memory a block may opt into, compute capability major, L2 bytes) of a CUDA device (None: the
    current one)."""
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: give multiprocessors and shared_memory (an H100 / H200: 132 and 232448)")
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else torch.device(device))
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin is None:
        raise ValueError("this torch does not report the device's opt-in shared memory: give shared_memory")
    return props.multi_processor_count, optin, props.major, getattr(props, "L2_cache_size", 0)


# Bounds of the numbers persistent_plan takes from the caller (the extension's own bounds for the layer's sizes):
# beyond any device, and within the int64 arithmetic of the plan.
_MOST_MULTIPROCESSORS = 1 << 16
_MOST_BYTES = 1 << 48


def _check_count(name: str, value, low: int, high: int, what: str = "") -> None:
    """ValueError naming `name` unless `value` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low:,} to {high:,}{what}, got {value!r}")


def persistent_plan(cell: str, depth: int, batch: int, hidden: int, dtype: Union[torch.dtype, str] = torch.float32,
                    *, device: Optional[Union[int, str, torch.device]] = None, multiprocessors: Optional[int] = None,
                    shared_memory: Optional[int] = None, tensor_cores: Optional[bool] = None,
                    l2_cache: Optional[int] = None, cluster: int = 0, multicast: int = 1) -> PersistentPlan:
    """The persistent plan of one direction of a layer: base `cell` ("gru", "lgru", "lau", "atr") with `depth`
    T-GRUs, `batch` rows, `hidden` units, `dtype` storage. The device's SM count and the shared memory a block may
    opt into come from `device` (a CUDA device; default the current one), or are given (`multiprocessors`,
    `shared_memory` in bytes: an H100 / H200 has 132 and 232,448) where no GPU is at hand; so does the L2's size
    (`l2_cache`, bytes: 52,428,800 on an H100; given numbers without it: 0, no matrix read from L2).
    `tensor_cores` defaults to the driver's choice at this moment (torch's TF32 flag for float32; a device of compute
    capability 8.0 or up, assumed where none is given; never under DTMT_CUDA_PRODUCTS=fma, a benchmarks' setting). `cluster` > 0: the cluster form, thread-block clusters of at
    most that many blocks (16 on an H100 / H200, the driver's choice under DTMT_CUDA_RECURRENCE=persistent-cluster;
    compute capability 9.0 and up) instead of one block per SM, as many as `multiprocessors` hold up to one a batch
    row, each cluster its own rows. `multicast` > 1: the grid form in
    thread-block clusters of that many blocks reading the FMA products' stage once a cluster (the driver's 2 under
    DTMT_CUDA_RECURRENCE=persistent-multicast): a grid of whole clusters, every block owning units; 1 with tensor
    cores, or where no such grid exists. A ValueError names an argument out of range: the plan covers depth <= 64,
    batch <= 2^24, hidden <= 2^20 (the driver runs larger layers per step)."""
    if _C is None:
        raise RuntimeError("dtmt_kernels: the compiled extension did not load; the persistent plan is its arithmetic")
    if cell not in CELL_KINDS:
        raise ValueError(f"cell must be one of {', '.join(CELL_KINDS)}, got {cell!r}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    _check_count("depth", depth, 0, _C.PERSISTENT_PLAN_MAX_DEPTH, " (deeper layers run per step)")
    _check_count("batch", batch, 1, _C.PERSISTENT_PLAN_MAX_ROWS)
    _check_count("hidden", hidden, 1, _C.PERSISTENT_PLAN_MAX_HIDDEN)
    major = 8
    if multiprocessors is None or shared_memory is None:
        sms, optin, major, l2 = _device_limits(device)
        multiprocessors = sms if multiprocessors is None else multiprocessors
        shared_memory = optin if shared_memory is None else shared_memory
        l2_cache = l2 if l2_cache is None else l2_cache
    l2_cache = 0 if l2_cache is None else l2_cache
    _check_count("multiprocessors", multiprocessors, 1, _MOST_MULTIPROCESSORS)
    _check_count("shared_memory", shared_memory, 0, _MOST_BYTES, " (bytes a block may opt into)")
    _check_count("l2_cache", l2_cache, 0, _MOST_BYTES, " (bytes)")
    _check_count("cluster", cluster, 0, _C.PERSISTENT_CLUSTER_MAX_BLOCKS,
                 " (blocks of one thread-block cluster; 0: the grid form)")
    _check_count("multicast", multicast, 1, _C.PERSISTENT_CLUSTER_MAX_BLOCKS,
                 " (blocks of a cluster sharing the stage, in the grid form: not with cluster)")
    if multicast > 1 and cluster:
        raise ValueError(f"multicast must be 1 with cluster (the stage is shared in the grid form), got {multicast}")
    if tensor_cores is not None and not isinstance(tensor_cores, bool):
        raise ValueError(f"tensor_cores must be True, False or None (the driver's choice), got {tensor_cores!r}")
    storage = torch.empty((), dtype=dtype).element_size()
    if tensor_cores is None:   # the driver's rule (16-bit always, float32 where TF32 is allowed, float64 never)
        tensor_cores = _C.persistent_tensor_cores(storage, major) and os.environ.get("DTMT_CUDA_PRODUCTS") != "fma"
    accumulation = 8 if dtype == torch.float64 else 4
    (grid, slice_, fwd, bwd, fits, fres, bres, fspill, bspill, in_cluster, fstage, bstage, shared,
     groups) = _C.persistent_plan(KINDS[cell], depth, batch, hidden, storage, accumulation, multiprocessors,
                                  shared_memory, tensor_cores, _C.PERSISTENT_THREADS, l2_cache, cluster, multicast)
    return PersistentPlan(bool(fits), grid, slice_, fwd, bwd, shared_memory, multiprocessors, tensor_cores, depth + 1,
                          fres, bres, fspill, bspill, l2_cache, bool(in_cluster), fstage, bstage, shared, groups)


def persistent_launches() -> dict:
    """How many of this process's cuda-backend forwards and backwards ran as persistent launches, in the grid form
    (`grid`), in the cluster form (`cluster`) and in the grid form's clusters that read the stage once a cluster
    (`multicast`), and how many persistent launches the device refused (`refused`: the grid form or the per-step
    path ran instead); of those that ran, how many had their products on tensor cores (`tensor_cores`; the others on
    FMA); and how many ran the per-step path although DTMT_CUDA_RECURRENCE asked for the persistent launches
    (`steps`: a layer past the plan, or one the device refused; each such layer shape is also named once in a
    warning). Without DTMT_CUDA_RECURRENCE the per-step runs are not counted. All zero where the extension has no
    CUDA kernels. Which form and products ran, for the GPU tests and benchmarks/bench_persistent.py."""
    names = ("grid", "cluster", "refused", "multicast", "tensor_cores", "steps")
    if _C is None or not getattr(_C, "has_cuda", False):
        return dict.fromkeys(names, 0)
    return dict(zip(names, _C.persistent_launches()))


ENVELOPE_LAYERS = (("GRU", "gru", 0), ("ATR", "atr", 0), ("DT d4 (L-GRU + 4 T-GRUs)", "lgru", 4))
ENVELOPE_MODES = (("fp32 strict", torch.float32, False), ("TF32", torch.float32, True), ("bf16", torch.bfloat16, True))
ENVELOPE_HIDDEN = (256, 512, 768, 1024, 2048)


def envelope_table(multiprocessors: int, shared_memory: int, batch: int = 64, l2_cache: int = 0,
                   cluster: int = 0) -> str:
    """A markdown table: for each layer and math mode, the largest of ENVELOPE_HIDDEN that fits the persistent
    launches at `batch` rows (`cluster` > 0: their cluster form, clusters of at most that many blocks each of its own
    batch rows), with its
    forward / backward KB a block and, where matrices are read from L2, the sub-cells that are, forward / backward
    (— where none fits)."""
    lines = [f"| layer | {' | '.join(name for name, _, _ in ENVELOPE_MODES)} |",
             "|---|" + "---|" * len(ENVELOPE_MODES)]
    for label, cell, depth in ENVELOPE_LAYERS:
        cells = []
        for _, dtype, tc in ENVELOPE_MODES:
            best = None
            for H in ENVELOPE_HIDDEN:
                plan = persistent_plan(cell, depth, batch, H, dtype, multiprocessors=multiprocessors,
                                       shared_memory=shared_memory, tensor_cores=tc, l2_cache=l2_cache,
                                       cluster=cluster)
                if plan.fits:
                    best = (H, plan)
            if best is None:
                cells.append("—")
                continue
            H, plan = best
            spilled = (f"; {plan.subcells - plan.forward_resident} / {plan.subcells - plan.backward_resident} "
                       f"from L2" if plan.forward_spill or plan.backward_spill else "")
            cells.append(f"H ≤ {H} ({plan.forward_bytes / 1024:.0f} / {plan.backward_bytes / 1024:.0f} KB{spilled})")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)
