// CUDA implementation of the deep transition block and ATR (built only when torch has CUDA: setup.py adds
// csrc/*.cu and defines DTMT_WITH_CUDA; registration.cpp then registers them as the CUDA kernels of
// dtmt::transition_forward / transition_backward).
//
// The algorithm is that of the Triton backend (dtmt_kernels/ops/transition/triton.py), with cuBLAS GEMMs through ATen
// and the fused kernels of transition_cuda_kernels.cuh:
//   forward:  xp = x W_ih^T + b_ih (one GEMM over T*B rows); per step and sub-cell: hp = h U^T (GEMM) and
//             one fused kernel (bias, per-gate layer norm, gates, candidate, dropout, state update; the last
//             sub-cell masks, writes out[t] and the next step's state into the saved-state buffer)
//   backward: per step and sub-cell (reverse order): one fused kernel recomputing the forward from the saved
//             pre-activations, then one GEMM d(hp) U for the path to the input state; weight gradients as
//             GEMMs after the loop, bias and layer-norm gradients as column sums (deterministic)
// The per-step GEMMs are kernels of the .cuh launched on raw pointers for small batches (the row GEMM up to
// kRowGemmRows rows, the tiled GEMM up to kSmallGemmRows) and ATen's mm (cuBLAS) above. The choice is made once
// per call, from B.
// Storage in the input dtype (float, double, half, bfloat16), h0 / h_n also in float for 16-bit inputs (h_n in
// h0's dtype, dh0 in grad_hn's); states, carried gradients and all kernel arithmetic in float (double for double
// inputs). Nothing synchronises with the host inside the loops.
#include <ATen/ATen.h>
#if !defined(DTMT_CUDA_EMULATION)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
// DTMT_DIRECT_CUBLAS (setup.py defines it, and links libcublas, where the toolkit has cuBLAS's headers): the step
// GEMMs may call cuBLAS directly, on torch's handle (set to torch's current stream, workspace and TF32 mode)
#if defined(DTMT_DIRECT_CUBLAS) && !defined(DTMT_CUDA_EMULATION)
#include <ATen/cuda/CUDAContextLight.h>
#include <cublas_v2.h>
#define DTMT_CUBLAS_DIRECT_BUILT 1
#endif

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "persistent_cuda_kernels.cuh"
#include "transition.h"
#include "transition_cuda_kernels.cuh"

#if defined(DTMT_CUDA_EMULATION)  // tests only: host tensors, kernels on host fibers (see the .cuh)
namespace c10 {
namespace cuda {
inline cudaStream_t getCurrentCUDAStream() { return nullptr; }
struct CUDAGuard {
  explicit CUDAGuard(const at::Device&) {}
};
}  // namespace cuda
}  // namespace c10
#define C10_CUDA_CHECK(err) TORCH_CHECK((err) == cudaSuccess, "dtmt: emulated launch failed")
#define DTMT_DISPATCH_TYPES(TYPE, NAME, ...) AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, TYPE, NAME, __VA_ARGS__)
#else
#define DTMT_DISPATCH_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)
#endif

namespace dtmt {
namespace {

using at::Tensor;

template <typename S> struct DeviceType { using type = S; };
template <> struct DeviceType<at::BFloat16> { using type = __nv_bfloat16; };
#if !defined(DTMT_CUDA_EMULATION)
template <> struct DeviceType<at::Half> { using type = __half; };
#endif

bool present(const Tensor& t) { return t.defined() && t.numel() > 0; }

// Batch rows up to which the time loops' GEMMs are kernels of the .cuh (a step: two kernel launches, no ATen
// dispatch): the row GEMM up to kRowGemmRows, the tiled GEMM up to kSmallGemmRows, cuBLAS above. Thresholds:
// docs/design/gpu.md, "Step GEMMs" (measured on an H100 and an H200).
constexpr int64_t kRowGemmRows = 8;
constexpr int64_t kSmallGemmRows = 64;
// kCublas: cublasGemmEx called here on raw pointers (no ATen dispatch; only through DTMT_CUDA_STEP_GEMM for now,
// until a GPU session measures it against the others: docs/design/gpu.md, "cuBLAS without ATen").
enum class StepGemm { kRows, kTiled, kAten, kCublas };

// DTMT_CUDA_STEP_GEMM=rows|tiled|cublas|cublas-direct (read once a process; for benchmarks) uses that GEMM at every
// batch size (cublas: ATen's mm; cublas-direct: cublasGemmEx on torch's handle); unset or auto: the thresholds above.
// Another value is ignored with a warning.
int forced_step_gemm() {
  static const int forced = [] {
    const char* env = std::getenv("DTMT_CUDA_STEP_GEMM");
    const std::string v = env != nullptr ? env : "";
    if (v.empty() || v == "auto") return -1;
    if (v == "rows") return static_cast<int>(StepGemm::kRows);
    if (v == "tiled") return static_cast<int>(StepGemm::kTiled);
    if (v == "cublas") return static_cast<int>(StepGemm::kAten);
    if (v == "cublas-direct") {
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
      return static_cast<int>(StepGemm::kCublas);
#else
      TORCH_WARN("dtmt: DTMT_CUDA_STEP_GEMM=cublas-direct ignored: built without cuBLAS's headers");
      return -1;
#endif
    }
    TORCH_WARN("dtmt: DTMT_CUDA_STEP_GEMM=", v, " ignored: not one of auto, rows, tiled, cublas, cublas-direct");
    return -1;
  }();
  return forced;
}
StepGemm step_gemm(int64_t B) {
  const int forced = forced_step_gemm();
  if (forced >= 0) return static_cast<StepGemm>(forced);
  return B <= kRowGemmRows ? StepGemm::kRows : B <= kSmallGemmRows ? StepGemm::kTiled : StepGemm::kAten;
}

#if defined(DTMT_CUBLAS_DIRECT_BUILT)
// cublasGemmEx's data and compute types for a storage type: 16-bit storage computes in float (as ATen's mm does)
template <typename T> struct CublasTypes;
template <> struct CublasTypes<float> {
  static constexpr cudaDataType_t data = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // TF32 where the handle's math mode allows it
  using Scale = float;
};
template <> struct CublasTypes<double> {
  static constexpr cudaDataType_t data = CUDA_R_64F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_64F;
  using Scale = double;
};
template <> struct CublasTypes<__half> {
  static constexpr cudaDataType_t data = CUDA_R_16F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  using Scale = float;
};
template <> struct CublasTypes<__nv_bfloat16> {
  static constexpr cudaDataType_t data = CUDA_R_16BF;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  using Scale = float;
};

// c[rows, n] = a[rows, k] . W, all row-major and dense: W given as w_nk [n, k] (c = a w_nk^T, the forward's h U^T)
// when w_transposed, else as w_kn [k, n] (c = a w_kn, the backward's d(pre) U). cuBLAS is column-major, so this is
// c^T = op(W)^T a^T with the operands swapped. `handle`: torch's (at::cuda::getCurrentCUDABlasHandle, taken once a
// call), with its current stream, workspace and TF32 mode. Unlike ATen's mm it leaves cuBLAS's default reduction
// for 16-bit inputs (torch's allow_fp16/bf16_reduced_precision_reduction are not read) and does not check
// CUBLAS_WORKSPACE_CONFIG under torch's deterministic mode: a benchmark's choice (DTMT_CUDA_STEP_GEMM) for now.
template <typename T>
void cublas_gemm(cublasHandle_t handle, const T* a, const T* w, T* c, int rows, int n, int k, bool w_transposed) {
  using Types = CublasTypes<T>;
  const typename Types::Scale one = 1, zero = 0;
  const cublasStatus_t status = cublasGemmEx(
      handle, w_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, &one,
      w, Types::data, w_transposed ? k : n, a, Types::data, k, &zero, c, Types::data, n, Types::compute,
      CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "dtmt: cublasGemmEx failed (status ", static_cast<int>(status),
              ") in the cuda backend's step GEMM");
}
#endif

template <typename T, typename S> const T* cptr(const Tensor& t, int64_t offset = 0) {
  return present(t) ? reinterpret_cast<const T*>(t.data_ptr<S>()) + offset : nullptr;
}
template <typename T, typename S> T* mptr(const Tensor& t, int64_t offset = 0) {
  return reinterpret_cast<T*>(t.data_ptr<S>()) + offset;
}

struct Dims {
  int64_t T, B, I, H, D, n_in, n_h, n_g;
};

Dims dims_of(const Tensor& x, const TransitionWeights& w) {
  Dims d;
  const int kind = static_cast<int>(w.kind);
  d.T = x.size(0);
  d.B = x.size(1);
  d.I = x.size(2);
  d.n_in = cell_input_rows(kind);
  d.n_h = cell_hidden_rows(kind);
  d.n_g = cell_ln_groups(kind);
  d.H = w.w_hh.size(0) / d.n_h;
  d.D = present(w.t_w) ? w.t_w.size(0) : 0;
  return d;
}

std::vector<int64_t> step_order(int64_t T, bool reverse) {
  std::vector<int64_t> order(T);
  for (int64_t s = 0; s < T; ++s) order[s] = reverse ? T - 1 - s : s;
  return order;
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The kernels keep a row's gate values (forward: NG*H, backward: 2*NG*H of them, in A) in shared memory, NG the
// largest layer-norm group count over the block's sub-cells. A hidden size whose row does not fit the device's
// per-block limit is refused here, with the reason, rather than by cudaFuncSetAttribute's "invalid argument".
template <typename A> void check_shared_memory(const Dims& d, int rows_per_group, const char* pass) {
#if !defined(DTMT_CUDA_EMULATION)
  const int64_t groups = std::max<int64_t>(d.n_g, d.D > 0 ? 2 : 0);
  const size_t bytes = sizeof(A) * (cuda::kRed + static_cast<size_t>(rows_per_group * groups * d.H));
  int device = 0, limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(bytes <= static_cast<size_t>(limit), "dtmt: the cuda backend's ", pass, " kernel needs ", bytes,
              " bytes of shared memory per block at hidden size ", d.H, "; this device allows ", limit,
              ". Use backend='triton' for this size.");
#else
  (void)d, (void)rows_per_group, (void)pass;
#endif
}

template <typename S>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                 const TransitionWeights& w, bool reverse, double eps) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, S_ = D + 1, BH = B * H;
  const auto opts = x.options();
  const auto acc_opts = opts.dtype(acc_type(x.scalar_type()));
  const bool lp = acc_type(x.scalar_type()) != x.scalar_type();
  check_shared_memory<A>(d, 1, "forward");

  Tensor xp = at::addmm(w.b_ih, x.reshape({T_ * B, d.I}), w.w_ih.t()).view({T_, B, d.n_in * H});
  Tensor hs = at::empty({S_, T_, B, H}, acc_opts);
  Tensor hs_lp = lp ? at::empty({S_, T_, B, H}, opts) : hs;
  Tensor hp = at::empty({T_, B, d.n_h * H}, opts);
  Tensor hpt = at::empty({D, T_, B, 3 * H}, opts);
  Tensor out = at::empty({T_, B, H}, opts);
  Tensor h_last = at::empty({B, H}, acc_opts);
  const auto order = step_order(T_, reverse);
  hs[0][order[0]].copy_(h0);
  if (lp) hs_lp[0][order[0]].copy_(h0);

  const bool ln = present(w.ln_w), tln = present(w.t_ln_w);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const StepGemm gemm = step_gemm(B);
  const Tensor w_hh = w.w_hh.contiguous(), t_w = D > 0 ? w.t_w.contiguous() : w.t_w;
  const Tensor w_hh_t = w_hh.t();
  std::vector<Tensor> t_w_t;
  if (gemm == StepGemm::kAten)
    for (int64_t k = 0; k < D; ++k) t_w_t.push_back(t_w[k].t());
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
  const cublasHandle_t handle = gemm == StepGemm::kCublas ? at::cuda::getCurrentCUDABlasHandle() : nullptr;
#endif
  // hs_lp's rows [k][t] are the GEMMs' inputs (the state in the GEMM dtype)
  auto gemm_forward = [&](int64_t k, int64_t t, const T* u, T* c, int64_t n) {
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
    if (gemm == StepGemm::kCublas) {
      cublas_gemm<T>(handle, cptr<T, S>(hs_lp, (k * T_ + t) * BH), u, c, static_cast<int>(B), static_cast<int>(n),
                     static_cast<int>(H), /*w_transposed=*/true);
      return;
    }
#endif
    if (gemm == StepGemm::kRows || gemm == StepGemm::kTiled) {
      const cuda::GemmArgs<T> g{cptr<T, S>(hs_lp, (k * T_ + t) * BH), u, c, static_cast<int>(B),
                                static_cast<int>(n), static_cast<int>(H)};
      C10_CUDA_CHECK((gemm == StepGemm::kRows ? cuda::launch_rows_gemm<T, A>(g, stream)
                                              : cuda::launch_tiled_gemm<true, T, A>(g, stream)));
    } else {
      Tensor out_rows = k == 0 ? hp[t] : hpt[k - 1][t];
      at::mm_out(out_rows, hs_lp[k][t], k == 0 ? w_hh_t : t_w_t[k - 1]);
    }
  };

  for (int64_t step = 0; step < T_; ++step) {
    const int64_t t = order[step];
    for (int64_t k = 0; k <= D; ++k) {
      cuda::StepForwardArgs<T, A> a{};
      int kind;
      if (k == 0) {
        gemm_forward(0, t, cptr<T, S>(w_hh), mptr<T, S>(hp, t * B * d.n_h * H), d.n_h * H);
        kind = static_cast<int>(w.kind);
        a.xp = cptr<T, S>(xp, t * B * d.n_in * H);
        a.hp = cptr<T, S>(hp, t * B * d.n_h * H);
        a.bh = cptr<T, S>(w.b_hh);
        a.lnw = ln ? cptr<T, S>(w.ln_w) : nullptr;
        a.lnb = ln ? cptr<T, S>(w.ln_b) : nullptr;
      } else {
        gemm_forward(k, t, cptr<T, S>(t_w, (k - 1) * 3 * H * H), mptr<T, S>(hpt, ((k - 1) * T_ + t) * B * 3 * H),
                     3 * H);
        kind = kTGRU;
        a.xp = nullptr;
        a.hp = cptr<T, S>(hpt, ((k - 1) * T_ + t) * B * 3 * H);
        a.bh = cptr<T, S>(w.t_b, (k - 1) * 3 * H);
        a.lnw = tln ? cptr<T, S>(w.t_ln_w, (k - 1) * 2 * H) : nullptr;
        a.lnb = tln ? cptr<T, S>(w.t_ln_b, (k - 1) * 2 * H) : nullptr;
      }
      a.hin = cptr<A, A>(hs, (k * T_ + t) * BH);
      a.drop = kind != kATR ? cptr<T, S>(drop, k * BH) : nullptr;
      const bool last = k == D;
      if (!last) {
        a.hout = mptr<A, A>(hs, ((k + 1) * T_ + t) * BH);
        a.hlp = lp ? mptr<T, S>(hs_lp, ((k + 1) * T_ + t) * BH) : nullptr;
        a.out = nullptr;
      } else {
        a.mask = cptr<T, S>(mask, t * B);
        a.hblk = cptr<A, A>(hs, t * BH);
        a.out = mptr<T, S>(out, t * BH);
        if (step + 1 < T_) {
          a.hout = mptr<A, A>(hs, order[step + 1] * BH);
          a.hlp = lp ? mptr<T, S>(hs_lp, order[step + 1] * BH) : nullptr;
        } else {
          a.hout = mptr<A, A>(h_last);
          a.hlp = nullptr;
        }
      }
      a.H = static_cast<int>(H);
      a.eps = static_cast<A>(eps);
      const cudaError_t err = cuda::launch_step_forward<T, A>(kind, a, static_cast<int>(B), stream);
      C10_CUDA_CHECK(err);
    }
  }
  return {out, h_last.to(h0.scalar_type()), xp, hs, lp ? hs_lp : at::empty({0}, opts), hp, hpt};
}

// Whether the persistent launches' products run on tensor cores (docs/design/persistent_recurrence.md, "Products on
// tensor cores"): cuda::persistent_tensor_cores's rule, with torch's TF32 flag read at each call as cuBLAS reads it
// (torch.backends.cuda.matmul.allow_tf32, or float32 matmul precision "high") and this device's compute capability
// (the emulation counts as 8.0); never for a type without an MMA (double).
template <typename T> bool persistent_mma() {
  if constexpr (!cuda::Mma<T>::available) {
    return false;
  } else {
#if defined(DTMT_CUDA_EMULATION)
    const int major = 8;
#else
    int device = 0, major = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
#endif
    return cuda::persistent_tensor_cores(sizeof(T), at::globalContext().allowTF32CuBLAS(), major);
  }
}

// What both persistent launches' argument structs share: the weights' pointers (w_hh and t_w contiguous copies the
// caller keeps alive through the launch), dropout and mask; and the sizes and settings.
template <typename T, typename S, typename Args>
void set_persistent_weights(Args& a, const TransitionWeights& w, const Tensor& w_hh, const Tensor& t_w,
                            const Tensor& drop, const Tensor& mask) {
  const bool ln = present(w.ln_w), tln = present(w.t_ln_w), deep = present(t_w);
  a.w_hh = cptr<T, S>(w_hh);
  a.b_hh = cptr<T, S>(w.b_hh);
  a.ln_w = ln ? cptr<T, S>(w.ln_w) : nullptr;
  a.ln_b = ln ? cptr<T, S>(w.ln_b) : nullptr;
  a.t_w = deep ? cptr<T, S>(t_w) : nullptr;
  a.t_b = deep ? cptr<T, S>(w.t_b) : nullptr;
  a.t_ln_w = tln ? cptr<T, S>(w.t_ln_w) : nullptr;
  a.t_ln_b = tln ? cptr<T, S>(w.t_ln_b) : nullptr;
  a.drop = static_cast<int>(w.kind) != kATR ? cptr<T, S>(drop) : nullptr;
  a.mask = cptr<T, S>(mask);
}
template <typename Args> void set_persistent_sizes(Args& a, const Dims& d, int64_t slice, bool reverse, double eps) {
  a.steps = static_cast<int>(d.T);
  a.B = static_cast<int>(d.B);
  a.H = static_cast<int>(d.H);
  a.D = static_cast<int>(d.D);
  a.slice = static_cast<int>(slice);
  a.reverse = reverse;
  a.eps = static_cast<decltype(a.eps)>(eps);
}

// The forward as one persistent cooperative launch of `grid` blocks (persistent_cuda_kernels.cuh): the same
// outputs and saved tensors as forward_impl, so backward_impl runs on them unchanged. `fallible`: a launch the device
// refuses (too much shared memory, blocks that cannot all be resident) returns {} instead of throwing.
template <typename S>
std::vector<Tensor> forward_persistent_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                            const TransitionWeights& w, bool reverse, double eps, int64_t grid,
                                            int64_t threads, bool fallible = false) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, S_ = D + 1;
  TORCH_CHECK(grid >= 1 && grid <= H, "dtmt: the persistent forward needs 1 <= grid <= H, got grid ", grid, ", H ", H);
  const int64_t slice = (H + grid - 1) / grid;
  grid = (H + slice - 1) / slice;   // every block owns at least one unit
  const auto opts = x.options();
  const auto acc_opts = opts.dtype(acc_type(x.scalar_type()));
  const bool lp = acc_type(x.scalar_type()) != x.scalar_type();

  Tensor xp = at::addmm(w.b_ih, x.reshape({T_ * B, d.I}), w.w_ih.t()).view({T_, B, d.n_in * H});
  Tensor hs = at::empty({S_, T_, B, H}, acc_opts);
  Tensor hs_lp = lp ? at::empty({S_, T_, B, H}, opts) : hs;
  Tensor hp = at::empty({T_, B, d.n_h * H}, opts);
  Tensor hpt = at::empty({D, T_, B, 3 * H}, opts);
  Tensor out = at::empty({T_, B, H}, opts);
  Tensor h_last = at::empty({B, H}, acc_opts);
  Tensor partials = at::empty({grid, B, 3, 2}, acc_opts);
  const int64_t first = reverse ? T_ - 1 : 0;
  hs[0][first].copy_(h0);
  if (lp) hs_lp[0][first].copy_(h0);
  const Tensor w_hh = w.w_hh.contiguous(), t_w = D > 0 ? w.t_w.contiguous() : w.t_w;

  cuda::PersistentForwardArgs<T, A> a{};
  a.xp = cptr<T, S>(xp);
  set_persistent_weights<T, S>(a, w, w_hh, t_w, drop, mask);
  a.hs = mptr<A, A>(hs);
  a.hs_lp = lp ? mptr<T, S>(hs_lp) : nullptr;
  a.hp = mptr<T, S>(hp);
  a.hpt = D > 0 ? mptr<T, S>(hpt) : nullptr;
  a.out = mptr<T, S>(out);
  a.h_last = mptr<A, A>(h_last);
  a.partials = mptr<A, A>(partials);
  set_persistent_sizes(a, d, slice, reverse, eps);
  a.mma = persistent_mma<T>();
  if (T_ > 0) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const cudaError_t err = cuda::launch_persistent_forward<T, A>(static_cast<int>(w.kind), a, static_cast<int>(grid),
                                                                  static_cast<int>(threads), stream);
    if (err != cudaSuccess && fallible) {   // did not fit the device (shared memory, co-residency): not launched
#if !defined(DTMT_CUDA_EMULATION)
      (void)cudaGetLastError();   // (the launch's error, cleared: nothing ran)
      TORCH_WARN_ONCE("dtmt: the persistent forward does not fit this device at H=", H, ", depth ", D, ", B=", B,
                      " (", cudaGetErrorString(err), "): the per-step forward runs instead");
#endif
      return {};
    }
    C10_CUDA_CHECK(err);
  }
  return {out, h_last.to(h0.scalar_type()), xp, hs, lp ? hs_lp : at::empty({0}, opts), hp, hpt};
}

// DTMT_CUDA_RECURRENCE=persistent (read once a process; a benchmarks' setting until a GPU session has measured it,
// issue 72): forward and backward as the persistent launches, one block per SM (at most one per hidden unit), where
// the layer fits the device (persistent_plan); where it does not, the per-step path, with a warning once. Unset or
// "steps": the per-step path.
bool persistent_requested() {
  static const bool requested = [] {
    const char* env = std::getenv("DTMT_CUDA_RECURRENCE");
    const std::string v = env != nullptr ? env : "";
    if (v == "persistent") return true;
    if (!v.empty() && v != "steps")
      TORCH_WARN("dtmt: DTMT_CUDA_RECURRENCE=", v, " ignored: not one of steps, persistent");
    return false;
  }();
  return requested;
}

// The device's SM count and the shared memory a block may opt into (the emulation: 4 SMs of an H100's 227 KB).
std::pair<int, size_t> device_limits() {
#if defined(DTMT_CUDA_EMULATION)
  return {4, 232448};
#else
  int device = 0, count = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return {count, static_cast<size_t>(optin)};
#endif
}

// The persistent plan of a layer on this device (persistent_plan), or grid 0 with a warning once naming what does
// not fit: the per-step path runs then.
template <typename S> int64_t persistent_grid(const Tensor& x, const TransitionWeights& w) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const auto limits = device_limits();
  const cuda::PersistentPlan plan =
      cuda::persistent_plan(static_cast<int>(w.kind), static_cast<int>(d.D), static_cast<int>(d.B),
                            static_cast<int>(d.H), sizeof(T), sizeof(A), limits.first, limits.second,
                            persistent_mma<T>(), cuda::kPersistentThreads);
  if (!plan.fits)
    TORCH_WARN_ONCE("dtmt: a layer of H=", d.H, ", depth ", d.D, ", B=", d.B, " needs ", plan.forward_bytes / 1024,
                    " KB (forward) and ", plan.backward_bytes / 1024, " KB (backward) of shared memory a block in ",
                    plan.grid, " blocks; this device allows ", limits.second / 1024,
                    " KB: the per-step path runs (DTMT_CUDA_RECURRENCE=persistent)");
  return plan.fits ? plan.grid : 0;
}

// What both backwards do after their loop: dx, the weight gradients as GEMMs over all steps, the layer-norm
// gradients as column sums of the row accumulators (deterministic). Without `weight_grads` (the caller forms the
// weight and bias gradients itself, over many calls at once: dtmt_kernels.nn.unrolled), the pre-activation
// gradients in the slots of dw_ih, dw_hh and dt_w and nothing in the bias slots, as the CPU backward returns them.
std::vector<Tensor> backward_tail(const Tensor& x, const TransitionWeights& w, const Dims& d, const Tensor& hs_lp,
                                  const Tensor& dxp, const Tensor& dhp, const Tensor& dhpt, const Tensor& dh0,
                                  const Tensor& dln_rows, const Tensor& dlnb_rows, const Tensor& dtln_rows,
                                  const Tensor& dtlnb_rows, bool weight_grads) {
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, N = T_ * B;
  const bool ln = present(w.ln_w), tln = present(w.t_ln_w);
  Tensor dxp2 = dxp.view({N, d.n_in * H});
  Tensor dx = dxp2.mm(w.w_ih).view({T_, B, d.I});
  Tensor dln_w = ln ? dln_rows.sum(0).to(x.scalar_type()) : Tensor();
  Tensor dln_b = ln ? dlnb_rows.sum(0).to(x.scalar_type()) : Tensor();
  Tensor dt_ln_w = tln ? dtln_rows.sum(1).to(x.scalar_type()) : Tensor();
  Tensor dt_ln_b = tln ? dtlnb_rows.sum(1).to(x.scalar_type()) : Tensor();
  if (!weight_grads)
    return {dx, dh0, dxp2, Tensor(), dhp.view({N, d.n_h * H}), Tensor(), dln_w, dln_b, dhpt.view({D, N, 3 * H}),
            Tensor(), dt_ln_w, dt_ln_b};
  const auto g = transition_weight_grads(x.reshape({N, d.I}), hs_lp.view({D + 1, N, H}), dxp2,
                                         dhp.view({N, d.n_h * H}), dhpt.view({D, N, 3 * H}), acc_type(x.scalar_type()));
  return {dx, dh0, g[0], g[1], g[2], g[3], dln_w, dln_b, g[4], g[5], dt_ln_w, dt_ln_b};
}

template <typename S>
std::vector<Tensor> backward_impl(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                  const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                  const Tensor& xp, const Tensor& hs, const Tensor& hs_lp_saved, const Tensor& hp,
                                  const Tensor& hpt, bool reverse, double eps, bool weight_grads) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, BH = B * H;
  check_shared_memory<A>(d, 2, "backward");
  const auto opts = x.options();
  const at::ScalarType acc = acc_type(x.scalar_type());
  const auto acc_opts = opts.dtype(acc);
  const Tensor hs_lp = present(hs_lp_saved) ? hs_lp_saved : hs;
  const bool ln = present(w.ln_w), tln = present(w.t_ln_w);

  Tensor dxp = at::empty_like(xp);
  Tensor dhp = at::empty_like(hp);
  Tensor dhpt = at::empty_like(hpt);
  Tensor dln_rows = at::zeros({ln ? B : 0, d.n_g * H}, acc_opts);
  Tensor dlnb_rows = at::zeros({ln ? B : 0, d.n_g * H}, acc_opts);
  Tensor dtln_rows = at::zeros({tln ? D : 0, B, 2 * H}, acc_opts);
  Tensor dtlnb_rows = at::zeros({tln ? D : 0, B, 2 * H}, acc_opts);
  Tensor carry[2] = {grad_hn.to(acc, /*non_blocking=*/false, /*copy=*/true).contiguous(),
                     at::empty({B, H}, acc_opts)};
  Tensor carry_g = at::empty({B, H}, opts);
  Tensor inner[2] = {at::empty({B, H}, acc_opts), at::empty({B, H}, acc_opts)};
  Tensor inner_g = at::empty({B, H}, opts);
  int c = 0;
  bool has_cg = false;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto order = step_order(T_, reverse);
  const StepGemm gemm = step_gemm(B);
  const bool rows = gemm == StepGemm::kRows;
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
  const cublasHandle_t handle = gemm == StepGemm::kCublas ? at::cuda::getCurrentCUDABlasHandle() : nullptr;
#endif
  const Tensor w_hh = w.w_hh.contiguous(), t_w = D > 0 ? w.t_w.contiguous() : w.t_w;
  // the row GEMM multiplies by w^T with w [N, K] row-major: here U^T [H, n], made once for the loop
  const Tensor w_hh_rows = rows ? w_hh.t().contiguous() : w_hh;
  const Tensor t_w_rows = rows && D > 0 ? t_w.transpose(1, 2).contiguous() : t_w;
  // out[B, H] = d(pre-activations)[B, n] . U[n, H]; the pre-activation gradients and U are rows of `dpre`
  // and `u` from the element offsets given (`u_rows`: the same matrix as U^T, same offset)
  auto gemm_backward = [&](Tensor& out, const Tensor& dpre, int64_t dpre_off, const Tensor& u, const Tensor& u_rows,
                           int64_t u_off, int64_t n) {
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
    if (gemm == StepGemm::kCublas) {
      cublas_gemm<T>(handle, cptr<T, S>(dpre, dpre_off), cptr<T, S>(u, u_off), mptr<T, S>(out), static_cast<int>(B),
                     static_cast<int>(H), static_cast<int>(n), /*w_transposed=*/false);
      return;
    }
#endif
    if (gemm == StepGemm::kRows || gemm == StepGemm::kTiled) {
      const cuda::GemmArgs<T> g{cptr<T, S>(dpre, dpre_off), cptr<T, S>(rows ? u_rows : u, u_off), mptr<T, S>(out),
                                static_cast<int>(B), static_cast<int>(H), static_cast<int>(n)};
      C10_CUDA_CHECK(
          (rows ? cuda::launch_rows_gemm<T, A>(g, stream) : cuda::launch_tiled_gemm<false, T, A>(g, stream)));
    } else {
      at::mm_out(out, dpre.view({-1}).narrow(0, dpre_off, B * n).view({B, n}),
                 u.view({-1}).narrow(0, u_off, n * H).view({n, H}));
    }
  };

  for (int64_t step = T_ - 1; step >= 0; --step) {
    const int64_t t = order[step];
    int i = 0;
    for (int64_t k = D; k >= 0; --k) {
      cuda::StepBackwardArgs<T, A> a{};
      const bool base = k == 0;
      int kind;
      if (base) {
        kind = static_cast<int>(w.kind);
        a.xp = cptr<T, S>(xp, t * B * d.n_in * H);
        a.hp = cptr<T, S>(hp, t * B * d.n_h * H);
        a.bh = cptr<T, S>(w.b_hh);
        a.lnw = ln ? cptr<T, S>(w.ln_w) : nullptr;
        a.lnb = ln ? cptr<T, S>(w.ln_b) : nullptr;
        a.dxp = mptr<T, S>(dxp, t * B * d.n_in * H);
        a.dhp = mptr<T, S>(dhp, t * B * d.n_h * H);
        a.dlnw = ln ? mptr<A, A>(dln_rows) : nullptr;
        a.dlnb = ln ? mptr<A, A>(dlnb_rows) : nullptr;
        a.dh = mptr<A, A>(carry[1 - c]);
      } else {
        kind = kTGRU;
        const int64_t off = ((k - 1) * T_ + t) * B * 3 * H;
        a.xp = nullptr;
        a.hp = cptr<T, S>(hpt, off);
        a.bh = cptr<T, S>(w.t_b, (k - 1) * 3 * H);
        a.lnw = tln ? cptr<T, S>(w.t_ln_w, (k - 1) * 2 * H) : nullptr;
        a.lnb = tln ? cptr<T, S>(w.t_ln_b, (k - 1) * 2 * H) : nullptr;
        a.dxp = nullptr;
        a.dhp = mptr<T, S>(dhpt, off);
        a.dlnw = tln ? mptr<A, A>(dtln_rows, (k - 1) * BH * 2) : nullptr;
        a.dlnb = tln ? mptr<A, A>(dtlnb_rows, (k - 1) * BH * 2) : nullptr;
        a.dh = mptr<A, A>(inner[1 - i]);
      }
      a.hin = cptr<A, A>(hs, (k * T_ + t) * BH);
      a.drop = kind != kATR ? cptr<T, S>(drop, k * BH) : nullptr;
      a.din = cptr<A, A>(inner[i]);
      a.gin = cptr<T, S>(inner_g);
      a.cd = cptr<A, A>(carry[c]);
      a.cg = has_cg ? cptr<T, S>(carry_g) : nullptr;
      a.go = cptr<T, S>(grad_out, t * BH);
      a.mask = cptr<T, S>(mask, t * B);
      a.H = static_cast<int>(H);
      a.eps = static_cast<A>(eps);
      a.top = k == D;
      a.base = base;
      const cudaError_t err = cuda::launch_step_backward<T, A>(kind, a, static_cast<int>(B), stream);
      C10_CUDA_CHECK(err);
      if (base) {
        gemm_backward(carry_g, dhp, t * B * d.n_h * H, w_hh, w_hh_rows, 0, d.n_h * H);
        c = 1 - c;
        has_cg = true;
      } else {
        gemm_backward(inner_g, dhpt, ((k - 1) * T_ + t) * B * 3 * H, t_w, t_w_rows, (k - 1) * 3 * H * H,
                      3 * H);
        i = 1 - i;
      }
    }
  }
  Tensor dh0 = (carry[c] + carry_g.to(acc)).to(grad_hn.scalar_type());
  return backward_tail(x, w, d, hs_lp, dxp, dhp, dhpt, dh0, dln_rows, dlnb_rows, dtln_rows, dtlnb_rows,
                       weight_grads);
}

// The backward in one persistent cooperative launch of `grid` blocks (persistent_cuda_kernels.cuh) on the forward's
// saved tensors (either forward's), then the same weight gradients; `fallible` as forward_persistent_impl's.
template <typename S>
std::vector<Tensor> backward_persistent_impl(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                             const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                             const Tensor& xp, const Tensor& hs, const Tensor& hs_lp_saved,
                                             const Tensor& hp, const Tensor& hpt, bool reverse, double eps,
                                             int64_t grid, int64_t threads, bool fallible = false,
                                             bool weight_grads = true) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const int64_t B = d.B, H = d.H, D = d.D;
  TORCH_CHECK(grid >= 1 && grid <= H, "dtmt: the persistent backward needs 1 <= grid <= H, got grid ", grid, ", H ",
              H);
  const int64_t slice = (H + grid - 1) / grid;
  grid = (H + slice - 1) / slice;
  const auto opts = x.options();
  const at::ScalarType acc = acc_type(x.scalar_type());
  const auto acc_opts = opts.dtype(acc);
  const Tensor hs_lp = present(hs_lp_saved) ? hs_lp_saved : hs;
  const bool ln = present(w.ln_w), tln = present(w.t_ln_w);
  Tensor dxp = at::empty_like(xp);
  Tensor dhp = at::empty_like(hp);
  Tensor dhpt = at::empty_like(hpt);
  Tensor dln_rows = at::zeros({ln ? B : 0, d.n_g * H}, acc_opts);
  Tensor dlnb_rows = at::zeros({ln ? B : 0, d.n_g * H}, acc_opts);
  Tensor dtln_rows = at::zeros({tln ? D : 0, B, 2 * H}, acc_opts);
  Tensor dtlnb_rows = at::zeros({tln ? D : 0, B, 2 * H}, acc_opts);
  Tensor dh0 = at::empty({B, H}, acc_opts);
  Tensor partials = at::empty({2, grid, B, 3, 2}, acc_opts);
  const Tensor ghn = grad_hn.to(acc).contiguous(), gout = grad_out.contiguous();
  const Tensor w_hh = w.w_hh.contiguous(), t_w = D > 0 ? w.t_w.contiguous() : w.t_w;

  cuda::PersistentBackwardArgs<T, A> a{};
  a.xp = cptr<T, S>(xp);
  a.hp = cptr<T, S>(hp);
  a.hpt = D > 0 ? cptr<T, S>(hpt) : nullptr;
  a.hs = cptr<A, A>(hs);
  set_persistent_weights<T, S>(a, w, w_hh, t_w, drop, mask);
  a.grad_out = cptr<T, S>(gout);
  a.grad_hn = cptr<A, A>(ghn);
  a.dh0 = mptr<A, A>(dh0);
  a.dxp = mptr<T, S>(dxp);
  a.dhp = mptr<T, S>(dhp);
  a.dhpt = D > 0 ? mptr<T, S>(dhpt) : nullptr;
  a.dln_rows = ln ? mptr<A, A>(dln_rows) : nullptr;
  a.dlnb_rows = ln ? mptr<A, A>(dlnb_rows) : nullptr;
  a.dtln_rows = tln ? mptr<A, A>(dtln_rows) : nullptr;
  a.dtlnb_rows = tln ? mptr<A, A>(dtlnb_rows) : nullptr;
  a.partials = mptr<A, A>(partials);
  set_persistent_sizes(a, d, slice, reverse, eps);
  a.mma = persistent_mma<T>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda::launch_persistent_backward<T, A>(static_cast<int>(w.kind), a, static_cast<int>(grid),
                                                                 static_cast<int>(threads), stream);
  if (err != cudaSuccess && fallible) {
#if !defined(DTMT_CUDA_EMULATION)
    (void)cudaGetLastError();
    TORCH_WARN_ONCE("dtmt: the persistent backward does not fit this device at H=", H, ", depth ", D, ", B=", B,
                    " (", cudaGetErrorString(err), "): the per-step backward runs instead");
#endif
    return {};
  }
  C10_CUDA_CHECK(err);
  return backward_tail(x, w, d, hs_lp, dxp, dhp, dhpt, dh0.to(grad_hn.scalar_type()), dln_rows, dlnb_rows,
                       dtln_rows, dtlnb_rows, weight_grads);
}

}  // namespace

// Returns {out, h_n, xp, hs, hs_lp (empty for float / double), hp, hpt}.
std::vector<Tensor> transition_forward_cuda(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                            const TransitionWeights& w, bool reverse, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "dtmt_transition_forward_cuda", [&] {
    const int64_t grid = persistent_requested() && x.size(0) > 0 ? persistent_grid<scalar_t>(x, w) : 0;
    if (grid > 0)
      result = forward_persistent_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps, grid, cuda::kPersistentThreads,
                                                 /*fallible=*/true);
    if (result.empty()) result = forward_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps);
  });
  return result;
}

// The same, as one persistent launch of `grid` blocks of `threads` threads (forward_persistent_impl).
std::vector<Tensor> transition_forward_persistent_cuda(const Tensor& x, const Tensor& h0, const Tensor& mask,
                                                       const Tensor& drop, const TransitionWeights& w, bool reverse,
                                                       double eps, int64_t grid, int64_t threads) {
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "dtmt_transition_forward_persistent_cuda", [&] {
    result = forward_persistent_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps, grid, threads);
  });
  return result;
}

// The backward as one persistent launch of `grid` blocks of `threads` threads (backward_persistent_impl).
std::vector<Tensor> transition_backward_persistent_cuda(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                                        const Tensor& mask, const Tensor& drop,
                                                        const TransitionWeights& w, const Tensor& xp, const Tensor& hs,
                                                        const Tensor& hs_lp, const Tensor& hp, const Tensor& hpt,
                                                        bool reverse, double eps, int64_t grid, int64_t threads) {
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "dtmt_transition_backward_persistent_cuda", [&] {
    result = backward_persistent_impl<scalar_t>(grad_out, grad_hn, x, mask, drop, w, xp, hs, hs_lp, hp, hpt, reverse,
                                                eps, grid, threads);
  });
  return result;
}

// Returns {dx, dh0, dw_ih, db_ih, dw_hh, db_hh, dln_w, dln_b, dt_w, dt_b, dt_ln_w, dt_ln_b}.
std::vector<Tensor> transition_backward_cuda(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                             const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                             const Tensor& xp, const Tensor& hs, const Tensor& hs_lp,
                                             const Tensor& hp, const Tensor& hpt, bool reverse, double eps,
                                             bool weight_grads) {
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "dtmt_transition_backward_cuda", [&] {
    const int64_t grid = persistent_requested() && x.size(0) > 0 ? persistent_grid<scalar_t>(x, w) : 0;
    if (grid > 0)
      result = backward_persistent_impl<scalar_t>(grad_out, grad_hn, x, mask, drop, w, xp, hs, hs_lp, hp, hpt,
                                                  reverse, eps, grid, cuda::kPersistentThreads, /*fallible=*/true,
                                                  weight_grads);
    if (result.empty())
      result = backward_impl<scalar_t>(grad_out, grad_hn, x, mask, drop, w, xp, hs, hs_lp, hp, hpt, reverse, eps,
                                       weight_grads);
  });
  return result;
}

}  // namespace dtmt
