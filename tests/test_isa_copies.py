"""Every instruction-set copy of the CPU loops tested on every machine (issue 70).

setup.py compiles csrc/isa/ once per instruction set (baseline x86-64, AVX2, AVX-512) and the library loads the best
copy the CPU runs, so the rest of the suite tests that one copy only: on an AVX-512 machine the AVX2 copy, which an
AVX2-only CPU (AMD Zen 2/3, many desktops) runs, would go untested. Here the kernel tests (the transition cells
forward and backward, the attention and loss loops, the decoding step and search, the small-row and int8 products)
run again, once for each other copy this CPU can execute, in a process started with DTMT_CPU_ISA naming it; the
process checks that the copy it runs is the one asked for (conftest.py, DTMT_EXPECT_CPU_ISA) and the whole file
list must pass there. The tests that compare copies in one process (test_cpu_dispatch.py, the int8 tests
parametrized by copy) stay as they are.
"""
import os
import subprocess
import sys

import pytest

import dtmt_kernels as dk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the tests of the loops that have a copy per instruction set
KERNEL_TEST_FILES = ("test_cpp_kernels.py", "test_attention_kernel.py", "test_loss.py", "test_decode_kernels.py",
                     "test_beam_search.py", "test_int8.py")
# not rerun: a test that starts its own pytest process for the avx512 copy (test_int8's loop without VNNI), and the
# search's step bound on a Python table model (no loop of a copy in it; 12 s a copy)
NOT_RERUN = "not int8_loop_without_vnni and not never_ends_stops_at_the_search_s_step_bound"


def _other_copies():
    if "cpp" not in dk.available_backends():
        return []
    from dtmt_kernels import _C

    return [isa for isa in _C.supported_cpu_isas() if isa != _C.cpu_isa()]


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
@pytest.mark.parametrize("isa", _other_copies() or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs one instruction set copy"))])
def test_kernel_tests_pass_on_every_copy(isa):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    # one thread, as the suite's workers (conftest.py): the tests of two threads set theirs
    env.update(DTMT_CPU_ISA=isa, DTMT_EXPECT_CPU_ISA=isa, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-k", NOT_RERUN, *[os.path.join("tests", f) for f in KERNEL_TEST_FILES]],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, f"DTMT_CPU_ISA={isa}:\n{tail}"
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
