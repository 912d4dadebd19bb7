"""The device kernels go through nvcc where no GPU (or no CUDA torch) is present: every kernel of csrc/'s CUDA headers
compiled to an object for sm_75 and sm_90, the persistent kernels linked without relocatable device code and their
PTX read for the memory spaces of its loads, and the two probes that gpu_session.sh builds on the GPU machine
(benchmarks/barrier_probe.cu, benchmarks/phase_probe.cu) built as it builds them. Each test skips with the reason
when nvcc is absent. The ATen drivers' compile and the kernels emulated on the CPU: test_cuda_sources.py. (A file of
its own, so that under pytest-xdist, which gives a worker a file at a time, these minutes of nvcc run beside
test_cuda_sources.py's, not after them.)"""
import os
import re
import subprocess

import pytest

from nvcc_tools import CSRC, NVCC, ROOT, needs_nvcc, run_compile


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
DTMT_INSTANTIATE(__half, float)
DTMT_INSTANTIATE(__nv_bfloat16, float)
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


@needs_nvcc
@pytest.mark.parametrize("arch", ["75", "90"])
def test_device_kernels_compile_standalone(tmp_path, arch):
    """cell_math.h + transition_cuda_kernels.cuh + persistent_cuda_kernels.cuh + block_mma.cuh +
    attention_cuda_kernels.cuh: every kernel (5 cell kinds x forward/backward x 4 storage types, the persistent
    forward and backward of the 4 base cells x 4 storage types, the attention's 4 kernels x float and double)
    compiled to an object, host and device code, with the flags setup.py passes to nvcc, for sm_90
    (the tensor-core products: TF32, f16, bf16) and sm_75 (below 8.0: without them). One architecture a test, each
    nvcc call with its own timeout (the two in one call passed 900 s on a busy 2-core AMD EPYC Zen 3, 2026-12-01)."""
    src = tmp_path / "kernels_tu.cu"
    src.write_text(KERNELS_TU)
    run_compile([NVCC, "-std=c++17", "-O3", "--use_fast_math", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
                 "-c", f"-I{CSRC}", str(src), "-o", str(tmp_path / "k.o")])
    assert (tmp_path / "k.o").stat().st_size > 0


PERSISTENT_MAIN = r"""
#include "persistent_cuda_kernels.cuh"
int main() {   // never run: linking it is the test
  dtmt::cuda::PersistentForwardArgs<float, float> a{};
  dtmt::cuda::PersistentBackwardArgs<float, float> b{};
  cudaError_t e = dtmt::cuda::launch_persistent_forward<float, float>(dtmt::kLGRU, a, 1, 32, nullptr);
  e = dtmt::cuda::launch_persistent_backward<float, float>(dtmt::kLGRU, b, 1, 32, nullptr);
  return e == cudaSuccess ? 0 : 1;
}
"""


@needs_nvcc
def test_persistent_kernels_link_without_rdc(tmp_path):
    """The persistent kernels' grid barrier (cooperative groups' this_grid().sync()) and cooperative launch link
    into a program without relocatable device code (-rdc), as setup.py builds the extension; built for sm_90
    (Hopper: the H100 / H200 the GPU sessions get)."""
    src = tmp_path / "main.cu"
    src.write_text(PERSISTENT_MAIN)
    run_compile([NVCC, "-std=c++17", "-O3", "-arch=sm_90", f"-I{CSRC}", str(src), "-o", str(tmp_path / "main")])
    assert (tmp_path / "main").stat().st_size > 0


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
    DTMT_PERSISTENT_PHASES; gpu_session.sh's persistent stage builds and runs it on the GPU) compiles and links for
    sm_90a as that stage builds it on an H100 / H200 (DTMT_SM90A: its rows of the stage read once a cluster), its
    kernels read the SM clock (the marks are compiled in: the extension's PTX has
    none, test_persistent_kernels_load_from_named_spaces), and without the flag it refuses to build."""
    probe = os.path.join(ROOT, "benchmarks", "phase_probe.cu")
    flags = ["-std=c++17", "-O3", "--use_fast_math", "-arch=sm_90a", "-DDTMT_SM90A", f"-I{CSRC}"]
    run_compile([NVCC, *flags, "-DDTMT_PERSISTENT_PHASES", "-keep", f"-keep-dir={tmp_path}", probe, "-o",
          str(tmp_path / "phase_probe")])
    assert (tmp_path / "phase_probe").stat().st_size > 0
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    kernels = re.findall(r"^\.visible \.entry (\w+)", ptx, flags=re.M)
    assert len(set(kernels)) == 12, kernels   # GRU, ATR, L-GRU x float, bf16 x forward, backward
    assert ptx.count("%clock64") >= 12 * 4
    res = subprocess.run([NVCC, *flags, "-E", probe], capture_output=True, text=True)
    assert res.returncode != 0 and "DTMT_PERSISTENT_PHASES" in res.stderr


PERSISTENT_PTX_TU = r"""
#include "persistent_cuda_kernels.cuh"
namespace dtmt {
namespace cuda {
#define DTMT_INSTANTIATE(T, A)                                                                              \
  template cudaError_t launch_persistent_forward<T, A>(int, const PersistentForwardArgs<T, A>&, int, int,   \
                                                       cudaStream_t);                                        \
  template cudaError_t launch_persistent_backward<T, A>(int, const PersistentBackwardArgs<T, A>&, int, int, \
                                                        cudaStream_t);
DTMT_INSTANTIATE(float, float)
DTMT_INSTANTIATE(__nv_bfloat16, float)
}  // namespace cuda
}  // namespace dtmt
"""


@needs_nvcc
def test_persistent_kernels_load_from_named_spaces(tmp_path):
    """The persistent kernels reach a resident matrix and a spilled one through separate calls (resident_matrix,
    spilled_matrix in persistent_cuda_kernels.cuh), so that the compiler knows the space of every load: in the PTX for
    sm_90 of the float and bfloat16 kernels (every base cell, forward and backward), each scalar load is ld.shared,
    ld.global or ld.param, never a generic ld (which would test the address's space at run time), apart from the
    grid barrier's own ld.acquire.gpu, and none non-coherent (.nc: what other blocks write must be read through the
    coherent path); the stage's asynchronous copies (cp.async) likewise from L2 (.cg), not through the L1 (.ca);
    and the cluster form's barrier is there, arrive with its default release semantics (not .relaxed) and wait.
    Compiled for sm_90a (DTMT_SM90A, as gpu_session.sh builds for an H100 / H200), so that the stage read once a
    cluster is in it too: its bulk copies multicast to the cluster and counted by an mbarrier, each thread's after a
    proxy fence, and no counter in local memory. (The wmma loads of the staged operands are generic: the warp
    matrix API takes a plain pointer.)"""
    src = tmp_path / "persistent_ptx.cu"
    src.write_text(PERSISTENT_PTX_TU)
    ptx = tmp_path / "persistent.ptx"
    run_compile([NVCC, "-std=c++17", "-O3", "--use_fast_math", "-arch=sm_90a", "-DDTMT_SM90A", "-ptx", f"-I{CSRC}",
                 str(src), "-o", str(ptx)])
    loads = re.findall(r"^\s+(ld\.[\w.]+)", ptx.read_text(), flags=re.M)
    spaces = {op.split(".")[1] for op in loads}
    assert {"shared", "global", "param"} <= spaces, sorted(spaces)
    generic = sorted({op for op in loads if op.split(".")[1] not in ("shared", "global", "param")
                      and not op.startswith("ld.acquire.gpu")})
    assert not generic, f"generic loads in the persistent kernels: {generic}"
    text = ptx.read_text()
    assert "barrier.cluster.arrive" in text and "barrier.cluster.wait" in text
    assert "barrier.cluster.arrive.relaxed" not in text   # (release / acquire: the global memory written before)
    assert not [op for op in loads if ".nc" in op]   # (no non-coherent loads of what other blocks write)
    copies = re.findall(r"^\s+(cp\.async\.c[ag][\w.]*)", text, flags=re.M)   # (the products' stage, sm_80 and up)
    assert copies and all(op.startswith("cp.async.cg.") for op in copies), sorted(set(copies))   # (L2, not L1)
    assert "%clock64" not in text   # (the phase clock of benchmarks/phase_probe.cu is compiled out)
    multicast = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
    assert text.count(multicast) >= 12, text.count(multicast)   # (every kernel's stage, read once a cluster)
    assert "mbarrier.try_wait.parity" in text and "mbarrier.arrive.expect_tx" in text
    assert text.count("fence.proxy.async") >= text.count(multicast)   # (a fence before each kernel's copies)
