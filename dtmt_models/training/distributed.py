"""Process-group bookkeeping for `dtmt train` (DistributedDataParallel under torchrun): rank, world size,
device, and the few collectives the trainer uses."""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import List, Optional

import torch


def _count(name: str, default: str) -> int:
    """The whole number in environment variable `name` (`default` where unset); ValueError naming it otherwise."""
    value = os.environ.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value}: not a whole number (torchrun sets it; unset it to train in one "
                         f"process)") from None


def world_size() -> int:
    """The number of training processes (torchrun's WORLD_SIZE; 1 without it)."""
    return _count("WORLD_SIZE", "1")


def rank() -> int:
    """This process's rank in the run (torchrun's RANK; 0 without it)."""
    return _count("RANK", "0")


def check_environment() -> None:
    """The launch variables checked before anything else: WORLD_SIZE at least 1, RANK in [0, WORLD_SIZE),
    LOCAL_RANK at least 0, each a whole number; ValueError naming the variable. A RANK left in the shell without
    WORLD_SIZE (a single process, rank 0) had made the run a follower of a main process that did not exist: it
    trained and wrote nothing, exit 0; WORLD_SIZE=0 had failed in a traceback."""
    world, own, local = world_size(), rank(), _count("LOCAL_RANK", "0")
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world}: the number of processes is at least 1")
    if not 0 <= own < world:
        raise ValueError(f"RANK={own} with WORLD_SIZE={world}: a rank in [0, {world}) is needed"
                         + ("" if "WORLD_SIZE" in os.environ else " (a single process is rank 0: unset RANK, or "
                            "start the run's processes with torchrun)"))
    if local < 0:
        raise ValueError(f"LOCAL_RANK={local}: a process's rank on its machine is at least 0")


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


ENDED = "\0ended"   # a process's outcome where it ended before saying one (Meeting.leave)
NOTE_AFTER_S = 30.0   # a process still waiting for the others of the run says so after this long, and again as long
TIMEOUT_S = 1800.0    # the longest wait for them (torch's own for a process group's setup)
READ_WAIT_S = 10.0    # how long process 0 keeps its store for the others to read the outcomes
CONNECT_S = 60.0      # how long a process gives process 0's store to answer once something accepts at its address


def by_hand() -> bool:
    """Whether the run's processes were started by hand (each with RANK, MASTER_ADDR, ...: a Slurm script, say), not
    by torchrun, which ends the others when one ends."""
    return world_size() > 1 and not os.environ.get("TORCHELASTIC_RUN_ID")


class Meeting:
    """The processes of a run started by hand meet first, on the store their process group is later made on
    (process 0 holds it, fresh each launch), and tell each other the outcome of their checks (`settle`) before the
    group is started. A refusal that one process made alone (process 0's run lock held, one --out without last.pt,
    one command line mistyped) had left the others waiting in init_process_group, deaf to Ctrl-C, for half an hour;
    each had also printed the refusal that all of them made. Waiting here is a poll (Ctrl-C ends it) that says after
    NOTE_AFTER_S whom it waits for. (Under torchrun there is no meeting: torchrun ends the others itself, and its
    agent's store outlives a restart, whose count each node keeps apart: the attempts' keys could not be told
    apart.)"""

    def __init__(self):
        self.rank, self.world = rank(), world_size()
        self.settled = False
        self._noted = 0.0
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise ValueError(f"WORLD_SIZE={self.world}: {' and '.join(missing)} not set; start the run's processes "
                             f"with torchrun, or set RANK, MASTER_ADDR and MASTER_PORT in each")
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        if not port.isdigit() or not 0 < int(port) < 65536 or not 0 <= self.rank < self.world:
            raise ValueError(f"MASTER_PORT={port} RANK={self.rank} WORLD_SIZE={self.world}: a port in [1, 65535] "
                             f"and a rank in [0, WORLD_SIZE) are needed")
        import torch.distributed as td

        holder = self.rank == 0
        started = time.monotonic()
        while not holder and not self._reachable(host, int(port)):   # (a client's own connect loop is deaf to
            self._waiting(started, f"process 0 at {host}:{port}")       # Ctrl-C and logs each failed try)
            time.sleep(0.2)
        try:
            self.store = self._connect(td, host, int(port), holder)
        except RuntimeError as exc:   # (a port in use, a host that does not resolve: c10d's message and frames)
            raise ValueError(f"MASTER_ADDR={host} MASTER_PORT={port}: cannot "
                             f"{'listen there' if holder else 'reach process 0 there'} "
                             f"({str(exc).strip().splitlines()[0][:200]})") from None
        self.keys = td.PrefixStore("dtmt-train", self.store)

    @staticmethod
    def _connect(td, host: str, port: int, holder: bool):
        """The TCPStore, made on a thread that this one waits for in a poll (Ctrl-C ends it): a client's handshake
        with something at the address that is not a store (another program's port) waited in c10d for half an hour,
        deaf to Ctrl-C and SIGTERM and to its own time-out. ValueError after CONNECT_S without an answer."""
        made: dict = {}

        def connect():
            try:
                made["store"] = td.TCPStore(host, port, None, holder, datetime.timedelta(seconds=TIMEOUT_S),
                                            wait_for_workers=False, multi_tenant=True)
            except BaseException as exc:   # (given to the waiting thread)
                made["error"] = exc

        thread = threading.Thread(target=connect, name="dtmt-store-connect", daemon=True)
        thread.start()
        started = time.monotonic()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and time.monotonic() - started > CONNECT_S:
                raise ValueError(f"MASTER_ADDR={host} MASTER_PORT={port}: something accepts connections there but "
                                 f"did not answer as process 0's store in {CONNECT_S:.0f} s (another program's "
                                 f"port?)")
        if "error" in made:
            raise made["error"]
        return made["store"]

    @staticmethod
    def _reachable(host: str, port: int) -> bool:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except socket.gaierror as exc:   # (a MASTER_ADDR that names no host: no use waiting for it)
            if exc.errno == socket.EAI_AGAIN:   # (the name server did not answer yet: try again)
                return False
            raise ValueError(f"MASTER_ADDR={host}: {exc.strerror or exc}") from None
        except OSError:
            return False

    def _waiting(self, started: float, whom: str) -> None:
        waited = time.monotonic() - started
        if waited > TIMEOUT_S:
            raise ValueError(f"process {self.rank} of {self.world}: {whom} did not start in {TIMEOUT_S:.0f} s; "
                             f"start every process of the run")
        if waited >= self._noted + NOTE_AFTER_S:
            self._noted = waited
            print(f"dtmt train: process {self.rank} of {self.world}: waiting for {whom} to start ({waited:.0f} s)",
                  file=sys.stderr, flush=True)

    def _wait_for(self, keys: List[str], whom) -> None:
        started, self._noted = time.monotonic(), 0.0
        while True:
            try:   # (one request while all are there; one a key only to name those missing)
                missing = [] if self.keys.check(keys) else [k for k in keys if not self.keys.check([k])]
            except RuntimeError:   # (the store's holder, process 0, is gone)
                raise ValueError(f"process {self.rank} of {self.world}: process 0 ended before the run started; its "
                                 f"own messages say why") from None
            if not missing:
                return
            self._waiting(started, whom(missing))
            time.sleep(0.05)

    def _outcomes(self) -> List[str]:
        """Every process's outcome, once all have said theirs (a wait)."""
        names = [f"outcome/{r}" for r in range(self.world)]
        self._wait_for(names, lambda missing: "process(es) " + ", ".join(k.split("/")[1] for k in missing))
        return [v.decode("utf-8", "replace") for v in self.keys.multi_get(names)]

    def settle(self, refusal: Optional[str]) -> List[str]:
        """Says this process's outcome (`refusal`, one line, or None where its checks passed) and returns every
        process's ("" where it passed, ENDED where it ended before saying one), once all have said theirs. A wait
        that ends otherwise (Ctrl-C, the time out, process 0 gone) leaves ENDED said for this process: the others
        must not start without it."""
        try:   # (an interruption as early as the saying leaves ENDED said, and this process settled)
            self.keys.set(f"outcome/{self.rank}", refusal or "")
            outcomes = self._outcomes()
        except BaseException:
            self._say_ended()
            raise
        self.settled = True
        self._read()
        return outcomes

    def _say_ended(self) -> None:
        self.settled = True
        try:
            self.keys.set(f"outcome/{self.rank}", ENDED)
        except RuntimeError:   # (process 0 gone: nobody left to tell)
            pass

    def _read(self) -> None:
        """Says this process has read the outcomes; process 0 waits (a little) for the others to read them before
        it may end, and its store with it."""
        self.keys.set(f"read/{self.rank}", "")
        if self.rank == 0:
            deadline = time.monotonic() + READ_WAIT_S
            while time.monotonic() < deadline and not self.keys.check([f"read/{r}" for r in range(self.world)]):
                time.sleep(0.05)

    def leave(self, wait: bool = True) -> None:
        """For a process that ends before its outcome was said (a usage error, --help, an interruption): says it
        ended, so that the others stop too; process 0, which holds the store, first waits for the others to say
        theirs and read it (they would otherwise wait for it for half an hour), unless not `wait` (Ctrl-C: it had
        waited on for processes never started). Best effort."""
        if self.settled:
            return
        self._say_ended()
        try:
            if self.rank == 0 and wait:
                self._outcomes()
                self._read()
        except (RuntimeError, ValueError, KeyboardInterrupt):
            pass

    def timeout_for(self, backend: str) -> None:
        """The store's waits from here on as torch's own for `backend`'s process group (10 minutes for NCCL)."""
        from torch.distributed import constants

        self.store.set_timeout(constants.default_pg_nccl_timeout if backend == "nccl" and
                               constants.default_pg_nccl_timeout is not None else constants.default_pg_timeout)


class RefusedByAll(ValueError):
    """A refusal that every process of the run makes alike, after they met (their settings compared): printed by
    process 0 alone."""


def refusal_line(outcomes: List[str], rank: int) -> Optional[str]:
    """What process `rank` prints of the run's refusals (`outcomes`: Meeting.settle's): its own refusal where no
    process before it made the same one (a refusal every process made is printed once, by process 0); where it
    refused nothing, which process did; None where it has nothing to add."""
    world, own = len(outcomes), outcomes[rank]
    if own and own != ENDED:
        return None if own in outcomes[:rank] else own
    if own == ENDED:
        return None
    first = next((r for r, o in enumerate(outcomes) if o), None)
    if first is None:
        return None
    did = "ended before the run started" if outcomes[first] == ENDED else "refused the run"
    return f"process {rank} of {world}: not started: process {first} {did} (its own message says why)"


def process_device(device_arg: str) -> torch.device:
    """This process's device for --device `device_arg` (auto resolved; with several processes, cuda is the one of
    LOCAL_RANK); ValueError where there is no such device (checked before the processes meet: a set_device of an
    ordinal past the machine's GPUs failed after the others were told this one's checks had passed)."""
    device_arg = resolve_auto(device_arg)
    local, per_node = _count("LOCAL_RANK", "0"), _count("LOCAL_WORLD_SIZE", "1")
    if device_arg.startswith("cuda:") and per_node > 1 and not by_hand():
        # (torchrun gives every process of a machine the same command line: all had taken that one GPU, and NCCL
        # failed at the first collective in a traceback)
        raise ValueError(f"--device {device_arg} with {per_node} processes a machine: each would take that one GPU; "
                         f"give --device cuda (each process takes the GPU of its LOCAL_RANK; CUDA_VISIBLE_DEVICES "
                         f"chooses which)")
    if device_arg == "cuda" and world_size() > 1:
        device_arg = f"cuda:{local}"
    device = torch.device(device_arg)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if device.index is None:   # "cuda": the current device, named (set_device needs an index)
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
                             + (f" (LOCAL_RANK {local}: start at most that many processes on it)"
                                if world_size() > 1 else ""))
    return device


class Dist:
    """Process-group bookkeeping; a single process is rank 0 of 1 and every collective is a no-op. With several,
    the group is made on the store of their `meeting`."""

    def __init__(self, device_arg: str, meeting: Optional[Meeting] = None):
        self.world = world_size()
        self.rank = rank()
        self.device = process_device(device_arg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world > 1:
            import torch.distributed as td

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if meeting is None:
                td.init_process_group(backend)
            else:
                meeting.timeout_for(backend)
                td.init_process_group(backend, store=td.PrefixStore("default_pg", meeting.store), rank=meeting.rank,
                                      world_size=meeting.world)
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
