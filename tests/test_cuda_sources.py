"""The CUDA drivers go through nvcc, and the CUDA kernels run on the CPU, where no GPU (or no CUDA torch) is present.
(The device kernels' own compile checks, and the probes': test_cuda_compile.py.)

- csrc/attention_cuda.cu and csrc/transition_cuda.cu (the ATen drivers) need torch's headers: they are compiled
  with nvcc against the installed torch's include directories (a CPU wheel ships the ATen / c10 CUDA headers but not
  c10's generated cuda_cmake_macros.h, which C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips); registration.cpp is parsed
  with DTMT_WITH_CUDA defined. These two take minutes of a core and are marked `slow`.
- test_cuda_kernels_emulated and the other *_emulated tests: the same kernels and ATen drivers compiled by the host
  compiler with DTMT_CUDA_EMULATION (tests/cuda_emulation.h: each block's threads are fibers on the host thread,
  switched at __syncthreads, an exchange buffer for the warp shuffles; float / double, and bf16 and TF32 products
  rounded as the device rounds them) into a torch extension on host tensors, checked against the reference (outputs
  and every gradient, float64). It needs no GPU and no nvcc; it checks the indexing, reductions, masking and
  gradient bookkeeping, not device numerics.
Each test skips with the reason when nvcc (or torch's headers) is absent. Running the real kernels needs a CUDA
torch and a GPU: the gpu-marked tests (benchmarks/gpu_session.sh).
"""
import dataclasses
import glob
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from nvcc_tools import CSRC, NVCC, ROOT, check_compile, fastest, needs_nvcc, run_compile


# The two slow compile checks start in the background as soon as pytest has collected them (conftest.py's
# pytest_collection_finish calls start_background_compiles), so that on two cores they overlap the tests that
# run before them; each test then waits for its own compiler and checks what it said.
BACKGROUND = {}   # test name -> (process, command, stdout file, stderr file)


def _cublas_flags():
    """-DDTMT_DIRECT_CUBLAS and the include folders where cuBLAS's headers (and the others torch's
    CUDAContextLight.h includes) are found: next to nvcc, or in pip's nvidia wheels where installed. Else none,
    and the driver is compiled without its direct cuBLAS calls, as setup.py builds it with such a toolkit."""
    headers = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")
    from torch.utils.cpp_extension import CUDA_HOME   # (nvcc may be a wrapper script elsewhere, as here)

    folders = [os.path.join(home, "include") for home in (CUDA_HOME, os.path.dirname(os.path.dirname(
        os.path.realpath(NVCC)))) if home]
    try:
        import nvidia   # namespace package of pip's CUDA libraries (nvidia/cu13/include, nvidia/cublas/include...)
        folders += [f for p in nvidia.__path__ for f in sorted(glob.glob(os.path.join(p, "*", "include")))]
    except ImportError:
        pass
    found = {h: next((f for f in folders if os.path.exists(os.path.join(f, h))), None) for h in headers}
    if None in found.values():
        return []
    return ["-DDTMT_DIRECT_CUBLAS=1"] + [f"-I{f}" for f in dict.fromkeys(found.values())]


def _aten_driver_cmd(out_dir):
    """nvcc on the two ATen drivers in one unit (torch's headers parsed once, not twice: half a minute of a core),
    attention_cuda.cu first, so that its own includes are shown to suffice; its device code (the step kernels, built
    apart by test_cuda_compile.py) at nvcc's fastest level."""
    src = os.path.join(out_dir, "drivers.cu")
    with open(src, "w") as f:
        f.write('#include "attention_cuda.cu"\n#include "transition_cuda.cu"\n')
    return [NVCC, "-std=c++17", "-O1", *fastest("all"), "-c", f"-I{CSRC}", *_torch_includes(), _abi_flag(),
            *_cublas_flags(), "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-DTORCH_EXTENSION_NAME=_C", "-DDTMT_WITH_CUDA=1", src, "-o", os.path.join(out_dir, "t.o")]


def _bindings_cmd(out_dir):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return [cxx, "-std=c++17", "-fsyntax-only", f"-I{CSRC}", *_torch_includes(), _abi_flag(),
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", "-DDTMT_WITH_CUDA=1",
            os.path.join(CSRC, "registration.cpp")]


def start_background_compiles(names, tmp_root):
    """Starts the compile of each test in `names` that has one (nothing when it would skip: no nvcc, no headers,
    no C++ compiler), and the emulated kernels' extension when a test using it is selected. Each compiler runs in
    a session of its own, so that stop_background_compiles can stop it with its children."""
    import tempfile

    # (the emulated extension's tests are parametrized, and two use it: their names start with its key)
    for name, make in (("test_aten_driver_compiles", _aten_driver_cmd), ("test_bindings_parse_with_cuda_enabled",
                                                                         _bindings_cmd),
                       ("test_cuda_kernels_emulated", _emulated_build_cmd)):
        if (not any(n.startswith(name) for n in names) or name in BACKGROUND
                or (make is _aten_driver_cmd and NVCC is None)):
            continue
        out_dir = tempfile.mkdtemp(prefix="dtmt-compile-", dir=tmp_root)
        try:
            cmd = make(out_dir)
        except BaseException:   # noqa: BLE001 - pytest.skip: the test itself will skip with the reason
            continue
        out, err = (open(os.path.join(out_dir, n), "w+") for n in ("stdout", "stderr"))
        BACKGROUND[name] = (subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True), cmd,
                            out, err)


def _kill_session(sid):
    """SIGKILL to every process of session `sid` (a background compile's: ninja puts each of its commands in a
    process group of its own, so killing the group of the process we started would leave the compilers)."""
    import signal

    pids = [sid]
    if os.path.isdir("/proc"):
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:   # "pid (name) state ppid pgrp session ..."
                    if int(f.read().rsplit(")", 1)[1].split()[3]) == sid:
                        pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def stop_background_compiles():
    for proc, _, out, err in BACKGROUND.values():
        if proc.poll() is None:   # still compiling (an interrupted or partial run): the compiler and its children
            _kill_session(proc.pid)
            proc.wait()
        out.close()
        err.close()
    BACKGROUND.clear()


def _run_or_wait(name, make, out_dir, timeout=900):
    """The compile of test `name` (the one started in the background if there is one, else run now); returns its
    command."""
    if name not in BACKGROUND:
        cmd = make(out_dir)
        run_compile(cmd, timeout)
        return cmd
    proc, cmd, out, err = BACKGROUND[name]
    proc.wait(timeout=timeout)
    out.seek(0)
    err.seek(0)
    check_compile(cmd, proc.returncode, out.read(), err.read())
    return cmd


def _torch_includes():
    try:
        from torch.utils.cpp_extension import include_paths
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"torch's extension helpers did not import ({exc})")
    paths = include_paths()
    if not any(os.path.exists(os.path.join(p, "c10", "cuda", "CUDAStream.h")) for p in paths):
        pytest.skip("the installed torch ships no c10/cuda headers")
    return [f"-I{p}" for p in paths] + [f"-I{sysconfig.get_paths()['include']}"]


def _abi_flag():
    import torch

    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


@pytest.mark.slow
@needs_nvcc
def test_aten_driver_compiles(tmp_path):
    """csrc/attention_cuda.cu and csrc/transition_cuda.cu against the installed torch's headers (an object file;
    linking needs a CUDA torch); with the direct cuBLAS calls where cuBLAS's headers are found (_cublas_flags)."""
    cmd = _run_or_wait("test_aten_driver_compiles", _aten_driver_cmd, str(tmp_path))
    obj = cmd[cmd.index("-o") + 1]
    assert os.path.getsize(obj) > 0
    nm = shutil.which("nm")
    if "-DDTMT_DIRECT_CUBLAS=1" in cmd and nm is not None:
        symbols = subprocess.run([nm, "-u", obj], capture_output=True, text=True, check=True).stdout
        assert "cublasGemmEx" in symbols and "getCurrentCUDABlasHandle" in symbols
    if nm is not None:   # the persistent launchers are left to their own units (csrc/persistent_<type>.cu)
        undefined = subprocess.run([nm, "-u", "-C", obj], capture_output=True, text=True, check=True).stdout
        for pair in _persistent_units().values():
            for launcher in ("forward", "backward"):
                assert f"dtmt::cuda::launch_persistent_{launcher}<{pair}>(" in undefined, (launcher, pair)


def _persistent_units():
    """{csrc/persistent_<type>.cu: "T, A"}: the (storage, accumulation) pair whose launchers each unit defines."""
    units = {}
    for path in sorted(glob.glob(os.path.join(CSRC, "persistent_*.cu"))):
        with open(path) as f:
            pairs = re.findall(r"^DTMT_PERSISTENT_LAUNCHERS\(, *([\w:]+), *([\w:]+)\)", f.read(), flags=re.M)
        assert len(pairs) == 1, (path, pairs)
        units[os.path.basename(path)] = ", ".join(pairs[0])
    return units


def test_persistent_units_define_what_the_driver_declares():
    """The persistent launchers are compiled in a unit of their own a storage type (csrc/persistent_<type>.cu, in
    parallel in setup.py's build) and declared extern in the ATen driver (transition_cuda.cu): every pair the driver
    declares is defined by exactly one unit, and every storage type the driver dispatches to (float, double, half,
    bfloat16) has one. A pair declared but defined nowhere would fail only at the GPU machine's link."""
    with open(os.path.join(CSRC, "transition_cuda.cu")) as f:
        declared = re.findall(r"^DTMT_PERSISTENT_LAUNCHERS\(extern, *([\w:]+), *([\w:]+)\)", f.read(), flags=re.M)
    defined = _persistent_units()
    assert sorted(", ".join(p) for p in declared) == sorted(defined.values())
    assert sorted(defined) == ["persistent_bfloat16.cu", "persistent_double.cu", "persistent_float.cu",
                               "persistent_half.cu"]
    assert defined["persistent_float.cu"] == "float, float" and defined["persistent_double.cu"] == "double, double"
    assert defined["persistent_half.cu"] == "__half, float"
    assert defined["persistent_bfloat16.cu"] == "__nv_bfloat16, float"


@pytest.mark.slow
def test_bindings_parse_with_cuda_enabled(tmp_path):
    """registration.cpp (the CUDA kernels' op registration) as setup.py compiles it for a CUDA build
    (DTMT_WITH_CUDA), syntax and types only. (bindings.cpp's CUDA branch is one constant, has_cuda = true: not worth
    the half minute its parse takes on two cores.)"""
    _run_or_wait("test_bindings_parse_with_cuda_enabled", _bindings_cmd, str(tmp_path))


EMULATION_EXT = r"""
#define DTMT_CUDA_EMULATION 1
#define DTMT_CUDA_MAX_THREADS 32  // several features per thread at H > 32
#include "transition_cuda.cu"
#include "attention_cuda.cu"

#include <torch/extension.h>   // (the module: pybind11)

namespace {
dtmt::TransitionWeights weights(int64_t kind, const std::vector<at::Tensor>& p) {
  return dtmt::TransitionWeights{kind, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9]};
}
dtmt::SavedForward saved_of(const std::vector<at::Tensor>& s) { return {s[0], s[1], s[2], s[3], s[4]}; }
std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& mask,
                                const at::Tensor& drop, int64_t kind, const std::vector<at::Tensor>& params,
                                bool reverse, double eps) {
  return dtmt::transition_forward_cuda(x, h0, mask, drop, weights(kind, params), reverse, eps);
}
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& grad_hn, const at::Tensor& x,
                                 const at::Tensor& mask, const at::Tensor& drop, int64_t kind,
                                 const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& saved,
                                 bool reverse, double eps) {
  return dtmt::transition_backward_cuda({grad_out, grad_hn, x, mask, drop}, weights(kind, params), saved_of(saved),
                                        reverse, eps);
}
// the backward without the weight gradients (dk.nn.unrolled's steps): their slots hold the pre-activation gradients
std::vector<at::Tensor> backward_rows(const at::Tensor& grad_out, const at::Tensor& grad_hn, const at::Tensor& x,
                                      const at::Tensor& mask, const at::Tensor& drop, int64_t kind,
                                      const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& saved,
                                      bool reverse, double eps) {
  return dtmt::transition_backward_cuda({grad_out, grad_hn, x, mask, drop}, weights(kind, params), saved_of(saved),
                                        reverse, eps, /*weight_grads=*/false);
}
// `cluster` (the tests' tuples): 0 or False the grid form, 1 or True the cluster form (one thread-block cluster),
// -g the cluster form in g clusters each its own batch rows, n >= 2 the grid form in clusters of n blocks that read
// the products' stage once a cluster (multicast)
bool one_cluster(int64_t cluster) { return cluster == 1 || cluster < 0; }
int64_t multicast_of(int64_t cluster) { return cluster >= 2 ? cluster : 1; }
int64_t groups_of(int64_t cluster) { return cluster < 0 ? -cluster : 1; }
std::vector<at::Tensor> forward_persistent(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& mask,
                                           const at::Tensor& drop, int64_t kind, const std::vector<at::Tensor>& params,
                                           bool reverse, double eps, int64_t grid, int64_t threads, int64_t resident,
                                           int64_t cluster) {
  return dtmt::transition_forward_persistent_cuda(x, h0, mask, drop, weights(kind, params), reverse, eps, grid,
                                                  threads, resident, one_cluster(cluster), multicast_of(cluster),
                                                  groups_of(cluster));
}
std::vector<at::Tensor> backward_persistent(const at::Tensor& grad_out, const at::Tensor& grad_hn,
                                            const at::Tensor& x, const at::Tensor& mask, const at::Tensor& drop,
                                            int64_t kind, const std::vector<at::Tensor>& params,
                                            const std::vector<at::Tensor>& saved, bool reverse, double eps,
                                            int64_t grid, int64_t threads, int64_t resident, int64_t cluster) {
  return dtmt::transition_backward_persistent_cuda({grad_out, grad_hn, x, mask, drop}, weights(kind, params),
                                                   saved_of(saved), reverse, eps, grid, threads, resident,
                                                   one_cluster(cluster), multicast_of(cluster), groups_of(cluster));
}
// the backward (per-step, or persistent where grid > 0) with the gradients formed in chunks of `chunk` steps
// (GradientChunks; < 0: the driver's rule, chunk_steps)
std::vector<at::Tensor> backward_chunked(const at::Tensor& grad_out, const at::Tensor& grad_hn, const at::Tensor& x,
                                         const at::Tensor& mask, const at::Tensor& drop, int64_t kind,
                                         const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& saved,
                                         bool reverse, double eps, int64_t grid, int64_t threads, int64_t resident,
                                         int64_t cluster, int64_t chunk) {
  const dtmt::BackwardInputs in{grad_out, grad_hn, x, mask, drop};
  std::vector<at::Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "backward_chunked", [&] {
    result = grid > 0 ? dtmt::backward_persistent_impl<scalar_t>(in, weights(kind, params), saved_of(saved), reverse,
                                                                 eps, grid, threads, resident, one_cluster(cluster),
                                                                 false, true, -1, chunk, multicast_of(cluster),
                                                                 groups_of(cluster))
                      : dtmt::backward_impl<scalar_t>(in, weights(kind, params), saved_of(saved), reverse, eps, true,
                                                      chunk);
  });
  return result;
}
// the driver's chunk of steps for the backward of a layer on x (chunk_steps)
int64_t chunk_steps(const at::Tensor& x, int64_t kind, const std::vector<at::Tensor>& params, bool weight_grads) {
  return dtmt::chunk_steps(dtmt::dims_of(x, weights(kind, params)), weight_grads);
}
// A kernel misusing the emulation's barriers (test_emulation_refuses_misused_barriers): 0 a grid barrier in a
// cluster launch, 1 a cluster barrier in a cooperative launch, 2 a cluster of 17 blocks.
struct MisuseArg {
  int which;
};
void misuse_kernel(MisuseArg a) {
  if (a.which == 0) {
    ::dtmt_emu::grid_sync();
  } else {
    ::dtmt_emu::cluster_sync();
  }
}
void emulation_misuse(int64_t which) {
  const MisuseArg a{static_cast<int>(which)};
  if (which == 1) {
    ::dtmt_emu::launch_cooperative(misuse_kernel, 2, 32, 0, a);
  } else {
    ::dtmt_emu::launch_cluster(misuse_kernel, which == 2 ? 17 : 2, 32, 0, a);
  }
}
// A cooperative launch of one block of 64 threads (test_emulated_shuffle_is_a_warp_rendezvous): thread 32 writes
// 7 to shared memory, every thread shuffles with its neighbour lane (with `mode` 1, a block barrier after), then
// thread 0 reads shared memory: what it read, and lane 1's shuffled value (lane 0's index). Mode 2: the upper half
// of each warp returns first, and the others shuffle (undefined on a GPU: the emulated launch fails).
struct ShuffleArg {
  int mode;
  float* read;
};
void shuffle_kernel(ShuffleArg a) {
  if (a.mode == 2 && threadIdx.x % 32 >= 16) return;
  float* shared = reinterpret_cast<float*>(::dtmt_emu::dynamic_smem());
  if (threadIdx.x == 32) shared[0] = 7.f;
  const float v = __shfl_xor_sync(0xffffffffu, static_cast<float>(threadIdx.x), 1);
  if (a.mode == 1) __syncthreads();
  if (threadIdx.x == 0) a.read[0] = shared[0];
  if (threadIdx.x == 1) a.read[1] = v;
}
std::vector<double> shuffle_order(int64_t mode) {
  float read[2] = {0.f, 0.f};
  ::dtmt_emu::launch_cooperative(shuffle_kernel, 1, 64, 16, ShuffleArg{static_cast<int>(mode), read});
  return {read[0], read[1]};
}
// the plan the driver takes for a float64 layer (grid 0: the per-step path), whether it is the cluster form, and its
// clusters sharing the stage (1: none)
std::tuple<int64_t, bool, int64_t> driver_plan(const at::Tensor& x, int64_t kind,
                                               const std::vector<at::Tensor>& params) {
  const dtmt::cuda::PersistentPlan plan = dtmt::recurrence_plan<double>(x, weights(kind, params));
  return {plan.grid, plan.cluster, plan.multicast};
}
}  // namespace

// whether DTMT_CUDA_RECURRENCE asked for the persistent launches (read once a process)
bool persistent_recurrence() { return dtmt::persistent_requested(); }

// (grid, cluster, refused, multicast, tensor_cores, steps): the persistent launches run in this process, and the
// per-step runs where they were asked for (transition.h)
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> persistent_launches() {
  const auto c = dtmt::persistent_launch_counts();
  return {c.grid, c.cluster, c.refused, c.multicast, c.tensor_cores, c.steps};
}

// the step GEMM the driver picks for B rows (0 row GEMM, 1 tiled GEMM, 2 ATen's mm / cuBLAS)
int64_t step_gemm_choice(int64_t B) { return static_cast<int64_t>(dtmt::step_gemm(B)); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scores_forward", &dtmt::additive_scores_forward_cuda);
  m.def("scores_backward", &dtmt::additive_scores_backward_cuda);
  m.def("context_forward", &dtmt::attention_context_forward_cuda);
  m.def("context_backward", &dtmt::attention_context_backward_cuda);
  m.def("forward", &forward);
  m.def("forward_persistent", &forward_persistent);
  m.def("backward_persistent", &backward_persistent);
  m.def("backward", &backward);
  m.def("backward_rows", &backward_rows);
  m.def("backward_chunked", &backward_chunked);
  m.def("chunk_steps", &chunk_steps);
  m.def("step_gemm_choice", &step_gemm_choice);
  m.def("persistent_recurrence", &persistent_recurrence);
  m.def("driver_plan", &driver_plan);
  m.def("persistent_launches", &persistent_launches);
  m.def("bulk_copies", [] { return ::dtmt_emu::bulk_copies; });
  m.def("set_clusters_held", [](int64_t n) { ::dtmt_emu::clusters_held = static_cast<int>(n); });
  m.def("set_smem_optin", [](int64_t n) { ::dtmt_emu::smem_optin = static_cast<size_t>(n); });
  m.def("set_blocks_held", [](int64_t n) { ::dtmt_emu::blocks_held = static_cast<int>(n); });
  m.def("set_multiprocessors", [](int64_t n) { ::dtmt_emu::multiprocessors = static_cast<int>(n); });
  m.def("shuffle_order", &shuffle_order);
  m.def("cluster_launches", [] {
    return std::make_tuple(::dtmt_emu::cluster_launches, ::dtmt_emu::clusters_launched);
  });
  m.def("emulation_misuse", &emulation_misuse);
}
"""


def _build_emulated_ext(build):
    """Compiles EMULATION_EXT in the folder `build` and imports it (torch's JIT extension loader); a folder where
    it was built already (start_background_compiles) only imports it (ninja finds nothing to do)."""
    from torch.utils.cpp_extension import load

    src = os.path.join(build, "emulated_cuda.cpp")
    written = None
    if os.path.isfile(src):
        with open(src) as f:
            written = f.read()
    if written != EMULATION_EXT:   # (only when it differs: rewritten, it would be built again)
        with open(src, "w") as f:
            f.write(EMULATION_EXT)
    return load("dtmt_cuda_emulated", [src], extra_include_paths=[CSRC, os.path.dirname(__file__)],
                extra_cflags=["-O1", "-std=c++17", "-w"], build_directory=build, verbose=False)


def _emulated_build_cmd(build):
    """A process that builds the emulated extension in the folder `build`, its last argument
    (start_background_compiles: ~30 s of one core)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_cuda_sources as t; "
            "t._build_emulated_ext(sys.argv[2])")
    return [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), build]


@pytest.fixture(scope="module")
def emulated_cuda_ext(tmp_path_factory):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if "test_cuda_kernels_emulated" in BACKGROUND:   # built in the background: wait, check, import from its folder
        cmd = _run_or_wait("test_cuda_kernels_emulated", None, None)
        return _build_emulated_ext(cmd[-1])
    return _build_emulated_ext(str(tmp_path_factory.mktemp("cuda_emulation")))


def _emulated_sequence(ext, persistent=None, chunk=None):
    """The emulated driver as an autograd function; persistent=(grid, threads, resident, cluster): forward and
    backward as the persistent launches (forward_persistent, backward_persistent) with the first `resident` sub-cells'
    matrices in shared memory (-1: all), one thread-block cluster where `cluster`; chunk: the backward's gradients
    formed in chunks of that many steps (backward_chunked; -1: the driver's rule)."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    class Emulated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, h0, mask, drop, kind, reverse, eps, *params):
            params = [p.contiguous() for p in params]
            args = (x.contiguous(), h0.contiguous(), mask, drop, kind, params, reverse, eps)
            out, h_n, *saved = ext.forward(*args) if persistent is None else ext.forward_persistent(*args, *persistent)
            ctx.save_for_backward(x, mask, drop, *params, *saved)
            ctx.kind, ctx.reverse, ctx.eps = kind, reverse, eps
            return out, h_n

        @staticmethod
        def backward(ctx, g_out, g_hn):
            x, mask, drop, *rest = ctx.saved_tensors
            args = (g_out.contiguous(), g_hn.contiguous(), x, mask, drop, ctx.kind, rest[:10], rest[10:], ctx.reverse,
                    ctx.eps)
            if chunk is not None:
                grads = ext.backward_chunked(*args, *(persistent or (0, 32, -1, False)), chunk)
            else:
                grads = ext.backward(*args) if persistent is None else ext.backward_persistent(*args, *persistent)
            dparams = [g if g is not None and g.numel() else None for g in grads[2:]]
            return (grads[0], grads[1], None, None, None, None, None, *dparams)

    def run(x, h0, w, mask=None, drop=None, reverse=False, eps=1e-5):
        empty = x.new_empty(0)   # the raw ext takes absent tensors as empty ones
        or_empty = [empty if t is None else t for t in (mask, drop, *flat_params(w))]
        return Emulated.apply(x, h0, or_empty[0], or_empty[1], KINDS[w.cell], reverse, eps, *or_empty[2:])
    return run


EMULATED_CASES = [(c, d) for c in ("gru", "lgru", "lau") for d in (0, 2)] + [("atr", 0)]


def _chunk_steps(ext, layer, x, weight_grads=True):
    """The steps of the chunks the driver's backward takes for `layer` on x (transition_cuda.cu's chunk_steps)."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    w = layer.direction_weights(0)
    params = [x.new_empty(0) if p is None else p.detach().contiguous() for p in flat_params(w)]
    return ext.chunk_steps(x, KINDS[w.cell], params, weight_grads)


def _compare_emulated(run_emulated, cell, depth, ln, full_features, dtype, B=3, T=3, H=37):
    """The emulated CUDA backend against the reference in float64: outputs and all gradients. full_features: padding
    mask + reverse direction + candidate dropout together, or none of them."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer, padding_mask
    from dtmt_kernels import reference as R

    tol = 1e-12 if dtype == torch.float64 else 2e-5
    layer = make_layer(cell, 3, H, depth=depth, layer_norm=ln, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, B, 3, generator=gen, dtype=dtype)
    h0 = torch.randn(B, H, generator=gen, dtype=dtype)
    lengths = [T] + torch.randint(1, T + 1, (B - 1,), generator=gen).tolist()
    mask = padding_mask(lengths, T, dtype) if full_features else None
    drop = ((torch.rand(depth + 1, B, H, generator=gen) > 0.3).to(dtype) / 0.7
            if full_features and cell != "atr" else None)
    g_out = torch.randn(T, B, H, generator=gen, dtype=dtype)
    g_h = torch.randn(B, H, generator=gen, dtype=dtype)
    results = []
    for fn, to in ((R.transition_sequence, torch.float64), (run_emulated, dtype)):   # (the reference in float64)
        names = [n for n, _ in layer.named_parameters()]
        xi, hi = x.to(to).requires_grad_(), h0.to(to).requires_grad_()
        ps = [p.detach().to(to).requires_grad_() for p in layer.parameters()]
        out, h_n = fn(xi, hi, layer.direction_weights(0, dict(zip(names, ps))), *(
            None if t is None else t.to(to) for t in (mask, drop)), full_features)
        ((out * g_out.to(to)).sum() + (h_n * g_h.to(to)).sum()).backward()
        results.append([out, h_n, xi.grad, hi.grad] + [p.grad for p in ps])
    labels = ["out", "h_n", "dx", "dh0"] + [n for n, _ in layer.named_parameters()]
    for label, ref, got in zip(labels, *results):
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(got.double(), ref, atol=tol * scale, rtol=tol,
                                   msg=lambda m: f"{cell}-d{depth} ln={ln} masked={full_features} B={B} {label}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_cuda_kernels_emulated(emulated_cuda_ext, dtype):
    """Every cell x depth {0, 2} x layer norm on/off, masked + reversed + candidate dropout and plain: the
    CUDA driver and kernels (emulated on host fibers) against the reference, outputs and all gradients.
    H = 37: two passes for some threads (32 threads a block here), idle lanes in the last warp; the row GEMM
    (B <= 8) with lanes holding one or two k each (K = H or 3H), a part-filled last block of warps (N = 3H or
    4H columns) and a part-filled pass of rows (M = B = 3). float32 runs the same code as float64 (templates on
    the type; the emulation checks indexing and bookkeeping, not device numerics): there every cell and depth
    with layer norm and every feature on, a quarter of the grid and of its minute on two cores."""
    run_emulated = _emulated_sequence(emulated_cuda_ext)
    grid = ((False, True), (True, False)) if dtype == torch.float64 else ((True,), (True,))
    for (cell, depth), ln, full_features in itertools.product(EMULATED_CASES, *grid):
        _compare_emulated(run_emulated, cell, depth, ln, full_features, dtype)


@pytest.mark.slow
def test_cuda_kernels_emulated_at_one_row_and_one_step(emulated_cuda_ext):
    """The per-step path at the decoder's and the beam's shapes: B = 1 (the row GEMM of one row), T = 1 and 4, every
    cell and depth with layer norm, plain and masked + reversed + candidate dropout, against the float64 reference."""
    run_emulated = _emulated_sequence(emulated_cuda_ext)
    for (cell, depth), T, full_features in itertools.product(EMULATED_CASES, (1, 4), (False, True)):
        _compare_emulated(run_emulated, cell, depth, True, full_features, torch.float64, B=1, T=T)


def test_cuda_driver_refuses_more_steps_than_int_counts_emulated(emulated_cuda_ext):
    """The kernels count steps with int, and the persistent ones read the mask at t x B + b (int before: past 2^31
    it wrapped, out of bounds): a layer of 2^31 steps is refused by every entry of the driver before any work (x of
    no features: nothing allocated), forward and backward, per step and persistent."""
    from dtmt_kernels.ops.transition import KINDS

    empty = torch.empty(0)
    params = [torch.zeros(6, 0), torch.zeros(6), torch.zeros(6, 2), torch.zeros(6)] + [empty] * 6   # GRU, H = 2, I = 0
    x, h0 = torch.empty(2 ** 31, 1, 0), torch.zeros(1, 2)
    kind = KINDS["gru"]
    message = r"transition_forward on CUDA: T \(2147483648\) and a step's values .* must be at most 2\^31 - 1"
    with pytest.raises(RuntimeError, match=message):
        emulated_cuda_ext.forward(x, h0, empty, empty, kind, params, False, 1e-5)
    with pytest.raises(RuntimeError, match=message):
        emulated_cuda_ext.forward_persistent(x, h0, empty, empty, kind, params, False, 1e-5, 1, 32, -1, 0)
    saved = [empty] * 5
    with pytest.raises(RuntimeError, match=message.replace("forward", "backward")):
        emulated_cuda_ext.backward(empty, h0, x, empty, empty, kind, params, saved, False, 1e-5)
    with pytest.raises(RuntimeError, match=message.replace("forward", "backward")):
        emulated_cuda_ext.backward_persistent(empty, h0, x, empty, empty, kind, params, saved, False, 1e-5, 1, 32, -1,
                                              0)


@pytest.mark.parametrize("which", ["mask", "b_hh", "ln_w", "grad_hn", "hs"])
@pytest.mark.parametrize("persistent", [False, True], ids=["steps", "persistent"])
def test_cuda_driver_refuses_tensors_on_another_device_emulated(emulated_cuda_ext, which, persistent):
    """The dispatcher runs the CUDA kernels where any argument is a CUDA tensor, and the driver passed every tensor's
    pointer to the kernels as it came: a mask, bias, layer-norm gain or grad_hn left on the CPU beside CUDA x was read
    (or written) from the device at a host address. Each entry now refuses a tensor on another device than x's,
    naming it; here the other device is the meta one (the emulation's tensors are host tensors)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T, B, H, dtype = 2, 3, 5, torch.float64
    layer = make_layer("gru", 3, H, depth=1, layer_norm=True, dtype=dtype)
    x, h0 = torch.randn(T, B, 3, dtype=dtype), torch.randn(B, H, dtype=dtype)
    empty = x.new_empty(0)
    params = [empty if t is None else t.detach().contiguous() for t in flat_params(layer.direction_weights(0))]
    kind, mask, more = KINDS["gru"], torch.ones(T, B, dtype=dtype), (2, 32, -1, 0) if persistent else ()
    out, h_n, *saved = emulated_cuda_ext.forward(x, h0, mask, empty, kind, params, False, 1e-5)

    def moved(name, t):
        return t.to("meta") if name == which else t

    params = [moved(n, p) for n, p in zip(("w_ih", "b_ih", "w_hh", "b_hh", "ln_w"), params)] + params[5:]
    saved = [moved(n, t) for n, t in zip(("xp", "hs", "hs_lp", "hp", "hpt"), saved)]
    message = f" on CUDA: {which} is on meta but x is on cpu"
    if which not in ("grad_hn", "hs"):
        forward = emulated_cuda_ext.forward_persistent if persistent else emulated_cuda_ext.forward
        with pytest.raises(RuntimeError, match="dtmt::transition_forward" + message):
            forward(x, h0, moved("mask", mask), empty, kind, params, False, 1e-5, *more)
    backward = emulated_cuda_ext.backward_persistent if persistent else emulated_cuda_ext.backward
    with pytest.raises(RuntimeError, match="dtmt::transition_backward" + message):
        backward(out, moved("grad_hn", h_n), x, moved("mask", mask), empty, kind, params, saved, False, 1e-5, *more)


@pytest.mark.parametrize("persistent", [False, True], ids=["steps", "persistent"])
def test_cuda_driver_takes_per_call_tensors_of_another_dtype_emulated(emulated_cuda_ext, persistent):
    """A bool mask, dropout multipliers or layer-norm parameters of another float dtype than x's, handed straight to
    the CUDA driver (the ops' check_sequence now refuses the floating ones before it): it read them in x's dtype,
    where ATen's "expected scalar type" named no argument. Now converted: the outputs and gradients are those of the same call with them in x's
    dtype (values exact in both dtypes, so to the bit). The matrices and biases, which the GEMMs read as they are, are
    refused in another dtype, naming the argument."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T, B, H, dtype = 3, 2, 5, torch.float64
    layer = make_layer("lgru", 3, H, depth=2, layer_norm=True, dtype=dtype)
    x, h0 = torch.randn(T, B, 3, dtype=dtype), torch.randn(B, H, dtype=dtype)
    empty = x.new_empty(0)
    names = ("w_ih", "b_ih", "w_hh", "b_hh", "ln_w", "ln_b", "t_w", "t_b", "t_ln_w", "t_ln_b")
    params = [empty if t is None else t.detach().float().to(dtype).contiguous()   # (exact in float32)
              for t in flat_params(layer.direction_weights(0))]
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    drop = (torch.rand(3, B, H) > 0.5).to(dtype) * 2
    kind, more = KINDS["lgru"], (2, 32, -1, 0) if persistent else ()
    forward = emulated_cuda_ext.forward_persistent if persistent else emulated_cuda_ext.forward
    backward = emulated_cuda_ext.backward_persistent if persistent else emulated_cuda_ext.backward
    other = [p.float() if n in ("ln_w", "ln_b", "t_ln_w", "t_ln_b") else p for n, p in zip(names, params)]

    def run(mask, drop, params):
        out, h_n, *saved = forward(x, h0, mask, drop, kind, params, True, 1e-5, *more)
        g = torch.Generator().manual_seed(1)
        grads = backward(torch.randn(out.shape, generator=g, dtype=dtype), torch.randn(h_n.shape, generator=g,
                         dtype=dtype), x, mask, drop, kind, params, saved, True, 1e-5, *more)
        return [out, h_n, *grads]

    for got, want in zip(run(mask, drop.float(), other), run(mask.to(dtype), drop, params)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, to in (("w_ih", torch.float32), ("b_hh", torch.float32), ("t_w", torch.float16)):
        bad = [p.to(to) if n == name else p for n, p in zip(names, params)]
        got = {torch.float32: "Float", torch.float16: "Half"}[to]
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_forward on CUDA: {name} must have x's "
                                                         f"dtype (Double), got {got}")):
            forward(x, h0, empty, empty, kind, bad, False, 1e-5, *more)


@pytest.mark.parametrize("persistent", [False, True], ids=["steps", "persistent"])
def test_cuda_backward_refuses_16_bit_without_hs_lp_emulated(emulated_cuda_ext, persistent):
    """The op's checks take hs_lp (the forward's states in x's dtype) as optional; a bfloat16 backward without it
    failed in an ATen product naming nothing (the float states against 16-bit gradients). Now the CPU op's refusal."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    dtype = torch.bfloat16
    layer = make_layer("gru", 3, 5, depth=1, layer_norm=True, dtype=dtype)
    x, h0 = torch.randn(3, 2, 3, dtype=dtype), torch.randn(2, 5, dtype=dtype)
    empty = x.new_empty(0)
    params = [empty if t is None else t.detach().contiguous() for t in flat_params(layer.direction_weights(0))]
    out, h_n, *saved = emulated_cuda_ext.forward(x, h0, empty, empty, KINDS["gru"], params, False, 1e-5)
    saved[2] = empty
    backward = emulated_cuda_ext.backward_persistent if persistent else emulated_cuda_ext.backward
    more = (2, 32, -1, 0) if persistent else ()
    with pytest.raises(RuntimeError, match="dtmt::transition_backward on CUDA: 16-bit inputs need the forward's hs_lp"):
        backward(out, h_n, x, empty, empty, KINDS["gru"], params, saved, False, 1e-5, *more)


@pytest.mark.parametrize("persistent", [None, (2, 32, -1, 0)], ids=["steps", "persistent"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_cuda_driver_of_no_steps_emulated(emulated_cuda_ext, persistent, reverse):
    """x of T = 0 steps (the op's checks take it; the CPU op returns h_n = h0, dh0 = grad_hn): the per-step forward
    read the first of no steps (a crash), the persistent one indexed a state of no steps, and the per-step backward
    added an unfilled product to dh0. Now out [0, B, H], h_n = h0, dx [0, B, I], dh0 = grad_hn, zero weight
    gradients, as the CPU op gives."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    B, H, dtype = 3, 5, torch.float64
    layer = make_layer("gru", 3, H, depth=1, layer_norm=True, dtype=dtype)
    x, h0, g_h = torch.randn(0, B, 3, dtype=dtype), torch.randn(B, H, dtype=dtype), torch.randn(B, H, dtype=dtype)
    empty = x.new_empty(0)
    params = [empty if t is None else t.detach().contiguous() for t in flat_params(layer.direction_weights(0))]
    kind = KINDS["gru"]
    args = (x, h0, empty, empty, kind, params, reverse, 1e-5)
    out, h_n, *saved = (emulated_cuda_ext.forward(*args) if persistent is None
                        else emulated_cuda_ext.forward_persistent(*args, *persistent))
    assert out.shape == (0, B, H)
    torch.testing.assert_close(h_n, h0, rtol=0, atol=0)
    args = (out, g_h, x, empty, empty, kind, params, saved, reverse, 1e-5)
    grads = (emulated_cuda_ext.backward(*args) if persistent is None
             else emulated_cuda_ext.backward_persistent(*args, *persistent))
    assert grads[0].shape == (0, B, 3)
    torch.testing.assert_close(grads[1], g_h, rtol=0, atol=0)
    for g, p in zip(grads[2:], params):
        if p.numel():
            torch.testing.assert_close(g, torch.zeros_like(p), rtol=0, atol=0)


@pytest.mark.parametrize("gemm", ["auto", "tiled"])
def test_cuda_driver_of_no_rows_emulated(emulated_cuda_ext, monkeypatch, gemm):
    """x of B = 0 rows (the op's checks take it; the CPU op returns empty results): the per-step path launched its
    kernels (a block a row) and the tiled GEMM (a block a tile of rows) on a grid of no blocks, which a GPU refuses
    (invalid configuration argument; the emulation refuses it as a GPU does). Now nothing is launched where there is
    nothing to compute: out [T, 0, H], dx [T, 0, I], zero weight gradients, as the CPU op gives."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    monkeypatch.setenv("DTMT_CUDA_STEP_GEMM", gemm)   # (read once a process: "tiled" where this test is the first)
    T, H, dtype = 2, 5, torch.float64
    layer = make_layer("lgru", 3, H, depth=1, layer_norm=True, dtype=dtype)
    x, h0 = torch.randn(T, 0, 3, dtype=dtype), torch.randn(0, H, dtype=dtype)
    empty = x.new_empty(0)
    params = [empty if t is None else t.detach().contiguous() for t in flat_params(layer.direction_weights(0))]
    kind = KINDS["lgru"]
    out, h_n, *saved = emulated_cuda_ext.forward(x, h0, empty, empty, kind, params, False, 1e-5)
    assert out.shape == (T, 0, H) and h_n.shape == (0, H)
    grads = emulated_cuda_ext.backward(out, h_n, x, empty, empty, kind, params, saved, False, 1e-5)
    assert grads[0].shape == (T, 0, 3) and grads[1].shape == (0, H)
    for g, p in zip(grads[2:], params):
        if p.numel():
            torch.testing.assert_close(g, torch.zeros_like(p), rtol=0, atol=0)


@pytest.mark.parametrize("cell,depth,ln", [("lgru", 2, True), ("gru", 0, False), ("atr", 0, True)])
def test_cuda_backward_without_weight_grads_emulated(emulated_cuda_ext, cell, depth, ln):
    """transition_backward_cuda with weight_grads=False (what dk.nn.unrolled's steps call on the device, issue 73
    item 3): dx, dh0 and the layer-norm gradients as with weight_grads=True, and in the weight slots the
    pre-activation gradients the weight gradients are made of (ops.transition.grads.weight_grads of them gives
    weight_grads=True's), in float64, masked and with candidate dropout."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer, padding_mask
    from dtmt_kernels.ops.transition import KINDS, flat_params
    from dtmt_kernels.ops.transition.grads import weight_grads

    T, B, H, dtype = 3, 4, 9, torch.float64
    layer = make_layer(cell, 3, H, depth=depth, layer_norm=ln, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    x, h0 = torch.randn(T, B, 3, generator=gen, dtype=dtype), torch.randn(B, H, generator=gen, dtype=dtype)
    mask = padding_mask([3, 1, 2, 3], T, dtype)
    drop = (torch.rand(depth + 1, B, H, generator=gen) > 0.3).to(dtype) / 0.7 if cell != "atr" else x.new_empty(0)
    empty = x.new_empty(0)
    params = [empty if t is None else t.detach().contiguous() for t in flat_params(layer.direction_weights(0))]
    kind = KINDS[cell]
    _, _, *saved = emulated_cuda_ext.forward(x, h0, mask, drop, kind, params, False, 1e-5)
    g_out, g_h = torch.randn(T, B, H, generator=gen, dtype=dtype), torch.randn(B, H, generator=gen, dtype=dtype)
    args = (g_out, g_h, x, mask, drop, kind, params, saved, False, 1e-5)
    full, rows = emulated_cuda_ext.backward(*args), emulated_cuda_ext.backward_rows(*args)
    def given(t):
        return t is not None and t.numel() > 0

    for i in (0, 1, 6, 7, 10, 11):   # dx, dh0, the layer norms' gradients
        assert given(rows[i]) == given(full[i])
        if given(full[i]):
            torch.testing.assert_close(rows[i], full[i], rtol=0, atol=0)
    D, N = depth, T * B
    states = (saved[2] if saved[2].numel() else saved[1]).view(D + 1, N, H)
    formed = weight_grads(x.reshape(N, 3), states, rows[2], rows[4], rows[8], (True,) * 4 + (D > 0,) * 2)
    for got, i in zip(formed, (2, 3, 4, 5, 8, 9)):
        assert given(full[i]) == (got is not None)
        if given(full[i]):
            torch.testing.assert_close(got, full[i], rtol=1e-12, atol=1e-12)
    assert not any(given(rows[i]) for i in (3, 5, 9))   # the bias slots hold nothing


# (B, S, NH, D): D over a warp and not a multiple of it (a lane walks 2-3 values), one head, one source position,
# a block of warps only part filled (B·S·NH not a multiple of 8) and several blocks; D over a block (the scores'
# backward: a thread walks 2 values of d) and C = NH·D over a block (the context's forward: 2 blocks a row, head 1
# across their boundary)
ATTENTION_SHAPES = [(3, 5, 2, 37), (2, 1, 1, 70), (1, 7, 3, 5), (4, 9, 1, 32), (5, 3, 4, 1), (2, 3, 1, 300),
                    (2, 2, 2, 160)]


def _attention_reference_grads(keys, q, v, g):
    """The reference's scores for (keys, q, v) and their gradients for the output gradient g (float64 autograd)."""
    from dtmt_kernels import reference
    leaves = [t.detach().clone().requires_grad_() for t in (keys, q, v)]
    out = reference.additive_scores(*leaves)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B,S,NH,D", ATTENTION_SHAPES)
def test_attention_scores_kernels_emulated(emulated_cuda_ext, B, S, NH, D, dtype):
    """csrc/attention_cuda.cu's scores, forward and backward (emulated on host fibers), against
    reference.additive_scores and its autograd: float64 to 1e-12 (the same math in another order); float32 to float32
    rounding of the terms each output sums (the kernels' tanh is cell_math.h's, one exp, not torch's)."""
    gen = torch.Generator().manual_seed(B * 100 + S * 10 + D)
    keys, q, v = (torch.randn(*shape, generator=gen, dtype=dtype) * 1.5
                  for shape in ((B, S, NH, D), (B, NH, D), (NH, D)))
    g = torch.randn(B, NH, S, generator=gen, dtype=dtype)
    want, (dk_want, dq_want, dv_want) = _attention_reference_grads(keys.double(), q.double(), v.double(), g.double())
    out = emulated_cuda_ext.scores_forward(keys, q, v)
    dkeys, dq, dv = emulated_cuda_ext.scores_backward(g, keys, q, v)
    # float32: each to a bound of its own size (4e-6 of its largest term times the root of the terms it sums: the
    # scores D terms v tanh, dkeys one product g v (1 - tanh^2), dq S of them, dv S B terms g tanh)
    gm, vm = g.abs().max().item(), v.abs().max().item()
    bounds = {"scores": vm * D ** 0.5, "dkeys": gm * vm, "dq": gm * vm * S ** 0.5, "dv": gm * (S * B) ** 0.5}
    for label, got, ref in (("scores", out, want), ("dkeys", dkeys, dk_want), ("dq", dq, dq_want), ("dv", dv, dv_want)):
        assert got.dtype == dtype and got.shape == ref.shape, label
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=4e-6 * bounds[label])
        torch.testing.assert_close(got.double(), ref, **tol, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout", ["dense", "transposed", "sliced"])
@pytest.mark.parametrize("B,S,NH,D", ATTENTION_SHAPES)
def test_attention_context_kernels_emulated(emulated_cuda_ext, B, S, NH, D, layout, dtype):
    """csrc/attention_cuda.cu's context, forward and backward (emulated), against reference.attention_context and its
    autograd, with C = NH·D (2 column blocks a row at (2, 3, 1, 300) and (2, 2, 2, 160); (5, 3, 4, 1): four heads of
    one column). The values as they come from the encoder, a transposed [S, B, C] tensor, are read in place, and
    their gradient is laid out like them; values sliced out of wider rows are read in place too, and their gradient
    is dense (as torch.empty_like lays it out: strides other than the values'). Without the values' gradient the
    second result is empty and dalpha the same."""
    from dtmt_kernels import reference
    C = NH * D
    gen = torch.Generator().manual_seed(B * 100 + S * 10 + D + 1)
    alpha = torch.softmax(torch.randn(B, NH, S, generator=gen, dtype=dtype), -1)
    values = {"dense": lambda: torch.randn(B, S, C, generator=gen, dtype=dtype),
              "transposed": lambda: torch.randn(S, B, C, generator=gen, dtype=dtype).transpose(0, 1),
              "sliced": lambda: torch.randn(B, S, C + 3, generator=gen, dtype=dtype)[:, :, 1:C + 1]}[layout]()
    g = torch.randn(B, C, generator=gen, dtype=dtype)
    leaves = [alpha.double().requires_grad_(), values.double().requires_grad_()]
    want = reference.attention_context(*leaves)
    want.backward(g.double())
    out = emulated_cuda_ext.context_forward(alpha, values)
    dalpha, dvalues = emulated_cuda_ext.context_backward(g, alpha, values, True)
    dalpha_only, empty = emulated_cuda_ext.context_backward(g, alpha, values, False)
    # float32: each to a bound of its own size (4e-6 of its largest term times the root of the terms it sums: the
    # context S terms alpha values, dalpha D terms g values, dvalues one product g alpha)
    gm, vm = g.abs().max().item(), values.abs().max().item()
    bounds = {"context": vm * S ** 0.5, "dalpha": gm * vm * D ** 0.5, "dvalues": gm}
    for label, got, ref in (("context", out, want), ("dalpha", dalpha, leaves[0].grad),
                            ("dvalues", dvalues, leaves[1].grad)):
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=4e-6 * bounds[label])
        torch.testing.assert_close(got.double(), ref.detach(), **tol, msg=lambda m: f"{label}: {m}")
    assert dvalues.stride() == torch.empty_like(values).stride()
    assert (dvalues.stride() == values.stride()) == (layout != "sliced")
    assert empty.numel() == 0
    torch.testing.assert_close(dalpha_only, dalpha, rtol=0, atol=0)


@pytest.mark.parametrize("B,S,NH,D", [(0, 3, 2, 4), (2, 0, 2, 4), (2, 3, 2, 0)])
def test_attention_kernels_of_empty_sizes_emulated(emulated_cuda_ext, B, S, NH, D):
    """No batch rows, no source positions, or heads of no width: the results' shapes, zeros where a sum is empty, as
    the reference's (nothing launched where there is nothing to compute)."""
    from dtmt_kernels import reference
    keys, q, v = torch.randn(B, S, NH, D), torch.randn(B, NH, D), torch.randn(NH, D)
    g = torch.randn(B, NH, S)
    want, grads = _attention_reference_grads(keys.double(), q.double(), v.double(), g.double())
    for got, ref in zip((emulated_cuda_ext.scores_forward(keys, q, v), *emulated_cuda_ext.scores_backward(g, keys, q, v)),
                        (want, *grads)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    alpha, values, gc = torch.rand(B, NH, S), torch.randn(B, S, NH * D), torch.randn(B, NH * D)
    leaves = [alpha.double().requires_grad_(), values.double().requires_grad_()]
    want = reference.attention_context(*leaves)
    want.backward(gc.double())
    got = (emulated_cuda_ext.context_forward(alpha, values),
           *emulated_cuda_ext.context_backward(gc, alpha, values, True))
    for a, ref in zip(got, (want, *(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves))):
        assert a.shape == ref.shape
        torch.testing.assert_close(a.double(), ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,args,message", [
    ("scores_forward", lambda: (torch.zeros(2, 3, 4, 5), torch.zeros(2, 4, 6), torch.zeros(4, 5)),
     "of one NH and D; got keys [2, 3, 4, 5], q [2, 4, 6] and v [4, 5]"),
    ("scores_forward", lambda: (torch.zeros(2, 3, 4, 5), torch.zeros(2, 4, 5, dtype=torch.float64),
                                torch.zeros(4, 5)), "one device and one dtype"),
    ("scores_forward", lambda: (torch.zeros(2, 3, 4, 5, dtype=torch.bfloat16),
                                torch.zeros(2, 4, 5, dtype=torch.bfloat16), torch.zeros(4, 5, dtype=torch.bfloat16)),
     "float32 or float64"),
    ("scores_forward", lambda: (torch.zeros(2, 5, 4, 3).transpose(1, 3), torch.zeros(2, 4, 5), torch.zeros(4, 5)),
     "contiguous"),
    ("scores_backward", lambda: (torch.zeros(2, 4, 2), torch.zeros(2, 3, 4, 5), torch.zeros(2, 4, 5),
                                 torch.zeros(4, 5)), "grad must be a contiguous [B,NH,S]"),
    ("context_forward", lambda: (torch.zeros(2, 3, 4), torch.zeros(2, 4, 7)), "C divisible by NH"),
    ("context_forward", lambda: (torch.zeros(2, 3, 4), torch.zeros(2, 6, 4).transpose(1, 2)),
     "last dimension contiguous"),
    ("context_backward", lambda: (torch.zeros(2, 5), torch.zeros(2, 3, 4), torch.zeros(2, 4, 6), True),
     "grad must be a contiguous [B,C]"),
])
def test_attention_kernels_refuse_bad_arguments_emulated(emulated_cuda_ext, op, args, message):
    """The CUDA ops' argument checks (the same driver code as on a GPU): a one-line error naming what is wrong,
    before any launch."""
    with pytest.raises(RuntimeError, match=re.escape(message)):
        getattr(emulated_cuda_ext, op)(*args())


@pytest.mark.slow
@pytest.mark.parametrize("B", [8, 20, 70], ids=["row-gemm-full-pass", "tiled-gemm-two-tiles", "aten-mm"])
def test_cuda_kernels_emulated_batch_sizes(emulated_cuda_ext, B):
    """The time loops' GEMM the driver picks from B: B = 8, the row GEMM's largest batch (one full pass of 8
    rows); B = 20, the tiled GEMM over two row tiles (16 rows a tile); B = 70, above kSmallGemmRows (64), ATen's
    mm."""
    run_emulated = _emulated_sequence(emulated_cuda_ext)
    _compare_emulated(run_emulated, "lgru", 1, True, True, torch.float64, B=B, T=2, H=9)


def _peak_bytes(fn):
    """The peak of the bytes allocated (beyond those before) while fn() runs, from the profiler's record of every
    allocation and free of CPU tensors: the emulated driver's at::empty are host tensors, so this counts the CUDA
    driver's own allocations as it makes them on a GPU (not the device's allocator's rounding or cuBLAS's workspace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        events.append(e)
        todo.extend(e.children)
    allocations = sorted((e for e in events if e.typed[0].name == "Allocation"), key=lambda e: e.start_time_ns)
    base = allocations[0].typed[1].total_allocated - allocations[0].typed[1].alloc_size
    return max(e.typed[1].total_allocated for e in allocations) - base


@pytest.mark.slow
@pytest.mark.parametrize("cell,depth,ln,B,persistent,chunk,bound", [
    ("gru", 0, False, 24, None, 5, 0.8), ("atr", 0, False, 24, None, 5, 0.9), ("lgru", 2, True, 24, None, 5, 0.61),
    ("gru", 0, False, 24, (4, 32, -1, False), 5, 0.8), ("lgru", 2, True, 24, (4, 32, -1, False), 5, 0.61),
    ("gru", 0, False, 52, None, -1, 0.9), ("gru", 0, False, 24, None, -1, 1.12)],
    ids=["gru", "atr", "deep-transition", "gru-persistent", "deep-transition-persistent", "gru-2-chunks",
         "gru-one-chunk"])
def test_driver_peak_allocations_against_the_reference(emulated_cuda_ext, cell, depth, ln, B, persistent, chunk,
                                                       bound):
    """Issue 72's memory goal (peak memory of forward + backward at most the reference's), for what the CUDA driver
    allocates, counted on the CPU through the emulation at a B of the tiled step GEMM (as B = 64 on a GPU), T = 20.
    The backward's pre-activation gradients are formed a chunk of steps at a time (GradientChunks): in 4 chunks
    (5 steps, as the driver takes from B x T = 2,048 rows on) the GRU's peak is at most 0.8x the reference's, ATR's
    0.9x, the deep transition's 0.61x, per-step and persistent alike; in the 2 chunks the driver takes at B = 52
    (1,040 rows) the GRU's at most 0.9x. Below 1,024 rows the driver takes one chunk (the launches would cost more
    than the memory saves), and the GRU's peak is above the reference's, at most 1.12x (docs/design/gpu.md, "Memory
    of the cuda backend"). Each bound fails with one more buffer of the sequence's size (T x B x H)."""
    from conftest import make_layer

    torch.manual_seed(0)
    T, H = 20, 32
    layer = make_layer(cell, H, H, depth=depth, layer_norm=ln, dtype=torch.float32)
    x = torch.randn(T, B, H, requires_grad=True)
    h0, g = torch.zeros(B, H), torch.randn(T, B, H)
    run_emulated = _emulated_sequence(emulated_cuda_ext, persistent, chunk)
    if chunk < 0:   # (the driver's rule at these sizes)
        assert _chunk_steps(emulated_cuda_ext, layer, x) == (10 if B == 52 else 20)

    def reference():
        layer.backend = "reference"
        layer(x)[0].backward(g)

    def driver():
        run_emulated(x, h0, layer.direction_weights(0))[0].backward(g)

    reference()
    driver()   # (first calls outside the count: x.grad and the weights' .grad exist in both counts)
    ours, theirs = _peak_bytes(driver), _peak_bytes(reference)
    assert ours <= bound * theirs, (ours / theirs, bound)
    assert ours > 0.5 * theirs   # (the count sees the driver's tensors)


def test_backward_chunk_rule_emulated(emulated_cuda_ext):
    """The chunks of steps the driver's backward forms its gradients in (transition_cuda.cu's chunk_steps): one chunk
    below 1,024 rows (B x T) or without the weight gradients (the unrolled decoder's calls), at least 512 rows a
    chunk, at most 4 chunks, at most T."""
    from conftest import make_layer

    layer, deep = make_layer("gru", 2, 4), make_layer("lgru", 2, 4, depth=2, layer_norm=True)
    for (T, B), steps in {(50, 1): 50, (50, 8): 50, (20, 51): 20, (20, 52): 10, (30, 50): 15, (50, 64): 13,
                          (50, 256): 13, (3, 5000): 1, (0, 64): 0}.items():
        x = torch.zeros(T, B, 2)
        assert _chunk_steps(emulated_cuda_ext, layer, x) == steps, (T, B)
        assert _chunk_steps(emulated_cuda_ext, deep, x) == steps, (T, B)
        assert _chunk_steps(emulated_cuda_ext, layer, x, weight_grads=False) == T


@pytest.mark.slow
def test_backward_gradient_chunks_emulated(emulated_cuda_ext):
    """The backward with its pre-activation gradients formed a chunk of steps at a time (GradientChunks; the
    persistent backward one launch a chunk, each from the last one's carried gradient) gives the one-chunk
    backward's gradients to float64 rounding: every cell and depth with layer norm, mask, dropout and reversed
    time; chunks of 2 and 3 of T = 5 steps (a short last chunk), per-step and persistent (4 blocks); one case
    forwards in time and without layer norm."""
    from conftest import make_layer, padding_mask
    from dtmt_kernels.ops.transition import KINDS, flat_params

    ext = emulated_cuda_ext
    names = ["dx", "dh0", "dw_ih", "db_ih", "dw_hh", "db_hh", "dln_w", "dln_b", "dt_w", "dt_b", "dt_ln_w",
             "dt_ln_b"]
    T, B, H = 5, 3, 37
    for (cell, depth), ln, reverse in [(c, True, True) for c in EMULATED_CASES] + [(("lgru", 2), False, False)]:
        layer = make_layer(cell, 3, H, depth=depth, layer_norm=ln, dtype=torch.float64)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(T, B, 3, generator=gen, dtype=torch.float64)
        h0 = torch.randn(B, H, generator=gen, dtype=torch.float64)
        mask = padding_mask([T, 3, 1], T, torch.float64)
        drop = ((torch.rand(depth + 1, B, H, generator=gen) > 0.3).double() / 0.7 if cell != "atr"
                else x.new_empty(0))
        params = [x.new_empty(0) if p is None else p.detach().contiguous()
                  for p in flat_params(layer.direction_weights(0))]
        saved = list(ext.forward(x, h0, mask, drop, KINDS[cell], params, reverse, 1e-5)[2:])
        back = (torch.randn(T, B, H, generator=gen, dtype=torch.float64),
                torch.randn(B, H, generator=gen, dtype=torch.float64), x, mask, drop, KINDS[cell], params, saved,
                reverse, 1e-5)
        whole = ext.backward_chunked(*back, 0, 32, -1, False, T)
        for (grid, cluster), chunk in itertools.product(((0, False), (4, False), (4, -2)), (2, 3)):
            chunked = ext.backward_chunked(*back, grid, 32, -1, cluster, chunk)
            for name, a, b in zip(names, whole, chunked):
                if a is None or not a.numel():
                    assert b is None or not b.numel(), name
                    continue
                torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12, msg=lambda m: (
                    f"{cell}-d{depth} ln={ln} reverse={reverse} grid={grid} cluster={cluster} chunk={chunk} "
                    f"{name}: {m}"))


@pytest.mark.slow
@pytest.mark.parametrize("grid,threads,resident,cluster",
                         [(4, 32, -1, False), (1, 64, -1, False), (37, 32, -1, False), (4, 32, 1, False),
                          (3, 64, 0, False), (4, 32, -1, True), (16, 32, 1, True), (4, 32, -1, -2),
                          (16, 32, 1, -3)],
                         ids=["4-blocks", "1-block", "a-unit-each", "T-GRUs-from-L2", "all-from-L2", "one-cluster",
                              "cluster-of-13-T-GRUs-from-L2", "2-clusters-of-rows", "3-clusters-of-13-from-L2"])
def test_persistent_forward_emulated(emulated_cuda_ext, grid, threads, resident, cluster):
    """The persistent forward (csrc/persistent_cuda_kernels.cuh: one cooperative launch over every step and
    sub-cell, each block owning a slice of the H = 37 units, grid barriers between dependent phases, layer norm
    reduced across blocks) and the persistent backward (the same over reversed time, the matrices' columns held),
    run on the emulated grid: the forward's outputs and saved tensors equal the per-step forward's, the backward's
    gradients the per-step backward's on the same saved tensors (to float64 rounding: the products sum in another
    order), and both together give the reference's gradients. Rows whose sentence has ended (the mask) are skipped
    by both launches: the forward's saved tensors are compared on the rows still inside their sentences. Slices of 10 units (the last block 7), all 37 in one block (threads looping over several
    units), and one unit a block (a layer-norm statistic combined from 37 partials). 4 blocks: every cell and depth,
    layer norm on and off, with mask + reverse + dropout and without; the others the deepest layer-normed case.
    Matrices past shared memory (persistent_plan.h's spill, read through L2 on a GPU): the base cell's in shared
    memory and the T-GRUs' in the spill buffer (resident 1), and every sub-cell's in it (resident 0, 3 blocks of 13
    units, the last 11). The cluster form (one thread-block cluster, every barrier the cluster's: the emulation
    throws at a grid barrier in a cluster launch) with 4 blocks, and with 16 asked for (13 blocks of 3 units) and
    the T-GRUs' matrices from L2; and in several clusters, each the whole layer for its own batch rows (`cluster`
    -g: g clusters of ceil(B / g) rows): 2 clusters of 4 blocks (rows 2 and 1), 3 clusters of 13 blocks (a row
    each) with the T-GRUs' matrices from L2 (the blocks of one rank in the three clusters share a part of the spill
    buffer, each writing the same values)."""
    ext = emulated_cuda_ext
    cases = (itertools.product(EMULATED_CASES, (False, True), (True, False)) if grid == 4 and resident < 0
             and not cluster else [(("lgru", 2), True, True), (("atr", 0), True, True)])
    for (cell, depth), ln, full_features in cases:
        sys.path.insert(0, os.path.dirname(__file__))
        from conftest import make_layer, padding_mask
        from dtmt_kernels.ops.transition import KINDS, flat_params

        layer = make_layer(cell, 3, 37, depth=depth, layer_norm=ln, dtype=torch.float64)
        gen = torch.Generator().manual_seed(2)
        T, B = 4, 3
        x = torch.randn(T, B, 3, generator=gen, dtype=torch.float64)
        h0 = torch.randn(B, 37, generator=gen, dtype=torch.float64)
        mask = padding_mask([T, 2, 1], T, torch.float64) if full_features else x.new_empty(0)
        drop = ((torch.rand(depth + 1, B, 37, generator=gen) > 0.3).double() / 0.7
                if full_features and cell != "atr" else x.new_empty(0))
        params = [x.new_empty(0) if p is None else p.detach().contiguous()
                  for p in flat_params(layer.direction_weights(0))]
        args = (x, h0, mask, drop, KINDS[cell], params, full_features, 1e-5)
        steps = ext.forward(*args)
        persistent = ext.forward_persistent(*args, grid, threads, resident, cluster)
        # rows whose sentence has ended cost nothing in the persistent launches: their sub-cells' saved states and
        # products are not the per-step path's (the state carried through, products 0), and no gradient reads them
        valid = mask.bool() if full_features else torch.ones(T, B, dtype=torch.bool)
        pick = {"hs": lambda v: v[:, valid], "hp": lambda v: v[valid], "hpt": lambda v: v[:, valid]}
        for name, a, b in zip(["out", "h_n", "xp", "hs", "hs_lp", "hp", "hpt"], steps, persistent):
            a, b = pick.get(name, lambda v: v)(a), pick.get(name, lambda v: v)(b)
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{cell}-d{depth} ln={ln} full={full_features} {name}: {m}")
        if full_features:   # the ended rows' products are 0, and their states finite
            assert not bool(persistent[5][~valid].any()) and bool(persistent[3].isfinite().all())
        # the two backwards on the same saved tensors, gradient by gradient
        g_out, g_hn = torch.randn(T, B, 37, generator=gen, dtype=torch.float64), torch.randn(B, 37, generator=gen,
                                                                                              dtype=torch.float64)
        back = (g_out, g_hn, x, mask, drop, KINDS[cell], params, list(steps[2:]), full_features, 1e-5)
        for name, a, b in zip(["dx", "dh0", "dw_ih", "db_ih", "dw_hh", "db_hh", "dln_w", "dln_b", "dt_w", "dt_b",
                               "dt_ln_w", "dt_ln_b"], ext.backward(*back),
                              ext.backward_persistent(*back, grid, threads, resident, cluster)):
            if a is None or not a.numel():
                assert b is None or not b.numel(), name
                continue
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{cell}-d{depth} ln={ln} full={full_features} {name}: {m}")
        _compare_emulated(_emulated_sequence(ext, (grid, threads, resident, cluster)), cell, depth, ln, full_features,
                          torch.float64, B=3, T=3, H=37)


@pytest.mark.slow
@pytest.mark.parametrize("B,H,grid,groups,dtype",
                         [(5, 37, 4, 2, torch.float64), (7, 37, 4, 7, torch.float64), (9, 37, 4, 4, torch.float64),
                          (64, 80, 4, 2, torch.float64), (64, 80, 4, 3, torch.float32)],
                         ids=["B5-2-clusters", "B7-a-row-each", "B9-4-clusters-of-3-3-3", "B64-2-clusters-staged",
                              "B64-3-clusters-fp32"])
def test_persistent_clusters_of_batch_rows_emulated(emulated_cuda_ext, strict_fp32, B, H, grid, groups, dtype):
    """The cluster form in several thread-block clusters, each the whole layer (its blocks every unit, their barrier
    the cluster's) for its own batch rows: cluster g the rows [g r, (g + 1) r), r = ceil(B / groups), as many clusters
    as leave none empty (select_rows in csrc/persistent_cuda_kernels.cuh; docs/design/persistent_recurrence.md,
    "Clusters of batch rows"). B = 5 in 2 clusters (3 and 2 rows), B = 7 in 7 (a row each), B = 9 asked in 4 (rows 3:
    3 clusters, none empty), B = 64, H = 80 in 2 clusters of 32 rows (the stage in two buffers) and in 3 in float32
    (22, 22, 20 rows; strict fp32, FMA products). The emulation runs the clusters one after another, each to its end,
    and refuses a grid barrier in a cluster launch, so a row offset, a stride or a layer-norm partial left on the whole
    batch, or a barrier of the grid, fails it. Outputs and every gradient against the float64 reference, ragged lengths,
    reverse direction, dropout and layer norm on."""
    run = _emulated_sequence(emulated_cuda_ext, (grid, 32, -1, -groups))
    for cell, depth in (("lgru", 2), ("atr", 0)):
        _compare_emulated(run, cell, depth, True, True, dtype, B=B, T=3, H=H)


@pytest.mark.slow
@pytest.mark.parametrize("B,H,groups,held,dtype,optin",
                         [(9, 37, 4, 2, torch.float64, None), (5, 37, 2, 1, torch.float64, None),
                          (64, 80, 3, 2, torch.float32, None), (64, 80, 3, 2, torch.float32, 130000)],
                         ids=["B9-3-clusters-held-2", "B5-2-clusters-held-1", "B64-3-clusters-held-2-fp32",
                              "B64-3-clusters-held-2-stage-sized-again"])
def test_persistent_clusters_regrouped_where_the_device_holds_fewer_emulated(emulated_cuda_ext, strict_fp32, B, H,
                                                                             groups, held, dtype, optin):
    """Where the device holds fewer clusters of batch rows at once than the plan has (cudaOccupancyMaxActiveClusters;
    the emulation's clusters_held), launch_persistent takes fewer clusters of more rows each (regroup_rows in
    csrc/persistent_cuda_kernels.cuh), their shared memory sized again for the rows, so that none waits for another
    to end: B = 9 planned in 3 clusters of 3 rows, held 2: 2 of 5 and 4; B = 5 in 2, held 1: one cluster of every
    row; B = 64 in 3 of 22 rows, held 2: 2 of 32 (the stage in two buffers, strict fp32). Every launch is counted at
    the regrouped number of clusters, and outputs and every gradient match the float64 reference (ragged lengths,
    reverse direction, dropout and layer norm on): rows, strides, layer-norm partials and the stage of a cluster
    larger than planned. With 130,000 B of shared memory a block (`optin`), the L-GRU's backward stage planned for 22
    rows (whole rows of 320 columns, 116,096 B) would take 32 rows past it (about 137,600 B, which the emulated
    launch refuses as the device does): the stage is sized again for the rows (two buffers of 96 columns, 122,240 B;
    persistent_plan's figures)."""
    ext = emulated_cuda_ext
    run = _emulated_sequence(ext, (4, 32, -1, -groups))
    regrouped = -(-B // -(-B // held))
    ext.set_clusters_held(held)
    if optin is not None:
        ext.set_smem_optin(optin)
    try:
        launches, clusters = ext.cluster_launches()
        for cell, depth in (("lgru", 2), ("atr", 0)):
            _compare_emulated(run, cell, depth, True, True, dtype, B=B, T=3, H=H)
        launches, clusters = (a - b for a, b in zip(ext.cluster_launches(), (launches, clusters)))
    finally:
        ext.set_clusters_held(0)
        ext.set_smem_optin(232448)
    assert launches >= 4 and clusters == launches * regrouped, (launches, clusters, regrouped)


@pytest.mark.slow
@pytest.mark.parametrize("B,grid,threads", [(1, 37, 32), (2, 37, 64), (1, 4, 64), (2, 4, 32), (6, 4, 64)],
                         ids=["B1-unit-each", "B2-unit-each-64-threads", "B1-4-blocks", "B2-4-blocks", "B6-4-blocks"])
def test_persistent_products_spread_over_lanes_emulated(emulated_cuda_ext, B, grid, threads):
    """The persistent launches' FMA products (block_dots in csrc/persistent_cuda_kernels.cuh) where a block has fewer
    tiles (4 matrix rows by up to 4 batch rows: B where B <= 2) than threads: each tile summed by 2 to 32 threads
    over every lanes-th column, combined by shuffles. At B = 1 and 2 with a unit a block, each sub-cell's rows (3 or
    4 forward, 1 backward) make one tile of all 32 threads (rows past the last repeated, their sums not stored); with
    4 blocks (10 units: 30 or 40 rows forward, 10 backward), 2 to 16 lanes a tile; at B = 6 two tiles of 4 batch
    rows, the second's last two repeating row 5. Outputs and every gradient against the float64 reference, ragged
    lengths (tiles of live and ended rows), reverse direction, dropout and layer norm on."""
    run = _emulated_sequence(emulated_cuda_ext, (grid, threads, -1, False))
    for cell, depth in (("lgru", 2), ("atr", 0)):
        _compare_emulated(run, cell, depth, True, True, torch.float64, B=B, T=3, H=37)


@pytest.fixture
def strict_fp32():
    """TF32 off for the products, whatever the environment asked for: the persistent launches' float products on FMA
    (persistent_mma reads the flag at each call, as cuBLAS does)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B,H,grid,threads,resident", [(2, 40, 4, 64, -1), (64, 80, 4, 64, 2), (64, 81, 3, 32, 1)],
                         ids=["whole-rows-16-byte-loads", "chunks-16-byte-loads", "chunks-odd-rows"])
def test_persistent_products_through_the_stage_emulated(emulated_cuda_ext, strict_fp32, B, H, grid, threads,
                                                         resident, dtype):
    """The persistent launches' FMA products read the vectors every output shares (forward the state, backward the
    pre-activation gradients) from block_dots' stage in shared memory (stage_issue in
    csrc/persistent_cuda_kernels.cuh; the driver's choice wherever the products are not on tensor cores). B = 2,
    H = 40 in float64: whole rows at once, 16-byte loads (two values); B = 64, H = 80: 64 x 80 x 8 bytes is past the
    32 KB of whole rows, so two buffers of half a row rounded up to 32 columns, the next chunk copied while one is
    summed (forward and ATR's backward, H: 64 + 16; the L-GRU's backward, 4H = 320: 160 + 160), 16-byte loads;
    H = 81: the states' rows and ATR's gradients' are of odd length, one value a load (the last chunk 17 columns),
    the L-GRU's base gradients (4H = 324, as 192 + 132) 16-byte loads. Outputs and every gradient against the
    float64 reference, with ragged lengths, reverse direction, dropout and layer norm on. (Each path fails this test
    when broken: an offset off in the 16-byte copy fails all three, in the one-value copy the third, a chunk's column
    offset dropped the last two; without the wait on the asynchronous copies, whose emulation makes a copy at its
    wait, the first; the last chunk left in flight, stage_wait(1) for it too, the second.) In float32 with TF32 off
    (strict fp32, the products on FMA: the persistent launches' float path by default) the same against the float64
    reference, 16-byte copies of four values, and rows of odd length at H = 81. At B = 64 the L-GRU's top sub-cells'
    matrices are read from L2 (`resident` 2 and 1 of 3, as the plan has them in float64): all of them in shared
    memory, a block would need more than a GPU's 227 KB (the emulated launch refuses it as the device does; it had
    run it, the backward's stage squeezed out)."""
    run = _emulated_sequence(emulated_cuda_ext, (grid, threads, resident, False))
    for cell, depth in (("lgru", 2), ("atr", 0)):
        _compare_emulated(run, cell, depth, True, True, dtype, B=B, T=2, H=H)


@pytest.mark.slow
@pytest.mark.parametrize("B,H,grid,threads,blocks,resident", [(2, 40, 4, 64, 2, -1), (64, 80, 4, 64, 2, 2),
                                                              (64, 80, 4, 32, 4, 2), (5, 38, 4, 64, 2, -1),
                                                              (128, 80, 8, 32, 2, -1)],
                         ids=["whole-rows-pairs", "chunks-pairs", "chunks-one-cluster-of-4", "last-block-shorter",
                              "buffers-refilled"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_persistent_stage_read_once_a_cluster_emulated(emulated_cuda_ext, strict_fp32, B, H, grid, threads, blocks,
                                                       resident, dtype):
    """The grid form in thread-block clusters whose blocks read the products' stage from global memory once a
    cluster (StageShare in csrc/persistent_cuda_kernels.cuh: block r of a cluster bulk-copies rows r, r + blocks, ...
    of each chunk into every block's stage, multicast, counted by each block's mbarrier; a cluster barrier before a
    buffer's refill), emulated with cooperative launches in clusters (tests/cuda_emulation.h: the copies land at their
    issue in odd grid phases, at the mbarrier's completion in even ones). Float64 rows of 16-byte multiples: B = 2,
    H = 40, whole rows; B = 64, H = 80, two buffers (forward 64 + 16 columns, the L-GRU's backward 160 + 160), in
    clusters of 2 and one cluster of all 4 blocks; H = 38 on 4 blocks (10, 10, 10 and 8 units: the last block's
    products take the shape of the others', as the copies must be the same in every block); B = 128 on 8 blocks,
    where the stage's room leaves 32 columns a buffer (the L-GRU's forward in chunks of 32, 32 and 16, ATR's
    backward of 32 columns five times: a buffer refilled while the other block of the cluster may still read it).
    Outputs and every gradient against the float64 reference, ragged lengths, reverse direction, dropout and layer
    norm on; the bulk copies counted, so that the shared path is the one checked. (Without the mbarrier wait every
    case fails; without the cluster barrier before a refill the last.) The same in strict fp32 (TF32 off: FMA
    products, the multicast's default float path), against the float64 reference. At B = 64 the L-GRU's top T-GRU's
    matrices are read from L2 (`resident` 2 of 3: all in shared memory is past a GPU's 227 KB a block in float64,
    which the emulated launch refuses as the device does); the 8 blocks of about 200 KB at B = 128 need a device of
    8 SMs (one such block an SM: the emulated device's 4 refuse the cooperative launch)."""
    ext = emulated_cuda_ext
    before = ext.bulk_copies()
    run = _emulated_sequence(ext, (grid, threads, resident, blocks))
    ext.set_multiprocessors(max(4, grid))
    try:
        for cell, depth in (("lgru", 2), ("atr", 0)):
            _compare_emulated(run, cell, depth, True, True, dtype, B=B, T=3, H=H)
    finally:
        ext.set_multiprocessors(4)
    assert ext.bulk_copies() > before


def _lgru_launch_arguments(ext):
    """The arguments of a persistent forward and backward (but the launch's grid, threads, resident and cluster) of a
    float64 L-GRU of depth 1, H = 37, layer norm on, T = 2, B = 3, the backward's saved tensors from the per-step
    forward: for the tests of launches refused before they run."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = make_layer("lgru", 3, 37, depth=1, layer_norm=True, dtype=torch.float64)
    x, h0 = torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(3, 37, dtype=torch.float64)
    params = [x.new_empty(0) if p is None else p.detach().contiguous() for p in flat_params(layer.direction_weights(0))]
    args = (x, h0, x.new_empty(0), x.new_empty(0), KINDS["lgru"], params, False, 1e-5)
    saved = list(ext.forward(*args)[2:])
    back = (torch.randn(2, 3, 37, dtype=torch.float64), torch.randn(3, 37, dtype=torch.float64), x, args[2], args[3],
            KINDS["lgru"], params, saved, False, 1e-5)
    return args, back


@pytest.mark.slow
def test_persistent_launches_refuse_partial_warps_emulated(emulated_cuda_ext):
    """block_dots and join_blocks shuffle across whole warps: a persistent launch of 16 or 48 threads a block is
    refused, forward and backward, with a one-line error that names the count (the driver launches 256); so are
    clusters sharing the stage that do not divide the grid or pass a cluster's 16 blocks."""
    args, back = _lgru_launch_arguments(emulated_cuda_ext)
    for threads in (16, 48):
        with pytest.raises(RuntimeError, match=f"persistent forward needs a whole number of warps a block, got "
                                               f"{threads} threads"):
            emulated_cuda_ext.forward_persistent(*args, 4, threads, -1, False)
        with pytest.raises(RuntimeError, match=f"persistent backward needs a whole number of warps a block, got "
                                               f"{threads} threads"):
            emulated_cuda_ext.backward_persistent(*back, 4, threads, -1, False)
    # clusters sharing the stage must divide the grid (4 blocks of 10 units at H = 37): 3 does not, 17 is past a
    # cluster's most (the tests' `cluster` argument: n >= 2 asks for the grid form in clusters of n)
    for blocks in (3, 17):
        for direction, run in (("forward", lambda: emulated_cuda_ext.forward_persistent(*args, 4, 32, -1, blocks)),
                               ("backward", lambda: emulated_cuda_ext.backward_persistent(*back, 4, 32, -1, blocks))):
            with pytest.raises(RuntimeError, match=f"the persistent {direction}'s clusters sharing the stage must be 1 "
                                                   f"to 16 blocks dividing the grid, in the grid form; got {blocks} "
                                                   f"for a grid of 4"):
                run()


def test_persistent_launch_past_the_device_refused_emulated(emulated_cuda_ext):
    """A cooperative launch the device cannot hold is refused as a GPU refuses it, forward and backward, with the
    runtime's words: 37 blocks of 256 threads on the emulated device of 4 SMs (8 such blocks an SM: 32 at once) is
    "too many blocks in cooperative launch"; all of an L-GRU's matrices in shared memory at H = 37 where a block may
    opt into 2 KB is "invalid argument". (The emulation had run both: a launch planned past the device passed here
    and would fail on a GPU.) 37 blocks of 64 threads (32 an SM) run (test_persistent_products_spread_over_lanes)."""
    args, back = _lgru_launch_arguments(emulated_cuda_ext)
    for grid, threads, optin, error in ((37, 256, 232448, "too many blocks in cooperative launch"),
                                        (4, 32, 2048, "invalid argument")):
        emulated_cuda_ext.set_smem_optin(optin)
        try:
            with pytest.raises(RuntimeError, match=f"emulated launch failed: {error}"):
                emulated_cuda_ext.forward_persistent(*args, grid, threads, -1, False)
            with pytest.raises(RuntimeError, match=f"emulated launch failed: {error}"):
                emulated_cuda_ext.backward_persistent(*back, grid, threads, -1, False)
        finally:
            emulated_cuda_ext.set_smem_optin(232448)


def test_emulated_shuffle_is_a_warp_rendezvous(emulated_cuda_ext):
    """In a cooperative launch a shuffle waits for its own warp's lanes only (tests/cuda_emulation.h), and a warp runs
    on past it ahead of the block's other warps: a thread of warp 0 that reads shared memory after a shuffle, written
    by warp 1 before the shuffle without a block barrier between, reads what was there before (the emulated launch's
    0xFF bytes: NaN), as it may on a GPU; with the barrier, warp 1's 7. (The shuffle had been a block-wide barrier
    here, which hid such a missing __syncthreads: it read 7 either way.) The shuffle's value is lane 0's either way.
    A shuffle of a warp whose other lanes have returned (undefined on a GPU for a full mask) fails the launch."""
    stale, shuffled = emulated_cuda_ext.shuffle_order(0)
    assert math.isnan(stale) and shuffled == 0.0, (stale, shuffled)
    assert emulated_cuda_ext.shuffle_order(1) == [7.0, 0.0]
    with pytest.raises(RuntimeError, match="emulated launch: a shuffle of a warp whose other lanes have ended"):
        emulated_cuda_ext.shuffle_order(2)


@pytest.mark.slow
def test_emulation_refuses_misused_barriers(emulated_cuda_ext):
    """tests/cuda_emulation.h refuses what a GPU would not run: a grid barrier in a cluster launch, a cluster barrier
    in a cooperative launch (both from inside the kernel: fiber_fail keeps the message and the launch raises it), a
    cluster of more than 16 blocks; each is the launch's RuntimeError, and the next launch runs as before (the
    scheduler of the failed one is gone: the cluster form of a layer still matches the reference)."""
    for which, message in ((0, "emulated grid_sync in a cluster launch (its barrier is cluster_sync)"),
                           (1, "emulated cluster_sync outside a cluster launch"),
                           (2, "emulated launch: clusters of 17 blocks in a grid of 17 (at most 16, dividing the "
                               "grid)")):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            emulated_cuda_ext.emulation_misuse(which)
    _compare_emulated(_emulated_sequence(emulated_cuda_ext, (4, 32, -1, True)), "lgru", 1, True, True,
                      torch.float64, B=2, T=2, H=9)


def _tf32(v):
    """float32 rounded to TF32 (10 mantissa bits), to nearest, ties away from zero (cvt.rna.tf32.f32)."""
    bits = v.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def _mma_slices(rows, B, threads, km=8):
    """Warps a tile of csrc/block_mma.cuh sums K over, for a block's `rows` matrix rows and B batch rows: the largest
    power of two ks with tiles * ks <= warps and ks <= a chunk's k-steps (64 / km); 1 where the tiles fill the
    warps."""
    tiles, warps, ks = -(-rows // 16) * -(-B // 16), threads // 32, 1
    while tiles * ks * 2 <= warps and ks * 2 <= 64 // km:
        ks *= 2
    return ks


def _k_order_products(a, b, valid, slices=1, km=8):
    """a [R, H] @ b [B, H]^T of float32 operands holding TF32 or bf16 values, each output summed in k order in float32
    (what the emulated MMA does; a product of two such values is exact in float32): [B, R], 0 on the rows that are
    not valid. With `slices` > 1, block_mma's K split: slice s sums the k-steps of km columns i with i % slices == s,
    in order, and the slices' sums are added in slice order."""
    sums = []
    for s in range(slices):
        acc = torch.zeros(b.shape[0], a.shape[0], dtype=torch.float32)
        for i in range(a.shape[1]):
            if (i // km) % slices == s:
                acc = acc + b[:, i:i + 1] * a[:, i].unsqueeze(0)
        sums.append(acc)
    total = sums[0]
    for acc in sums[1:]:
        total = total + acc
    return torch.where(valid.unsqueeze(1), total, torch.zeros_like(total))


def _assert_near_reference(layer, x, h0, mask, drop, g_out, g_hn, out, h_n, grads, tol, label):
    """A launch's out, h_n and backward `grads` (dx, dh0, then the ten parameter gradients in the ops' order:
    PARAM_NAMES) against the float64 reference of `layer`'s parameters for the loss <out, g_out> + <h_n, g_hn>
    (reverse direction), each within tol relative to its largest value; a parameter the layer lacks has an empty
    gradient."""
    from dtmt_kernels import reference as R
    from dtmt_kernels.ops.transition import PARAM_NAMES, flat_params

    def each(v, f):
        return [each(t, f) for t in v] if isinstance(v, list) else None if v is None else f(v)

    # the weights as the kernels take them (full-width biases: a layer-normed gate's leading zeros too), each a leaf
    xr, hr = x.detach().double().requires_grad_(), h0.detach().double().requires_grad_()   # (a leaf of its own)
    w0 = layer.direction_weights(0)
    fields = [f.name for f in dataclasses.fields(w0) if f.name != "cell"]
    w = dataclasses.replace(w0, **{k: each(getattr(w0, k), lambda t: t.detach().double().requires_grad_())
                                   for k in fields})
    ro, rh = R.transition_sequence(xr, hr, w, mask.double(), drop.double() if drop.numel() else None, True)
    ((ro * g_out.double()).sum() + (rh * g_hn.double()).sum()).backward()
    reference_grads = flat_params(dataclasses.replace(w, **{k: each(getattr(w, k), lambda t: t.grad) for k in fields}))
    wanted = {"out": ro, "h_n": rh, "dx": xr.grad, "dh0": hr.grad, **dict(zip(PARAM_NAMES, reference_grads))}
    got = {"out": out, "h_n": h_n, "dx": grads[0], "dh0": grads[1], **dict(zip(PARAM_NAMES, grads[2:]))}
    for name, ref in wanted.items():
        if ref is None:
            assert got[name] is None or got[name].numel() == 0, f"{label} {name}: a gradient for an absent parameter"
            continue
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(got[name].double(), ref.detach(), atol=tol * scale, rtol=tol,
                                   msg=lambda m: f"{label} {name}: {m}")


@pytest.fixture
def allow_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.slow
@pytest.mark.parametrize("H,B,grid,threads,resident", [(37, 3, 4, 32, 0), (70, 20, 3, 64, -1), (37, 3, 4, 128, -1)],
                         ids=["H37-B3-from-L2", "H70-B20", "H37-B3-K-split"])
def test_persistent_tf32_products_emulated(emulated_cuda_ext, allow_tf32, H, B, grid, threads, resident):
    """The persistent launches' products on tensor cores (csrc/block_mma.cuh), float32 storage with TF32 allowed
    (torch.backends.cuda.matmul.allow_tf32, read at each call as cuBLAS reads it), on the emulated grid:
    - every recurrent product the forward saved (hp, hpt) equals, to the bit, the product of the TF32-rounded matrix
      and state summed in k order in float32 (the emulated MMA's order; a GPU's differs), 0 on the ended rows;
    - TF32 is engaged: the products differ from the strict-fp32 launch's (TF32 off), whose are FMA;
    - forward and backward (both persistent) give the float64 reference's outputs and gradients to TF32's precision.
    H = 37, B = 3: the matrix in 3 (4-gate cells: 4 x 10 rows) or 2 row tiles for one warp, in passes; H = 70, B =
    20 (slices of 24 units, the last 22): two batch tiles, passes of two warps whose tiles straddle two batch tiles
    (5 row tiles of the T-GRUs), K in two chunks (three in the backward's 4H). At H = 37 every matrix is read from
    the spill buffer (L2 on a GPU) instead of shared memory (resident 0). H = 37 on 4 warps: fewer tiles than warps,
    so K is split over 2 warps a tile forward (4 backward), the slices' sums joined in slice order."""
    ext = emulated_cuda_ext
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer, padding_mask
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T = 3
    for cell, depth in (("lgru", 2), ("gru", 0), ("atr", 0)):
        layer = make_layer(cell, 3, H, depth=depth, layer_norm=True, dtype=torch.float32)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(T, B, 3, generator=gen)
        h0 = torch.randn(B, H, generator=gen)
        lengths = [T] + torch.randint(1, T + 1, (B - 1,), generator=gen).tolist()
        mask = padding_mask(lengths, T, torch.float32)
        drop = (torch.rand(depth + 1, B, H, generator=gen) > 0.3).float() / 0.7 if cell != "atr" else x.new_empty(0)
        params = [x.new_empty(0) if p is None else p.detach().contiguous()
                  for p in flat_params(layer.direction_weights(0))]
        args = (x, h0, mask, drop, KINDS[cell], params, True, 1e-5)
        out, h_n, xp, hs, hs_lp, hp, hpt = ext.forward_persistent(*args, grid, threads, resident, False)
        valid = mask.bool()
        w_hh, t_w = params[2], params[6]
        slice_ = -(-H // grid)   # (a block's units; every block's products take all its rows)
        base, tgru = (_mma_slices(rows * slice_, B, threads) for rows in (w_hh.shape[0] // H, 3))
        for t in range(T):
            assert torch.equal(hp[t], _k_order_products(_tf32(w_hh), _tf32(hs[0, t]), valid[t], base)), \
                f"{cell} hp {t}"
            for k in range(depth):
                assert torch.equal(hpt[k, t], _k_order_products(_tf32(t_w[k]), _tf32(hs[k + 1, t]), valid[t], tgru)), \
                    f"{cell} hpt {k} {t}"
        torch.backends.cuda.matmul.allow_tf32 = False
        strict = ext.forward_persistent(*args, grid, threads, resident, False)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert (strict[5] - hp).abs().max().item() > 1e-5 * hp.abs().max().item(), f"{cell}: TF32 not engaged"
        # forward + backward, both persistent with TF32, against the float64 reference
        gen = torch.Generator().manual_seed(4)
        g_out, g_hn = torch.randn(T, B, H, generator=gen), torch.randn(B, H, generator=gen)
        back = (g_out, g_hn, x, mask, drop, KINDS[cell], params, [xp, hs, hs_lp, hp, hpt], True, 1e-5)
        grads = ext.backward_persistent(*back, grid, threads, resident, False)
        _assert_near_reference(layer, x, h0, mask, drop, g_out, g_hn, out, h_n, grads, 1e-2,
                               f"{cell}-d{depth} H={H} B={B}")


def _halved_case(cell, depth, H, B, T, dtype, seed, layer_norm=True, lengths=None):
    """A ragged reverse-direction case in `dtype` storage for the emulated launches' 16-bit and FMA tests: the layer
    (layer norm on unless told, weights halved), x [T, B, 3], h0, the mask (of `lengths`, or the first row T steps
    and the others drawn), the ops' flat parameters, the forward's arguments without dropout, and the generator that
    drew them (for the gradients that follow)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_layer, padding_mask
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = make_layer(cell, 3, H, depth=depth, layer_norm=layer_norm, dtype=torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(0.5)
    layer = layer.to(dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, 3, generator=gen).to(dtype)
    h0 = torch.randn(B, H, generator=gen).to(dtype)
    if lengths is None:
        lengths = [T] + torch.randint(1, T + 1, (B - 1,), generator=gen).tolist()
    mask = padding_mask(lengths, T, torch.float32).to(dtype)
    params = [x.new_empty(0) if p is None else p.detach().contiguous()
              for p in flat_params(layer.direction_weights(0))]
    args = (x, h0, mask, x.new_empty(0), KINDS[cell], params, True, 1e-5)
    return layer, x, h0, mask, params, args, gen


@pytest.mark.slow
@pytest.mark.parametrize("H,B,grid,threads,resident", [(37, 3, 4, 32, 1), (70, 20, 3, 64, -1), (37, 3, 4, 128, 1)],
                         ids=["H37-B3-T-GRUs-from-L2", "H70-B20", "H37-B3-K-split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_storage_emulated(emulated_cuda_ext, H, B, grid, threads, resident, dtype):
    """bfloat16 and float16 storage on the emulated grid (tests/cuda_emulation.h's __nv_bfloat16 and __half, rounded
    as the device's conversions: the kernels convert through Cvt), the per-step path (its row or tiled GEMM in 16
    bits with float sums, the states kept in float and in 16 bits) and the persistent launches, whose products are
    16-bit MMA (csrc/block_mma.cuh):
    - every product the persistent forward saved (hp, hpt) equals, to the bit, the 16-bit operands (matrix and the
      state in 16 bits, hs_lp) multiplied exactly and summed in k order in float32, then rounded to the storage type;
      0 on the ended rows;
    - both paths' outputs and every gradient of both backwards are within 16-bit precision of the float64
      reference (1e-2 of each tensor's largest value, the per-step path 2e-2: measured 3.7e-3 and 8.8e-3 at worst);
      the two paths' outputs within 1e-2 of each other.
    At H = 37 the T-GRUs' matrices are read from the spill buffer (L2 on a GPU; the layout of a deep transition at
    H = 1024 in bf16 on an H100), the base cell's from shared memory (resident 1). On 4 warps K is split over 2
    warps a tile (k-steps of 16 columns), the slices' sums joined in slice order."""
    ext = emulated_cuda_ext
    sys.path.insert(0, os.path.dirname(__file__))
    from dtmt_kernels.ops.transition import KINDS

    T = 3
    for cell, depth in (("lgru", 2), ("gru", 0), ("atr", 0)):
        layer, x, h0, mask, params, args, gen = _halved_case(cell, depth, H, B, T, dtype, 5)
        out, h_n, xp, hs, hs_lp, hp, hpt = ext.forward_persistent(*args, grid, threads, resident, False)
        assert hp.dtype == dtype and hs_lp.dtype == dtype and hs.dtype == torch.float32
        valid = mask.bool()
        slice_ = -(-H // grid)   # (a block's units; every block's products take all its rows)

        def products(U, h, rows):
            ks = _mma_slices(U.shape[0] // H * slice_, B, threads, km=16)
            return _k_order_products(U.float(), h.float(), rows, ks, km=16).to(dtype)

        for t in range(T):
            assert torch.equal(hp[t], products(params[2], hs_lp[0, t], valid[t])), f"{cell} hp step {t}"
            for k in range(depth):
                assert torch.equal(hpt[k, t], products(params[6][k], hs_lp[k + 1, t], valid[t])), f"{cell} hpt"
        steps = ext.forward(*args)
        gen = torch.Generator().manual_seed(6)
        g_out, g_hn = torch.randn(T, B, H, generator=gen).to(dtype), torch.randn(B, H, generator=gen).to(dtype)
        back = (g_out, g_hn, x, mask, x.new_empty(0), KINDS[cell], params, [xp, hs, hs_lp, hp, hpt], True, 1e-5)
        grads = ext.backward_persistent(*back, grid, threads, resident, False)
        _assert_near_reference(layer, x, h0, mask, x.new_empty(0), g_out, g_hn, out, h_n, grads, 1e-2,
                               f"{cell}-d{depth} H={H} B={B} persistent")
        # the per-step path in 16 bits, forward and backward, against the same reference
        step_grads = ext.backward(g_out, g_hn, x, mask, x.new_empty(0), KINDS[cell], params, steps[2:], True, 1e-5)
        _assert_near_reference(layer, x, h0, mask, x.new_empty(0), g_out, g_hn, steps[0], steps[1], step_grads, 2e-2,
                               f"{cell}-d{depth} H={H} B={B} per-step")
        torch.testing.assert_close(steps[0].double(), out.double(), atol=1e-2, rtol=1e-2,
                                   msg=lambda m: f"{cell}-d{depth}: the per-step path's out: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("H,B,grid,threads", [(37, 3, 4, 64), (70, 20, 3, 32)], ids=["H37-B3", "H70-B20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["tf32-allowed", "bf16", "fp16"])
def test_persistent_fma_products_asked_for_emulated(emulated_cuda_ext, allow_tf32, monkeypatch, capfd, H, B, grid,
                                                    threads, dtype):
    """DTMT_CUDA_PRODUCTS=fma (csrc/transition_cuda.cu, a benchmarks' setting: bench_persistent.py's tf32-fma and
    bf16-fma) puts the persistent launches' products on FMA where the rule puts them on tensor cores: float32 with
    TF32 allowed, and 16-bit storage (a path the GPU's phase probe timed and nothing had checked).
    - the driver's launch counts: without the setting the forward and backward ran with tensor-core products, with it
      neither did; dk.persistent_plan's default says the same;
    - float32: every product the forward saved (hp, hpt) equals, to the bit, the strict-fp32 launch's (TF32 off, FMA),
      and differs from the TF32 launch's;
    - outputs and every gradient against the float64 reference, ragged lengths, layer norm, the reverse direction:
      within 1e-4 of each tensor's largest value in float32, 1e-2 in 16 bits;
    - any other value than auto and fma is ignored with a warning naming it."""
    import dtmt_kernels as dk

    ext = emulated_cuda_ext
    sys.path.insert(0, os.path.dirname(__file__))
    from dtmt_kernels.ops.transition import KINDS

    T = 3
    for cell, depth in (("lgru", 2), ("gru", 0), ("atr", 0)):
        layer, x, h0, mask, params, args, gen = _halved_case(cell, depth, H, B, T, dtype, 7)
        g_out, g_hn = torch.randn(T, B, H, generator=gen).to(dtype), torch.randn(B, H, generator=gen).to(dtype)

        def both(products):
            monkeypatch.setenv("DTMT_CUDA_PRODUCTS", products)
            before = ext.persistent_launches()
            fwd = ext.forward_persistent(*args, grid, threads, -1, False)
            back = (g_out, g_hn, x, mask, x.new_empty(0), KINDS[cell], params, list(fwd[2:]), True, 1e-5)
            grads = ext.backward_persistent(*back, grid, threads, -1, False)
            ran = [now - then for now, then in zip(ext.persistent_launches(), before)]
            return fwd, grads, (ran[0], ran[4])   # (launches in the grid form, those on tensor cores)

        (_, _, _, _, _, hp_tc, hpt_tc), _, ran = both("auto")
        assert ran == (2, 2), f"{cell}: without the setting the rule's tensor cores ({ran})"
        assert dk.persistent_plan(cell, depth, B, H, dtype, multiprocessors=132, shared_memory=232448).tensor_cores
        fwd, grads, ran = both("fma")
        assert ran == (2, 0), f"{cell}: DTMT_CUDA_PRODUCTS=fma left tensor-core launches ({ran})"
        assert not dk.persistent_plan(cell, depth, B, H, dtype, multiprocessors=132, shared_memory=232448).tensor_cores
        out, h_n, _, _, _, hp, hpt = fwd
        if dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False
            strict = ext.forward_persistent(*args, grid, threads, -1, False)
            torch.backends.cuda.matmul.allow_tf32 = True
            assert torch.equal(hp, strict[5]) and torch.equal(hpt, strict[6]), f"{cell}: not the FMA products"
            assert not torch.equal(hp, hp_tc), f"{cell}: the TF32 launch's products"
        _assert_near_reference(layer, x, h0, mask, x.new_empty(0), g_out, g_hn, out, h_n, grads,
                               1e-4 if dtype == torch.float32 else 1e-2, f"{cell}-d{depth} H={H} B={B} {dtype}")
    monkeypatch.setenv("DTMT_CUDA_PRODUCTS", "tensor")
    capfd.readouterr()
    ext.forward_persistent(*args, grid, threads, -1, False)   # (a plain binding's warning: on stderr)
    assert "DTMT_CUDA_PRODUCTS=tensor ignored: not one of auto, fma" in capfd.readouterr().err


# (cell, depth, layer norm, the rows' lengths of T = 3 steps, blocks, threads a block) for the matrix test below
MATRIX_CASES = [("lau", 0, False, [3, 1, 2], 4, 32), ("lau", 1, True, [3, 1, 2], 4, 256),
                ("lgru", 4, False, [1], 4, 256), ("lgru", 1, True, [3], 1, 256), ("gru", 0, False, [2, 3], 37, 32),
                ("atr", 0, False, [3, 2], 4, 64)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,products,tol", [(torch.float32, "strict", 2e-5), (torch.float32, "tf32", 3e-3),
                                                (torch.bfloat16, "auto", 1.5e-2), (torch.float16, "auto", 3e-3),
                                                (torch.bfloat16, "fma", 1.5e-2), (torch.float16, "fma", 3e-3)],
                         ids=["fp32-strict", "tf32", "bf16", "fp16", "bf16-fma", "fp16-fma"])
def test_persistent_launches_across_the_matrix_emulated(emulated_cuda_ext, strict_fp32, monkeypatch, dtype,
                                                        products, tol):
    """Issue 72 item 4's matrix where the other persistent tests leave it out: the LAU cell, layer norm off, depth 1
    and 4 (L-GRU + T-GRUs), B = 1, 256 threads a block (8 warps: the MMA's K split over more warps, block_dots'
    lanes), and candidate dropout, in float32 (strict: FMA products; TF32 allowed: tensor cores), and bf16 and fp16
    storage with the products on tensor cores and on FMA (DTMT_CUDA_PRODUCTS=fma). Each case is ragged (a row that
    ends before T = 3 steps; at B = 1 the only row ends after the first step, so that two steps have no live row),
    the reverse direction, H = 37 (not a multiple of any tile). Both launches (persistent forward and backward) ran,
    on tensor cores or not as asked; the ended rows' outputs are exactly 0 at forward time; outputs and every
    gradient are within tol of each tensor's largest value from the float64 reference (measured at worst: 4.9e-7
    strict fp32, 6.8e-4 TF32, 1.1e-3 fp16, 6.4e-3 bf16; the deep transitions the largest). Small on purpose: six
    cases of 1 to 3 rows a storage type, every cell's layer norm off once, the LAU's on and off. (In 16 bits the FMA
    and MMA products round mostly to the same values at H = 37: the launch counts are what tell the two apart.)"""
    ext = emulated_cuda_ext
    from dtmt_kernels.ops.transition import KINDS

    torch.backends.cuda.matmul.allow_tf32 = products == "tf32"   # (strict_fp32 puts the flag back)
    monkeypatch.setenv("DTMT_CUDA_PRODUCTS", "fma" if products == "fma" else "auto")
    for cell, depth, ln, lengths, grid, threads in MATRIX_CASES:
        B, T, H = len(lengths), 3, 37
        layer, x, h0, mask, params, args, gen = _halved_case(cell, depth, H, B, T, dtype, 9, ln, lengths)
        drop = ((torch.rand(depth + 1, B, H, generator=gen) > 0.3).float() / 0.7).to(dtype) if cell != "atr" \
            else x.new_empty(0)
        args = args[:3] + (drop,) + args[4:]
        g_out, g_hn = torch.randn(T, B, H, generator=gen).to(dtype), torch.randn(B, H, generator=gen).to(dtype)
        label = f"{cell}-d{depth} ln={ln} lengths={lengths} {grid}x{threads} {dtype} {products}"
        before = ext.persistent_launches()
        out, h_n, *saved = ext.forward_persistent(*args, grid, threads, -1, False)
        assert not bool(out[~mask.bool()].any()), f"{label}: an ended row's output"
        back = (g_out, g_hn, x, mask, drop, KINDS[cell], params, saved, True, 1e-5)
        grads = ext.backward_persistent(*back, grid, threads, -1, False)
        ran = [now - then for now, then in zip(ext.persistent_launches(), before)]
        assert (ran[0], ran[4]) == (2, 2 if products in ("tf32", "auto") else 0), f"{label}: launches {ran}"
        _assert_near_reference(layer, x, h0, mask, drop, g_out, g_hn, out, h_n, grads, tol, label)


def test_persistent_envelope():
    """Which layers fit the persistent launches (issue 72 item 3), from sizes alone (csrc/persistent_plan.h, the CUDA
    driver's arithmetic, through the CPU extension: dtmt_kernels.persistent_plan), on an H100/H200 (132 SMs, 227 KB
    of shared memory a block): every block's rows (forward) or columns (backward) of every recurrent matrix, each
    row its length rounded up to 32 and 8 more (matrix_pitch), plus its per-row buffers. Worked by hand: the deep
    transition at H = 512 (L-GRU + 4 T-GRUs, B = 64, fp32) takes 128 blocks of 4 units, 64 rows x 520 x 4 B +
    64 x 22 x 4 B = 138,752 B forward and (4 x 2,056 + 16 x 1,544) x 4 B + 64 x 52 x 4 B = 145,024 B backward: it
    fits; the FMA products' stage takes what is left: whole rows would take 64 x (512 + 8) x 4 B, over the 32 KB of
    a single copy, so two buffers of a multiple of 32 columns a row, each a row 32 B more (the pitch's most), in half
    of what is left: forward (232,448 - 138,752) / (64 x 4 B) = 366 values a row, 183 a buffer, 175 after the pitch:
    160 columns, 2 x 64 x 168 x 4 B = 86,016 B, so 224,768 B; backward (232,448 - 145,024) / 256 = 341, 170, 162:
    160 columns again, 231,040 B; at H = 1024 (8 units a block) the forward alone needs 128 x 1,032 x 4 = 528,384 B
    of matrix: it does not, in fp32 or fp64; one GRU layer at H = 512 fits at B = 256. With the products on tensor
    cores (TF32, 256 threads) each adds, at the next multiple of 128 B, block_mma's buffers: C (64 x 16 x 4 B =
    4,096), the matrix stage (16 x 72 x 4 B = 4,608) and the batch stage (64 x 72 x 4 B = 18,432): 138,752 + 27,136 =
    165,888 B and 145,024 + 27,136 = 172,160 B; it still fits. The default for tensor cores follows torch's TF32 flag
    for float32 (off by default), and is on for bfloat16.
    Past shared memory, with an H100's L2 (50 MiB, of which the spill may take half): the deep transition at H = 1024
    in bf16 (8 units a block; forward, the L-GRU's 4 x 8 rows x 1,032 x 2 B = 66,048 B and each T-GRU's 49,536 B;
    buffers 9,728 B; block_mma's 8,192 + 4,608 + 9,216 B) keeps 3 sub-cells in shared memory: 165,120 + 9,728 =
    174,848 (a multiple of 128) + 22,016 = 196,864 B (4 would need 246,400); the two top T-GRUs' rows,
    2 x 24,768 x 2 B x 128 blocks = 12,681,216 B, are read from L2. Backward, columns 8 x (4,096 + 8) and
    8 x (3,072 + 8), buffers 23,552 B, block_mma's 15,616 B: 3 kept, 164,224 + 23,552 = 187,776 + 15,616 =
    203,392 B, and 2 x 24,640 x 2 x 128 = 12,615,680 B from L2. In fp32 it would need 4 sub-cells from L2
    (4 x 99,072 B x 128 = 50.7 MB), over the 25 MiB: it does not fit."""
    import dtmt_kernels as dk

    h100 = dict(multiprocessors=132, shared_memory=232448)
    plan = dk.persistent_plan("lgru", 4, 64, 512, tensor_cores=False, **h100)
    assert (plan.fits, plan.grid, plan.slice, plan.forward_bytes, plan.backward_bytes) == (True, 128, 4, 224768,
                                                                                            231040)
    assert (plan.forward_stage, plan.backward_stage) == (160, 160)
    assert str(plan) == ("persistent: 128 blocks of 4 units; 220 / 226 KB of shared memory a block (forward / "
                         "backward) of 227 KB; FMA, staging 160 / 160 columns a row")
    tc = dk.persistent_plan("lgru", 4, 64, 512, tensor_cores=True, **h100)
    assert (tc.fits, tc.forward_bytes, tc.backward_bytes, tc.forward_stage, tc.backward_stage) == (True, 165888,
                                                                                                    172160, 0, 0)
    for dtype in (torch.float32, torch.float64):
        assert not dk.persistent_plan("lgru", 4, 64, 1024, dtype, **h100).fits
    assert dk.persistent_plan("gru", 0, 256, 512, tensor_cores=False, **h100).fits
    small = dk.persistent_plan("gru", 0, 8, 37, "float64", **h100)
    assert (small.grid, small.slice, small.tensor_cores) == (37, 1, False)
    assert str(dk.persistent_plan("lgru", 4, 64, 1024, "bfloat16", **h100)).startswith(
        "per-step: 128 blocks of 8 units would need 289 / 295 KB")
    h100_l2 = dict(h100, l2_cache=52428800)
    l2 = dk.persistent_plan("lgru", 4, 64, 1024, "bfloat16", **h100_l2)
    assert (l2.fits, l2.grid, l2.slice, l2.subcells, l2.forward_resident, l2.backward_resident) == (True, 128, 8, 5, 3,
                                                                                                    3)
    assert (l2.forward_bytes, l2.backward_bytes, l2.forward_spill, l2.backward_spill) == (196864, 203392, 12681216,
                                                                                          12615680)
    assert str(l2) == ("persistent: 128 blocks of 8 units; 192 / 199 KB of shared memory a block (forward / backward) "
                       "of 227 KB; the matrices of 2 / 2 of 5 sub-cells read from L2 (12.1 / 12.0 MiB of the 25 MiB "
                       "allowed); tensor cores")
    for dtype in (torch.float32, torch.float64):
        assert not dk.persistent_plan("lgru", 4, 64, 1024, dtype, **h100_l2).fits
    # the cluster form: clusters of at most 16 blocks, each the whole layer for its own batch rows, as many as the SMs
    # hold (132 // 16 = 8) up to one a row. On 16 SMs, one cluster: GRU H = 512, B = 8, fp32: 32 units a block,
    # 3 x 32 rows x 520 x 4 B + (8 x 4 x 32 + 8 x 6) x 4 B = 203,968 B forward, 32 x 1,544 x 4 B +
    # (8 x 10 x 32 + 8 x 12) x 4 B = 208,256 B backward; the stage: forward whole rows (8 x (512 + 8) x 4 B =
    # 16,640 B after 204,032), backward two buffers in what is left of 232,448 - 208,256 = 24,192 B: 756 values a
    # row, 378 a buffer, 370 after the pitch's 8, of 3H = 1,536: 352 columns at a time (2 x 8 x 360 x 4 B =
    # 23,040 B); at H = 9, one block a unit
    one = dk.persistent_plan("gru", 0, 8, 512, tensor_cores=False, cluster=16, **dict(h100, multiprocessors=16))
    assert (one.fits, one.cluster, one.groups, one.grid, one.slice, one.forward_bytes, one.backward_bytes) == (
        True, True, 1, 16, 32, 220672, 231296)
    assert (one.forward_stage, one.backward_stage) == (512, 352)
    assert str(one).startswith("persistent, one cluster: 16 blocks of 32 units; 216 / 226 KB")
    # on 132 SMs, 8 clusters of one row: 199,680 B of rows + (4 x 32 + 6) x 4 B = 200,216 B forward, its whole row
    # staged at 200,320: + (512 + 8) x 4 B rounded to 2,176 = 202,496; backward 197,632 + (10 x 32 + 12) x 4 B =
    # 198,960, whole rows of 3H at 199,040: + (1,536 + 8) x 4 B rounded to 6,272 = 205,312
    rows = dk.persistent_plan("gru", 0, 8, 512, tensor_cores=False, cluster=16, **h100)
    assert (rows.fits, rows.cluster, rows.groups, rows.grid, rows.forward_bytes, rows.backward_bytes) == (
        True, True, 8, 16, 202496, 205312)
    assert (rows.forward_stage, rows.backward_stage) == (512, 1536)
    assert str(rows).startswith(
        "persistent, 8 clusters each of its own batch rows: 16 blocks of 32 units; 198 / 200 KB")
    # B = 9 in 8 clusters would leave rows of 2 for 5 of them: 5 clusters; B = 1, one; B = 64, 8 of 8 rows
    assert [dk.persistent_plan("gru", 0, b, 512, tensor_cores=False, cluster=16, **h100).groups
            for b in (9, 1, 64)] == [5, 1, 8]
    # B = 256, 32 rows a cluster: the backward's rows (234 KB) do not fit beside them, so its matrix is read from L2
    # (16 blocks' columns of 3 x 512 + pitch, 3,162,112 B, one buffer the 8 clusters share); without L2 no plan
    wide = dk.persistent_plan("gru", 0, 256, 512, tensor_cores=False, cluster=16, **h100_l2)
    assert (wide.fits, wide.groups, wide.forward_resident, wide.backward_resident, wide.backward_spill) == (
        True, 8, 1, 0, 3162112)
    assert not dk.persistent_plan("gru", 0, 256, 512, tensor_cores=False, cluster=16, **h100).fits
    nine = dk.persistent_plan("gru", 0, 8, 9, cluster=16, **h100)
    assert (nine.grid, nine.cluster, plan.cluster) == (9, True, False)
    assert not dk.persistent_plan("lgru", 4, 8, 1024, "bfloat16", cluster=16, **h100_l2).fits
    kept = dk.persistent_plan("lgru", 4, 64, 512, tensor_cores=False, **h100_l2)   # it fits: nothing from L2
    assert (kept.forward_bytes, kept.backward_bytes, kept.forward_resident, kept.forward_spill, str(kept)) == (
        plan.forward_bytes, plan.backward_bytes, 5, 0, str(plan))
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = flag
            assert dk.persistent_plan("gru", 0, 8, 64, **h100).tensor_cores == flag
            assert dk.persistent_plan("gru", 0, 8, 64, torch.bfloat16, **h100).tensor_cores
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_persistent_plan_of_the_stage_read_once_a_cluster():
    """persistent_plan's multicast form (persistent_plan.h; the driver's under DTMT_CUDA_RECURRENCE=
    persistent-multicast): the grid in whole clusters, every block owning units, the stage's two mbarriers (128 bytes)
    after the stage and the stage's room less them; with tensor cores, or where no grid of whole clusters exists,
    the plain grid form (multicast 1)."""
    import dtmt_kernels as dk

    h100 = dict(multiprocessors=132, shared_memory=232448, tensor_cores=False)
    plain = dk.persistent_plan("gru", 0, 64, 512, **h100)
    for blocks in (2, 4):
        shared = dk.persistent_plan("gru", 0, 64, 512, multicast=blocks, **h100)
        assert (shared.multicast, shared.grid, shared.slice) == (blocks, 128, 4)   # (128 = 512 / 4, whole clusters)
        assert (shared.forward_stage, shared.backward_stage) == (plain.forward_stage, plain.backward_stage)
        assert (shared.forward_bytes, shared.backward_bytes) == (plain.forward_bytes + 128, plain.backward_bytes + 128)
        assert str(shared).startswith(f"persistent, in clusters of {blocks} reading the stage once: 128 blocks of 4 "
                                      "units;")
    # H = 9 (9 blocks of a unit in the grid form): grids of 8, 6 and 4 blocks would leave blocks without units
    # (slices of 2, 2 and 3 fill 5, 5 and 3 blocks), so 2 blocks of 5 units
    nine = dk.persistent_plan("gru", 0, 8, 9, multicast=2, **h100)
    assert (nine.grid, nine.slice, nine.multicast) == (2, 5, 2), str(nine)
    assert dk.persistent_plan("gru", 0, 8, 1, multicast=2, **h100).multicast == 1   # (one unit: no two blocks)
    assert dk.persistent_plan("gru", 0, 64, 512, "bfloat16", multicast=2, multiprocessors=132,
                              shared_memory=232448).multicast == 1   # (tensor cores: no stage to share)


@pytest.mark.parametrize("args,kwargs,message", [
    (("sru", 0, 8, 64), {}, "cell must be one of gru, lgru, lau, atr, got 'sru'"),
    (("gru", -1, 8, 64), {}, "depth must be an integer from 0 to 64 (deeper layers run per step), got -1"),
    (("gru", 65, 8, 64), {}, "depth must be an integer from 0 to 64 (deeper layers run per step), got 65"),
    (("gru", True, 8, 64), {}, "depth must be an integer from 0 to 64 (deeper layers run per step), got True"),
    (("gru", 0, 0, 64), {}, "batch must be an integer from 1 to 16,777,216, got 0"),
    (("gru", 0, 2 ** 62, 64), {}, "batch must be an integer from 1 to 16,777,216, got 4611686018427387904"),
    (("gru", 0, 8, 2 ** 31 - 1), {}, "hidden must be an integer from 1 to 1,048,576, got 2147483647"),
    (("gru", 0, 8, 64.0), {}, "hidden must be an integer from 1 to 1,048,576, got 64.0"),
    (("gru", 0, 8, 64), {"multiprocessors": 0}, "multiprocessors must be an integer from 1 to 65,536, got 0"),
    (("gru", 0, 8, 64), {"multiprocessors": 2 ** 40}, "multiprocessors must be an integer from 1 to 65,536, got "),
    (("gru", 0, 8, 64), {"shared_memory": -1}, "shared_memory must be an integer from 0 to 281,474,976,710,656 "
                                               "(bytes a block may opt into), got -1"),
    (("gru", 0, 8, 64), {"tensor_cores": "yes"}, "tensor_cores must be True, False or None (the driver's choice), "
                                                 "got 'yes'"),
    (("gru", 0, 8, 64, "int8"), {}, "dtype must be one of float32, float64, bfloat16, float16, got 'int8'"),
    (("gru", 0, 8, 64), {"device": None}, "no CUDA device: give multiprocessors and shared_memory"),
    (("gru", 0, 8, 64), {"l2_cache": -1}, "l2_cache must be an integer from 0 to 281,474,976,710,656 (bytes), "
                                          "got -1"),
    (("gru", 0, 8, 64), {"cluster": 17}, "cluster must be an integer from 0 to 16 (blocks of one thread-block "
                                         "cluster; 0: the grid form), got 17"),
    (("gru", 0, 8, 64), {"multicast": 0}, "multicast must be an integer from 1 to 16 (blocks of a cluster sharing "
                                          "the stage, in the grid form: not with cluster), got 0"),
    (("gru", 0, 8, 64), {"multicast": 2, "cluster": 16}, "multicast must be 1 with cluster (the stage is shared in "
                                                         "the grid form), got 2"),
], ids=["cell", "depth", "too-deep", "depth-bool", "batch", "too-many-rows", "too-wide", "hidden-float", "no-sms",
        "too-many-sms", "shared-negative", "tensor-cores-str", "dtype", "no-device", "l2", "cluster", "multicast",
        "multicast-in-a-cluster"])
def test_persistent_plan_refuses_bad_arguments(args, kwargs, message):
    """One line naming the argument and the value; without a GPU, the device's numbers are asked for."""
    import dtmt_kernels as dk

    numbers = {} if "device" in kwargs else dict(multiprocessors=132, shared_memory=232448)
    if "device" in kwargs and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError) as exc:
        dk.persistent_plan(*args, **{**numbers, **{k: v for k, v in kwargs.items() if k != "device"}})
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_persistent_module_examples_are_current():
    """dtmt_kernels/ops/transition/persistent.py's examples (the plans it prints for an H100 / H200) are what
    persistent_plan says now: run as doctests (they were stale once, after a change of the stage's sizes)."""
    import doctest

    import dtmt_kernels.ops.transition.persistent as persistent

    result = doctest.testmod(persistent, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3 and result.failed == 0


def test_design_note_states_the_current_envelope():
    """docs/design/persistent_recurrence.md's envelope table is envelope_table's output for an H100/H200 at B = 64
    (`python benchmarks/bench_persistent.py --envelope --multiprocessors 132 --shared-memory 232448 --l2-cache
    52428800 --B 64`), and its cluster form's at B = 8 (the same with `--forms cluster --B 8`)."""
    from dtmt_kernels.ops.transition.persistent import envelope_table

    note = open(os.path.join(ROOT, "docs", "design", "persistent_recurrence.md"), encoding="utf-8").read()
    assert envelope_table(132, 232448, 64, 52428800) in note
    assert envelope_table(132, 232448, 8, 52428800, cluster=16) in note   # "One cluster" (`--forms cluster --B 8`)


_RECURRENCE_RUN = r"""
import importlib.util, sys, warnings
import torch
sys.path.insert(0, sys.argv[1])
import test_cuda_sources as t
spec = importlib.util.spec_from_file_location("dtmt_cuda_emulated", sys.argv[2])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("persistent:", ext.persistent_recurrence())
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params
    layer = make_layer("lgru", 3, 9, depth=1, layer_norm=True, dtype=torch.float64)
    params = [torch.empty(0, dtype=torch.float64) if p is None else p.detach().contiguous()
              for p in flat_params(layer.direction_weights(0))]
    print("plan:", ext.driver_plan(torch.zeros(3, 3, 3, dtype=torch.float64), KINDS["lgru"], params))
    deep = make_layer("gru", 3, 2, depth=65, dtype=torch.float64)   # (deeper than the plan takes)
    deep_params = [torch.empty(0, dtype=torch.float64) if p is None else p.detach().contiguous()
                   for p in flat_params(deep.direction_weights(0))]
    print("deep plan:", ext.driver_plan(torch.zeros(3, 3, 3, dtype=torch.float64), KINDS["gru"], deep_params))
    for cell, depth in (("lgru", 1), ("atr", 0)):
        t._compare_emulated(t._emulated_sequence(ext), cell, depth, True, True, torch.float64, B=3, T=3, H=9)
    print("launches:", ext.persistent_launches())
    ext.set_smem_optin(256)   # (a device whose blocks hold 256 bytes: no layer fits, its matrices read from L2 too)
    print("empty batch:", ext.driver_plan(torch.zeros(3, 0, 3, dtype=torch.float64), KINDS["lgru"], params))
    for cell, depth, B, H in (("lgru", 1, 3, 9), ("lgru", 1, 2, 9), ("gru", 0, 3, 12)):
        t._compare_emulated(t._emulated_sequence(ext), cell, depth, True, True, torch.float64, B=B, T=3, H=H)
    print("past the device:", ext.persistent_launches())
    ext.set_smem_optin(232448)
    ext.set_blocks_held(2)   # (other work holds the device: it takes 2 blocks of a cooperative launch at once)
    t._compare_emulated(t._emulated_sequence(ext), "lgru", 1, True, True, torch.float64, B=3, T=3, H=9)
    print("held:", ext.persistent_launches())
for w in caught:
    print("warning:", w.message)
"""


@pytest.mark.slow
@pytest.mark.parametrize("value", ["persistent", "persistent-cluster", "persistent-multicast", "steps", "sideways"])
def test_recurrence_switch(emulated_cuda_ext, value):
    """DTMT_CUDA_RECURRENCE (read once a process): `persistent` makes the driver's own forward and backward the
    persistent launches (at most one block per emulated SM, of 4: 3 blocks of 3 units at H = 9), `persistent-cluster`
    their cluster form (one cluster of at most 16 blocks: 9 at H = 9), `persistent-multicast` the grid form in
    clusters of 2 blocks sharing the stage (whole clusters: 2 blocks of 5 units, since 4 would leave 3 of 3), and
    they still give the reference's outputs and gradients; `steps` and an unknown value (ignored with a warning
    naming it) keep the per-step path; a layer deeper than the plan takes (65 T-GRUs) gets no plan, with a warning
    under the persistent values. On a device whose blocks hold 256 bytes of shared memory, no layer fits: the per-step
    path runs (the reference's results), each run counted (persistent_launches' `steps`), and each layer shape named
    once in a warning, two shapes in one process both (the warning had been once a process: the second shape ran
    unannounced), a shape seen again at another batch size not again; an empty batch before them is no plan and no
    warning (it had been "needs 0 KB", taking the shape's one warning). On a device that holds 2 blocks at once (other
    work on it), the grid form's cooperative launch of 3 blocks is refused at launch as a GPU refuses it: the per-step
    path runs, the refusals counted and named once."""
    env = {**os.environ, "DTMT_CUDA_RECURRENCE": value}
    res = subprocess.run([sys.executable, "-c", _RECURRENCE_RUN, os.path.dirname(os.path.abspath(__file__)),
                          emulated_cuda_ext.__file__], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"persistent: {value.startswith('persistent')}" in res.stdout, res.stdout
    plan = {"persistent": (3, False, 1), "persistent-cluster": (9, True, 1),
            "persistent-multicast": (2, False, 2)}.get(value, (0, False, 1))
    assert f"plan: {plan}" in res.stdout, res.stdout
    # which form ran: two layers, forward and backward each (grid, cluster, refused, multicast, and of them on tensor
    # cores: none in float64)
    ran = {"persistent": (4, 0, 0, 0, 0), "persistent-cluster": (0, 4, 0, 0, 0),
           "persistent-multicast": (0, 0, 0, 4, 0)}.get(value, (0, 0, 0, 0, 0))
    assert f"launches: {(*ran, 0)}" in res.stdout, res.stdout
    # past the device's shared memory: three layers of two shapes on the per-step path, forward and backward each,
    # counted as such (`steps`), and each shape named once, at its first batch size (not again at B = 2)
    asked = value.startswith("persistent")
    assert "empty batch: (0, False, 1)" in res.stdout, res.stdout   # (no plan, no warning: nothing to launch)
    assert f"past the device: {(*ran, 6 if asked else 0)}" in res.stdout, res.stdout
    said = res.stdout + res.stderr
    for shape, times in (("H=9, depth 1, B=3", 1), ("H=9, depth 1, B=2", 0), ("H=12, depth 0, B=3", 1)):
        assert said.count(f"a layer of {shape} needs ") == (times if asked else 0), said
        assert said.count(f"a layer of {shape} does not fit one thread-block cluster") == (
            times if value == "persistent-cluster" else 0), said
    # a device that holds 2 blocks at once refuses the grid form's 3 (the cluster form and the multicast form's 2
    # blocks run): forward and backward refused, counted, and run per step
    held = {"persistent": (4, 0, 2, 0, 0, 8), "persistent-cluster": (0, 6, 0, 0, 0, 6),
            "persistent-multicast": (0, 0, 0, 6, 0, 6)}.get(value, (0,) * 6)
    assert f"held: {held}" in res.stdout, res.stdout
    for direction in ("forward", "backward"):
        refused = (f"the device refused the persistent {direction} at H=9, depth 1, B=3 (too many blocks in "
                   f"cooperative launch): the per-step {direction} runs instead")
        assert said.count(refused) == (value == "persistent"), said
    warned = ("DTMT_CUDA_RECURRENCE=sideways ignored: not one of steps, persistent, persistent-cluster, "
              "persistent-multicast" in res.stdout + res.stderr)
    assert warned == (value == "sideways"), res.stdout + res.stderr
    # a layer past the plan's sizes: no plan, the per-step path, said once
    assert "deep plan: (0, False, 1)" in res.stdout, res.stdout
    past = ("a layer of H=2, depth 65, B=3 is past the persistent plan's sizes (depth <= 64, H <= 1048576, "
            "B <= 16777216)")
    assert (past in res.stdout + res.stderr) == value.startswith("persistent"), res.stdout + res.stderr


_FORCED_GEMM_RUN = r"""
import importlib.util, sys, warnings
import torch
sys.path.insert(0, sys.argv[1])
import test_cuda_sources as t
spec = importlib.util.spec_from_file_location("dtmt_cuda_emulated", sys.argv[2])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
run = t._emulated_sequence(ext)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("choices:", ext.step_gemm_choice(3), ext.step_gemm_choice(20), ext.step_gemm_choice(70))
    for B in (3, 20):
        t._compare_emulated(run, "lgru", 1, True, True, torch.float64, B=B, T=2, H=9)
for w in caught:
    print("warning:", w.message)
"""


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["rows", "tiled", "cublas", "sideways", "cublas-direct"])
def test_cuda_step_gemm_forced(emulated_cuda_ext, forced):
    """DTMT_CUDA_STEP_GEMM (read once a process, so each setting in a process of its own) puts the chosen GEMM at
    every batch size (the driver's choice read back at B = 3, 20, 70): the row GEMM at B = 20 (three passes of
    rows), the tiled GEMM at B = 3 (one part-filled tile), ATen's mm at both; outputs and all gradients against the
    reference. An unknown value is ignored with a warning naming the variable: the thresholds' choice; so is
    cublas-direct where the driver is built without cuBLAS (the emulation always is)."""
    env = {**os.environ, "DTMT_CUDA_STEP_GEMM": forced}
    res = subprocess.run([sys.executable, "-c", _FORCED_GEMM_RUN, os.path.dirname(os.path.abspath(__file__)),
                          emulated_cuda_ext.__file__], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    named = {"sideways": "DTMT_CUDA_STEP_GEMM=sideways ignored: not one of auto, rows, tiled, cublas, cublas-direct",
             "cublas-direct": "DTMT_CUDA_STEP_GEMM=cublas-direct ignored: built without cuBLAS's headers"}
    # (a warning through the autograd function arrives as a Python warning, one through a plain binding on stderr)
    for value, warning in named.items():
        assert (warning in res.stdout + res.stderr) == (forced == value), res.stdout + res.stderr
    # the GEMM chosen at B = 3, 20 and 70: the forced one, else the thresholds' (rows to 8, tiled to 64, cuBLAS)
    choice = {"rows": "0 0 0", "tiled": "1 1 1", "cublas": "2 2 2", "sideways": "0 1 2",
              "cublas-direct": "0 1 2"}[forced]
    assert f"choices: {choice}\n" in res.stdout, res.stdout
