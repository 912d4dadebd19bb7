"""The device kernels go through nvcc where no GPU (or no CUDA torch) is present: every kernel of csrc/'s CUDA headers
built for sm_90a and linked without relocatable device code, its PTX read for the memory spaces of the persistent
kernels' loads; the same kernels compiled to PTX for compute capability 8.0 and 7.5 (the preprocessor's other
branches); and the two probes that gpu_session.sh builds on the GPU machine (benchmarks/barrier_probe.cu,
benchmarks/phase_probe.cu) built with its flags. Each test skips with the reason when nvcc is absent. The ATen
drivers' compile and the kernels emulated on the CPU: test_cuda_sources.py. (A file of its own, so that under
pytest-xdist, which gives a worker a file at a time, these minutes of nvcc run beside test_cuda_sources.py's, not
after them.)"""
import os
import re
import subprocess

import pytest

from nvcc_tools import CSRC, NVCC, ROOT, fastest, needs_nvcc, run_compile


KERNELS_TU = r"""
#include "attention_cuda_kernels.cuh"
#include "persistent_cuda_kernels.cuh"
#include "transition_cuda_kernels.cuh"

// DTMT_HD must be __host__ __device__ under nvcc: device code calling the shared functions proves it.
__global__ void uses_cell_math(const float* in, float* out, double* out64) {
  int j = threadIdx.x;
  float r = dtmt::dt_sigmoid(in[j]), dr, dz, dxc, dhc, dh;
  out[j] = dtmt::gru_elem_forward<float>(r, r, in[j], in[j], in[j], 1.0f) + dtmt::dt_tanh(in[j]);
  dtmt::gru_elem_backward<float>(r, r, in[j], in[j], in[j], 1.0f, 1.0f, dr, dz, dxc, dhc, dh);
  out[j] += dr + dz + dxc + dhc + dh + dtmt::atr_elem_forward<float>(in[j], in[j], in[j]);
  double v = dtmt::lau_elem_forward<double>(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 1.0);
  out64[j] = v + dtmt::dt_rsqrt<double>(2.0) + dtmt::dt_tanh(0.5);
}
static_assert(dtmt::cuda::Rows<dtmt::kLGRU>::in == 5 && dtmt::cuda::Rows<dtmt::kTGRU>::hid == 3, "row layout");

namespace dtmt {
namespace cuda {
#define DTMT_INSTANTIATE(T, A)                                                                              \
  template cudaError_t launch_step_forward<T, A>(int, const StepForwardArgs<T, A>&, int, cudaStream_t);   \
  template cudaError_t launch_step_backward<T, A>(int, const StepBackwardArgs<T, A>&, int, cudaStream_t);   \
  DTMT_PERSISTENT_LAUNCHERS(, T, A)
DTMT_INSTANTIATE(float, float)
DTMT_INSTANTIATE(double, double)
DTMT_INSTANTIATE(__nv_bfloat16, float)
#ifdef DTMT_ALL_STORAGE_TYPES
DTMT_INSTANTIATE(__half, float)
#endif
#define DTMT_INSTANTIATE_ATTENTION(A)                                                                   \
  template cudaError_t launch_scores_forward<A>(const ScoresArgs<A>&, cudaStream_t);                    \
  template cudaError_t launch_scores_backward<A>(const ScoresBackwardArgs<A>&, cudaStream_t);           \
  template cudaError_t launch_context_forward<A>(const ContextArgs<A>&, cudaStream_t);                  \
  template cudaError_t launch_context_backward<A>(const ContextBackwardArgs<A>&, cudaStream_t);
DTMT_INSTANTIATE_ATTENTION(float)
DTMT_INSTANTIATE_ATTENTION(double)
}  // namespace cuda
}  // namespace dtmt
"""


@needs_nvcc
def test_nvcc_version():
    res = run_compile([NVCC, "--version"])
    assert re.search(r"release \d+\.\d+", res.stdout), res.stdout


# What each build covers: every preprocessor branch of the kernels once. sm_90a (H100 / H200, as gpu_session.sh builds
# for them): tensor cores, cp.async, the cluster barrier and the stage's multicast, down to machine code (ptxas, the
# linker). compute_80 (Ampere and Ada: A100, RTX 30 / 40, L4): the same without the cluster barrier and the multicast.
# compute_75 (Turing and older): without tensor cores and cp.async. The last two stop at PTX (the form a driver
# compiles on load): ptxas takes two thirds of a build's time, and their code differs from sm_90a's only in what the
# preprocessor leaves out, which cicc has checked by then. Storage types: the PTX builds take all four; the sm_90a
# build float (TF32 products), double (FMA) and bf16, not __half: __half and bf16 are one template (block_mma.cuh's
# Mma16), so __half's machine code would check nothing bf16's does not, for a quarter of the build's minutes.
# Optimization, where the toolkit has levels (--Ofast-compile, CUDA 12.8+): these builds check that the code compiles
# and links, not how fast it runs (setup.py builds at the default -O3). So the sm_90a build's ptxas runs at its
# fastest level (it still assembles every instruction for sm_90a and allocates registers; its PTX, cicc's at -O3, is
# what the named-spaces test reads), and the two PTX builds' cicc at its fastest (the front end and the code
# generation whole, fewer optimization passes). Float persistent kernels on a 2-core Zen 3: ptxas 87 -> 21 s, cicc for
# compute_75 36 -> 6 s.
KERNELS_MAIN = r"""
int main() {   // never run: linking it, without relocatable device code (-rdc) as setup.py builds, is the test
  dtmt::cuda::PersistentForwardArgs<float, float> a{};
  dtmt::cuda::PersistentBackwardArgs<float, float> b{};
  cudaError_t e = dtmt::cuda::launch_persistent_forward<float, float>(dtmt::kLGRU, a, 1, 32, nullptr);
  e = dtmt::cuda::launch_persistent_backward<float, float>(dtmt::kLGRU, b, 1, 32, nullptr);
  return e == cudaSuccess ? 0 : 1;
}
"""


PERSISTENT_KERNELS = 4 * 2 * 4   # (the base cells x forward, backward x the storage types)
SM90A_PERSISTENT_KERNELS = 4 * 2 * 3   # (the sm_90a build's storage types: float, double, bf16)


def _kept_ptx(folder):
    """The text of the PTX files nvcc kept (-keep) in `folder`."""
    return "".join(p.read_text() for p in folder.glob("*.ptx"))


def _kernels(ptx):
    """The names of the kernels (entries) in a PTX text."""
    return set(re.findall(r"^\.visible \.entry (\w+)", ptx, flags=re.M))


@pytest.fixture(scope="module")
def sm90a_build(tmp_path_factory):
    """The kernels of csrc/'s CUDA headers (KERNELS_TU: every kernel for float, double and bf16) with a main, built
    for sm_90a (-DDTMT_SM90A, as setup.py and gpu_session.sh build for an H100 / H200) with the flags setup.py passes
    to nvcc (ptxas at its fastest level: see above KERNELS_MAIN), linked without -rdc; the PTX kept. Returns (the
    program, the PTX's text). Built once for the tests that read it."""
    out = tmp_path_factory.mktemp("sm90a")
    src = out / "kernels_tu.cu"
    src.write_text(KERNELS_TU + KERNELS_MAIN)
    run_compile([NVCC, "-std=c++17", "-O3", "--use_fast_math", "-gencode", "arch=compute_90a,code=sm_90a",
                 *fastest("ptxas"), "-DDTMT_SM90A", "-keep", f"-keep-dir={out}", f"-I{CSRC}", str(src), "-o",
                 str(out / "kernels")])
    return out / "kernels", _kept_ptx(out)


@needs_nvcc
def test_device_kernels_build_and_link_for_sm90a(sm90a_build):
    """cell_math.h + transition_cuda_kernels.cuh + persistent_cuda_kernels.cuh + block_mma.cuh +
    attention_cuda_kernels.cuh: every kernel (5 cell kinds x forward/backward x float, double, bf16, the persistent
    forward and backward of the 4 base cells x the same 3 storage types, the attention's 4 kernels x float and
    double; __half's: the PTX builds below) built to machine code for sm_90a (the tensor-core products: TF32, bf16;
    the cluster barrier; the stage's multicast), and linked into a program without relocatable device code: the persistent kernels' grid barrier
    (cooperative groups' this_grid().sync()) and cooperative launch need no -rdc."""
    program, ptx = sm90a_build
    assert program.stat().st_size > 0
    assert len({k for k in _kernels(ptx) if "persistent_" in k}) == SM90A_PERSISTENT_KERNELS


@needs_nvcc
@pytest.mark.parametrize("arch", ["80", "75"])
def test_device_kernels_compile_to_ptx(tmp_path, arch):
    """The same kernels compiled for compute capability 8.0 (tensor cores and cp.async, without the cluster barrier
    and the multicast: the code an A100 or an RTX 30 / 40 runs) and 7.5 (without tensor cores or cp.async), host code
    and device code as PTX embedded in the object (the form the driver compiles on load), without DTMT_SM90A; every
    storage type (DTMT_ALL_STORAGE_TYPES: __half's kernels too)."""
    src = tmp_path / "kernels_tu.cu"
    src.write_text(KERNELS_TU)
    run_compile([NVCC, "-std=c++17", "-O3", "--use_fast_math", "-gencode", f"arch=compute_{arch},code=compute_{arch}",
                 *fastest("all"), "-DDTMT_ALL_STORAGE_TYPES", "-keep", f"-keep-dir={tmp_path}", "-c", f"-I{CSRC}",
                 str(src), "-o",
                 str(tmp_path / "k.o")])
    assert (tmp_path / "k.o").stat().st_size > 0
    ptx = _kept_ptx(tmp_path)
    assert re.search(rf"^\.target sm_{arch}\b", ptx, flags=re.M)
    assert len({k for k in _kernels(ptx) if "persistent_" in k}) == PERSISTENT_KERNELS
    assert ("wmma.mma.sync" in ptx) == (arch == "80")   # (tensor cores from compute capability 8.0)
    assert ("cp.async.cg." in ptx) == (arch == "80")
    assert "barrier.cluster" not in ptx and "multicast::cluster" not in ptx


@needs_nvcc
def test_barrier_probe_builds(tmp_path):
    """benchmarks/barrier_probe.cu (the persistent kernels' barrier alone, grid and cluster form, and the cooperative
    launch in clusters of the stage read once a cluster: gpu_session.sh's persistent stage builds and runs it on the
    GPU) compiles and links for sm_90a as that stage builds it on an H100 / H200, and for sm_90."""
    probe = os.path.join(ROOT, "benchmarks", "barrier_probe.cu")
    for arch in (["-arch=sm_90a", "-DDTMT_SM90A"], ["-arch=sm_90"]):
        run_compile([NVCC, "-std=c++17", "-O3", *arch, f"-I{CSRC}", probe, "-o", str(tmp_path / "barrier_probe")])
        assert (tmp_path / "barrier_probe").stat().st_size > 0


@needs_nvcc
def test_phase_probe_builds(tmp_path):
    """benchmarks/phase_probe.cu (where a persistent launch's time goes: the kernels with their phase clock,
    DTMT_PERSISTENT_PHASES; gpu_session.sh's persistent stage builds and runs it on the GPU) compiles and links with
    that stage's flags for an H100 / H200 (DTMT_SM90A: its rows of the stage read once a cluster), its device code
    PTX for compute_90a (the same kernels' machine code: test_device_kernels_build_and_link_for_sm90a); its kernels
    read the SM clock (the marks are compiled in: the extension's PTX has none,
    test_persistent_kernels_load_from_named_spaces), and without the flag it refuses to build. cicc at a middle
    fast-compile level (where the toolkit has levels): the stage builds at -O3 on the GPU machine, and this checks
    that the probe compiles, in a quarter of -O3's time (29 -> 8 s on 2 cores of a Sapphire Rapids Xeon); the
    kernels are still inlined, so each keeps its own marks (the count below), as at -O3 (the fastest level leaves
    them in 5 shared functions)."""
    probe = os.path.join(ROOT, "benchmarks", "phase_probe.cu")
    flags = ["-std=c++17", "-O3", "--use_fast_math", "-gencode", "arch=compute_90a,code=compute_90a", "-DDTMT_SM90A",
             f"-I{CSRC}"]
    run_compile([NVCC, *flags, *fastest("all", "mid"), "-DDTMT_PERSISTENT_PHASES", "-keep", f"-keep-dir={tmp_path}",
                 probe, "-o", str(tmp_path / "phase_probe")])
    assert (tmp_path / "phase_probe").stat().st_size > 0
    ptx = _kept_ptx(tmp_path)
    kernels = _kernels(ptx)
    assert len(kernels) == 12, sorted(kernels)   # GRU, ATR, L-GRU x float, bf16 x forward, backward
    assert ptx.count("%clock64") >= 12 * 4
    res = subprocess.run([NVCC, *flags, "-E", probe], capture_output=True, text=True)
    assert res.returncode != 0 and "DTMT_PERSISTENT_PHASES" in res.stderr


def _entries(ptx):
    """The kernels (entries) of a PTX text: name -> the text of its body."""
    parts = re.split(r"^\.visible \.entry (\w+)", ptx, flags=re.M)
    return {name: body.split("\n}\n", 1)[0] for name, body in zip(parts[1::2], parts[2::2])}


def _persistent_ptx(ptx):
    """The PTX of the persistent kernels (their entries) and of the functions they call (block_mma's), one text."""
    parts, keep = [], False
    for line in ptx.splitlines(keepends=True):
        head = re.match(r"^(?:\.visible |\.weak )?\.(entry|func)\b", line)
        if head:
            keep = head.group(1) == "func" or "persistent_" in line
        if keep:
            parts.append(line)
        if line.startswith("}"):
            keep = False
    return "".join(parts)


@needs_nvcc
def test_persistent_kernels_load_from_named_spaces(sm90a_build):
    """The persistent kernels reach a resident matrix and a spilled one through separate calls (resident_matrix,
    spilled_matrix in persistent_cuda_kernels.cuh), so that the compiler knows the space of every load: in the PTX for
    sm_90a of the persistent kernels (every base cell, float, double and bf16, forward and backward; the build of
    test_device_kernels_build_and_link_for_sm90a), each scalar load is ld.shared, ld.global or ld.param, never a
    generic ld (which would test the address's space at run time), apart from the grid barrier's own ld.acquire.gpu,
    and none non-coherent (.nc: what other blocks write must be read through the coherent path); the stage's
    asynchronous copies (cp.async) likewise from L2 (.cg), not through the L1 (.ca); and the cluster form's barrier
    is there, arrive with its default release semantics (not .relaxed) and wait. Code for sm_90a (DTMT_SM90A, as
    gpu_session.sh builds for an H100 / H200), so that the stage read once a cluster is in it too: its bulk copies
    multicast to the cluster and counted by an mbarrier, each thread's after a proxy fence, and no counter in local
    memory. (The wmma loads of the staged operands are generic: the warp matrix API takes a plain pointer.)"""
    text = _persistent_ptx(sm90a_build[1])
    assert len(_kernels(text)) == SM90A_PERSISTENT_KERNELS, sorted(_kernels(text))
    loads = re.findall(r"^\s+(ld\.[\w.]+)", text, flags=re.M)
    spaces = {op.split(".")[1] for op in loads}
    assert {"shared", "global", "param"} <= spaces, sorted(spaces)
    generic = sorted({op for op in loads if op.split(".")[1] not in ("shared", "global", "param")
                      and not op.startswith("ld.acquire.gpu")})
    assert not generic, f"generic loads in the persistent kernels: {generic}"
    assert "barrier.cluster.arrive" in text and "barrier.cluster.wait" in text
    assert "barrier.cluster.arrive.relaxed" not in text   # (release / acquire: the global memory written before)
    assert not [op for op in loads if ".nc" in op]   # (no non-coherent loads of what other blocks write)
    copies = re.findall(r"^\s+(cp\.async\.c[ag][\w.]*)", text, flags=re.M)   # (the products' stage, sm_80 and up)
    assert copies and all(op.startswith("cp.async.cg.") for op in copies), sorted(set(copies))   # (L2, not L1)
    assert "%clock64" not in text   # (the phase clock of benchmarks/phase_probe.cu is compiled out)
    multicast = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
    without = sorted(name for name, body in _entries(text).items() if multicast not in body)
    assert not without, f"persistent kernels without the stage read once a cluster: {without}"
    assert "mbarrier.try_wait.parity" in text and "mbarrier.arrive.expect_tx" in text
    assert text.count("fence.proxy.async") >= text.count(multicast)   # (a fence before each kernel's copies)
