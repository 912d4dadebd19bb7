"""What every benchmark here shares: the one way it names its machine (`machine_name`, `machine_record`), records
the commit it measured (`commit`), names a run in its output (`provenance`, `provenance_line`), checks its options
before any work (`check_options`, `make_out_dir`, `check_checkpoint`), times a call (`time_fn`), runs on a given
thread count (`torch_threads`) and writes its results (`write_csv`, `write_json`, and `write_report` for a table as
NAME.md with its figures as NAME.json). Each script keeps its own plot (matplotlib, optional).

    from common import machine_name, write_csv      # a script run from this folder (HERE on sys.path)
    from benchmarks.common import torch_threads     # the tests
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's thread count set to `threads` for the block and restored after it (a benchmark's main called from
    the tests must not leave the test process on another count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# The instruction-set flags of /proc/cpuinfo that change what the GEMMs and dtmt's loops run.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8")


def machine_record() -> dict:
    """What makes two CPU timings comparable, as a dict: the CPU's identity from /proc/cpuinfo (vendor, family,
    model, stepping, model name: a VM can give different CPUs one model name; without /proc/cpuinfo or its model
    name, the platform's processor name), its instruction-set flags (ISA_FLAGS), the core count, torch's version
    and the copy of dtmt's loops (setup.py builds one per instruction set). Equal records: the same kind of
    machine; `machine_name()` is the line a table prints."""
    import dtmt_kernels as dk

    cpu: dict = {}
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key in ("vendor_id", "cpu family", "model", "model name", "stepping") and key not in cpu:
                    cpu[key] = value
                elif key == "flags" and not flags:
                    flags = set(value.split())
                elif not key and cpu:   # the first processor's block has ended
                    break
    except OSError:
        pass
    cpu.setdefault("model name", platform.processor() or platform.machine())
    loops = None
    if "cpp" in dk.available_backends():
        from dtmt_kernels import _C
        loops = _C.cpu_isa()
    return dict(cpu, isa=[f for f in ISA_FLAGS if f in flags], cores=os.cpu_count(), torch=torch.__version__,
                dtmt_loops=loops)


def machine_name(device: str = "cpu", threads: bool = True) -> str:
    """The machine in words for a result's header; `threads=False` leaves out torch's thread count (for a table
    that names the threads of each row itself)."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        try:
            import triton
            tri = f", triton {triton.__version__}"
        except ImportError:
            tri = ""
        return (f"{props.name} ({props.total_memory / 2 ** 30:.0f} GiB), CUDA {torch.version.cuda}, "
                f"torch {torch.__version__}{tri}")
    rec = machine_record()
    loops = f", dtmt CPU loops {rec['dtmt_loops']}" if rec["dtmt_loops"] else ""
    count = f", {torch.get_num_threads()} threads" if threads else ""
    return f"{rec['model name']}, {rec['cores']} cores, torch {rec['torch']}{count}{loops}"


def commit() -> str:
    """The repository's commit (`git rev-parse --short HEAD`), with "+dirty" where tracked files differ from it
    (`git status --porcelain --untracked-files=no` lists any), or "unknown" where git cannot say."""
    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    out = git("rev-parse", "--short", "HEAD")
    if not out:
        return "unknown"
    return out + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def provenance(script: str, argv=None, device: str = "cpu") -> dict:
    """What names a benchmark's run, for the header it prints first and the files it writes: `machine` (the CPU's
    model name and cores; with `device` cuda and a GPU present, the GPU's name first), `commit` (`commit()`: "+dirty"
    for uncommitted changes), `date` (UTC, to the second), `torch` (its version) and `command` (`python` and
    `script`'s path from the repository's root, then `argv`, or this process's arguments where `argv` is None: a
    main() called from the tests passes its own)."""
    rec = machine_record()
    machine = f"{rec['model name']}, {rec['cores']} cores"
    if str(device).startswith("cuda") and torch.cuda.is_available():
        machine = f"{torch.cuda.get_device_name(0)}; host {machine}"
    args = sys.argv[1:] if argv is None else list(argv)
    path = os.path.relpath(os.path.abspath(script), ROOT)
    return {"machine": machine, "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "torch": torch.__version__, "command": " ".join(shlex.quote(a) for a in ["python", path, *args])}


def provenance_line(record: dict) -> str:
    """`record` (`provenance`) as one line beginning "# run: ", the first line a benchmark prints and the comment
    line that opens its CSV files (`write_csv`'s `comment`)."""
    return (f"# run: {record['machine']}; commit {record['commit']}; {record['date']}; torch {record['torch']}; "
            f"command: {record['command']}")


def check_options(parser, args, bounds=(), systems=None, device=None) -> None:
    """A benchmark's options checked before anything runs or is written, each refused in one line by `parser.error`
    (exit 2): `bounds`, (attribute, lowest) or (attribute, lowest, highest), the value an int or a list of them (a
    count of 0 ended in a division by zero or an empty median, after a CSV had been replaced); `systems`,
    (attribute, the known names); `device`, the attribute naming a torch device (cuda without one: torch's
    assertion). NaN and infinities are out of every bound. A bound's value None (an option not given, without a
    default) is not checked."""
    for name, low, *high in bounds:
        value = getattr(args, name)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is None:
                continue
            finite = math.isfinite(v)   # (NaN passed both comparisons: a NaN time limit sent no request)
            if not (finite and v >= low and (not high or v <= high[0])):
                parser.error(f"--{name.replace('_', '-')} {v}: must be {'' if finite else 'a finite number '}>= {low}"
                             + (f" and <= {high[0]}" if high else ""))
    if systems is not None:
        name, known = systems
        unknown = [s for s in getattr(args, name) if s not in known]
        if unknown:
            parser.error(f"--{name} {' '.join(unknown)}: not a system (one of {', '.join(sorted(known))})")
    if device is not None:
        text = getattr(args, device)
        try:
            dev = torch.device(text)
        except (RuntimeError, TypeError):
            parser.error(f"--{device} {text}: not a device (cpu or cuda)")
        if dev.type not in ("cpu", "cuda"):
            parser.error(f"--{device} {text}: use cpu or cuda")
        if dev.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--{device} {text}: no CUDA device is available here")


def batch_hidden_sizes(parser, values) -> list:
    """--BH's values (BATCHxHIDDEN, e.g. 64x256) as [(B, H)], each refused in one line by `parser.error` (exit 2)
    unless both are integers >= 1 (int()'s ValueError, a reshape's error for 0, or a child process's traceback)."""
    sizes = []
    for bh in values:
        b, x, h = bh.partition("x")
        if not (x and b.isdigit() and h.isdigit() and int(b) >= 1 and int(h) >= 1):
            parser.error(f"--BH {bh}: expected BATCHxHIDDEN, both >= 1, e.g. 64x256")
        sizes.append((int(b), int(h)))
    return sizes


def make_out_dir(parser, path: str, option: str = "--out") -> str:
    """The output folder `path` made (with its parents) before anything is measured, or refused in one line by
    `parser.error` (exit 2) where it cannot be: a file there, no permission (it had been made after the whole run,
    a FileExistsError's traceback then). Returns `path`."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        parser.error(f"{option} {path}: cannot make this folder ({exc.strerror or exc})")
    return path


# What trains the runs that the decoding benchmarks' default checkpoints come from (benchmarks/out/, which git
# ignores: a checkout has none), for check_checkpoint's `made_by`
PEERS_30M_MADE_BY = ("`python benchmarks/bench_peers.py --systems dtmt --budget 30m --no-eval --out "
                     "benchmarks/out/peers_30m_b` trains that run (best.pt, last.pt, step_NNNNNNN.pt)")
DEV_DTMT_MADE_BY = "`dtmt train --data data/bible --model dtmt --out benchmarks/out/dev_dtmt` trains that run"


def check_checkpoint(parser, path: str, default: str = None, made_by: str = None, option: str = "--checkpoint"
                     ) -> None:
    """`path` checked to be a dtmt checkpoint before anything loads or runs (its settings read, its tensors mapped,
    not read), each problem refused in one line by `parser.error` (exit 2): a missing file, which where `path` is
    the option's `default` (a run trained on the machine of an earlier measurement: a fresh checkout has none) says
    what makes it (`made_by`), or a file that is no checkpoint."""
    if not os.path.isfile(path):
        made = (f" (the default, a local run's, which this checkout lacks: {made_by}; or give {option})"
                if made_by and default is not None and os.path.abspath(path) == os.path.abspath(default) else "")
        parser.error(f"{option} {path}: no such file{made}")
    from dtmt_models.models.checkpoint import read_checkpoint
    try:
        read_checkpoint(path, mmap=True)
    except (OSError, ValueError) as exc:
        parser.error(f"{option} {path}: {exc}")


def _sync(device: str = "cpu"):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def time_fn(fn, repeat: int, device: str = "cpu") -> float:
    """Median seconds of `repeat` calls of `fn` after one warm-up call (CUDA synchronised around each on cuda)."""
    sync = _sync(device)
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _make_folder(path) -> None:
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)


def write_csv(path, rows, columns=None, comment: str = None):
    """`rows` (dicts) as the CSV file `path` (its folder made if needed), one column per name of `columns`, in that
    order (default: every key of the rows, in the order first seen); keys not in `columns` are left out, a row
    without a column's key has it empty. `comment` (a line beginning with "#", e.g. `provenance_line`'s) comes first,
    above the header: a reader skips it (pandas: comment="#"; csv: the lines not beginning with "#"). Returns
    `path`."""
    rows = list(rows)
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    _make_folder(path)
    with open(path, "w", newline="") as f:
        if comment is not None:
            if not comment.startswith("#") or "\n" in comment:
                raise ValueError(f"write_csv: comment must be one line beginning with '#', got {comment!r}")
            f.write(comment + "\n")
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def write_json(path, data):
    """`data` as the JSON file `path` (indent 1; its folder made if needed). Returns `path`."""
    _make_folder(path)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def write_report(out_dir, name: str, text: str, data) -> None:
    """A benchmark's table and its figures as OUT_DIR/NAME.md and OUT_DIR/NAME.json (the folder made if needed)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(out_dir, f"{name}.json"), data)
