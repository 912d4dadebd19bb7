"""Where a decoder step's weights live: one buffer of 2 MiB pages (Linux transparent huge pages).

A decoder step at batch 1 reads ~10 MB of weights (dtmt small), more than a core's L2, so the small-row products
stream them from L3 or memory (why: docs/design/cpu_kernels.md, "Weights on 2 MiB pages"). In ordinary 4 KiB
pages those bytes span ~2,400 pages, more than the CPU's second-level TLB holds, so the stream also walks page
tables; in 2 MiB pages they are five. `huge_page_copies` puts copies of the tensors one after another (each at a
4 KiB boundary) in one anonymous private mapping aligned to 2 MiB and advised MADV_HUGEPAGE. The values are copied
bit for bit, so every product over them gives the same result. Where the system offers no such advice (not Linux,
or Python without mmap.MADV_HUGEPAGE) or the tensors are not on the CPU, the tensors come back as they are; whether
the kernel then backs the advised range with huge pages is the system's choice
(/sys/kernel/mm/transparent_hugepage/enabled: `madvise` or `always`)."""
from __future__ import annotations

import mmap
from typing import List, Sequence

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
_PAGE = 4096


def huge_pages_offered() -> bool:
    """True where huge_page_copies can advise huge pages (Linux with Python's mmap.MADV_HUGEPAGE)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def huge_page_copies(tensors: Sequence[Tensor]) -> List[Tensor]:
    """Copies of `tensors` (CPU, any dtypes and shapes, made contiguous; empty ones stay as they are) in one
    2 MiB-aligned mapping advised for transparent huge pages, in the order given; the tensors themselves where
    huge pages are not offered (huge_pages_offered) or one of them is not on the CPU. The copies are plain
    tensors sharing one storage, which keeps the mapping alive; they are not resizable."""
    tensors = list(tensors)
    if not tensors or not huge_pages_offered() or any(t.device.type != "cpu" for t in tensors):
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    spans = [(n + _PAGE - 1) // _PAGE * _PAGE for n in sizes]
    total = sum(spans)
    if total == 0:
        return tensors
    length = (total + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE + HUGE_PAGE   # room to align the start
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena = torch.frombuffer(region, dtype=torch.uint8)   # holds a reference to `region`
    offset = (-arena.data_ptr()) % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, length - offset)   # before the first touch: faults take huge pages
    out = []
    for t, n, span in zip(tensors, sizes, spans):
        if n == 0:
            out.append(t)
            continue
        view = arena[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        out.append(view)
        offset += span
    return out
