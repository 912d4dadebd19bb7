"""What the CUDA source tests share (test_cuda_compile.py: nvcc on the device kernels and the probes;
test_cuda_sources.py: nvcc on the ATen drivers and the emulated kernels): where csrc/ and nvcc are, and a compile run
whose failure, or any warning it gives about csrc/, fails the test."""
import functools
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def _nvcc():
    path = shutil.which("nvcc")
    if path is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidate = os.path.join(home, "bin", "nvcc")
        path = candidate if os.path.exists(candidate) else None
    return path


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")


def check_compile(cmd, returncode, stdout, stderr):
    """A compiler's exit status 0 and no warning about a file of csrc/ (torch's own headers' are not ours)."""
    assert returncode == 0, f"{' '.join(cmd)}\n{stdout}\n{stderr}"
    ours = [line for line in stderr.splitlines() if "warning" in line and CSRC in line]
    assert not ours, "\n".join(ours)


def run_compile(cmd, timeout=900):
    """Runs a compiler command and checks it (check_compile); returns its CompletedProcess."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    check_compile(cmd, res.returncode, res.stdout, res.stderr)
    return res


@functools.lru_cache(maxsize=None)
def fastest(stage, level="max"):
    """nvcc's flags for a fast-compile level of `stage` ("ptxas": the assembler only; "all": cicc's optimizer too)
    where this toolkit has it (--Ofast-compile, CUDA 12.8 and later), else none. `level`: "max" (the fastest),
    "mid" or "min"."""
    if NVCC is None:
        return []
    usage = subprocess.run([NVCC, "--help"], capture_output=True, text=True).stdout
    if "--Ofast-compile" not in usage:
        return []
    return ["-Xptxas", f"--Ofast-compile={level}"] if stage == "ptxas" else [f"--Ofast-compile={level}"]
