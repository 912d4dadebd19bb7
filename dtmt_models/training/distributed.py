"""Process-group bookkeeping for `dtmt train` (DistributedDataParallel under torchrun): rank, world size,
device, and the few collectives the trainer uses."""
from __future__ import annotations

import os
import time
from typing import List, Optional

import torch


def world_size() -> int:
    """The number of training processes (torchrun's WORLD_SIZE; 1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_auto(device_arg: str) -> str:
    """--device auto: cuda where a CUDA device is available, else cpu; any other value as it is."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device_arg == "auto" else device_arg


def lost_peer(exc: BaseException) -> Optional[str]:
    """Where `exc` is a collective's failure because another process of the run is gone (gloo's "Connection closed
    by peer" or "reset by peer"), its reason in a line; else None."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and "gloo" in text and ("closed by peer" in text or "reset by peer" in text)):
        return None   # (another failure of a collective, NCCL's or this process's own, keeps its traceback)
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    line = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line   # (gloo's source file)
    return line.split(". ", 1)[0].rstrip(".")


class Dist:
    """Process-group bookkeeping; a single process is rank 0 of 1 and every collective is a no-op."""

    def __init__(self, device_arg: str):
        self.world = world_size()
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device_arg = resolve_auto(device_arg)
        if device_arg == "cuda" and self.world > 1:
            device_arg = f"cuda:{local}"
        self.device = torch.device(device_arg)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is available")
            if self.device.index is None:   # "cuda": the current device, named (set_device needs an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        if self.world > 1:
            import torch.distributed as td

            td.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self.td = td

    @property
    def main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        self.td.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.td.all_gather_object(out, obj)
        return out

    def sum(self, values: List[float]) -> List[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.td.all_reduce(t)
        return t.tolist()

    def close(self, barrier: bool = True):
        """Ends the process group. First a barrier (`barrier`: where every process ends alike; after an error in
        this one alone, the others are still in the run and would never meet it), then a pause that lets gloo's
        worker threads finish freeing the last collectives' tensors: freeing one that Python created takes the GIL,
        and the process group's destructor (run later, when DDP's reducer is freed, with the GIL held) joins those
        threads, so a thread still freeing one then would wait for the GIL forever (seen as a hang at exit under
        load)."""
        if self.world > 1 and self.td.is_initialized():
            if barrier:
                self.td.barrier()
            time.sleep(0.2)   # releases the GIL
            self.td.destroy_process_group()
