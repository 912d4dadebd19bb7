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
// kRowGemmRows rows, the tiled GEMM up to kSmallGemmRows) and ATen's mm (cuBLAS) above, and ATen's mm at every B
// while a CUDA graph is captured. The choice is made once per call, from B.
// Storage in the input dtype (float, double, half, bfloat16), h0 / h_n also in float for 16-bit inputs (h_n in
// h0's dtype, dh0 in grad_hn's); states, carried gradients and all kernel arithmetic in float (double for double
// inputs). Nothing synchronises with the host inside the loops.
#include <ATen/ATen.h>
#if !defined(DTMT_CUDA_EMULATION)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
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
#include <atomic>
#include <climits>
#include <initializer_list>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "persistent_cuda_kernels.cuh"
#include "transition.h"
#include "transition_cuda_kernels.cuh"

#if defined(DTMT_CUDA_EMULATION)  // tests only: host tensors, kernels on host fibers (see the .cuh)
#include "cuda_emulation_aten.h"
#endif
#define DTMT_DISPATCH_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

#if !defined(DTMT_CUDA_EMULATION)   // (the emulated extension is one unit: it instantiates them here)
namespace dtmt {
namespace cuda {
// the persistent launchers, compiled in units of their own (csrc/persistent_<type>.cu)
DTMT_PERSISTENT_LAUNCHERS(extern, float, float)
DTMT_PERSISTENT_LAUNCHERS(extern, double, double)
DTMT_PERSISTENT_LAUNCHERS(extern, __half, float)
DTMT_PERSISTENT_LAUNCHERS(extern, __nv_bfloat16, float)
}  // namespace cuda
}  // namespace dtmt
#endif

namespace dtmt {
namespace {

using at::Tensor;

// The messages of this file that hold numbers or run-time strings are made into one string here (numbers by
// std::to_string) before TORCH_CHECK or TORCH_WARN sees them, so that c10::str streams nothing. On the H200 image of
// 2026-11-30 a number streamed into c10::str's ostringstream from this nvcc-compiled unit crashed the process inside
// libstdc++ (ostream's integer insertion reached a locale facet of another type: device_plan's warning at H = 2500);
// the cause (the two host compilers of that image, or its libstdc++) is unconfirmed, and gpu_session.sh's build
// stage prints what it needs to tell (docs/design/gpu.md, "Messages from the CUDA unit").
inline void append_text(std::string& s, const char* v) { s += v; }
template <typename N, std::enable_if_t<std::is_integral<N>::value && !std::is_same<N, bool>::value, int> = 0>
void append_text(std::string& s, N v) { s += std::to_string(v); }   // (integers only: printed as a stream would)
template <typename... Args> std::string message(const Args&... args) {
  std::string s;
  (append_text(s, args), ...);
  return s;
}

template <typename S> struct DeviceType { using type = S; };
template <> struct DeviceType<at::BFloat16> { using type = __nv_bfloat16; };
template <> struct DeviceType<at::Half> { using type = __half; };

bool present(const Tensor& t) { return t.defined() && t.numel() > 0; }

// Batch rows up to which the time loops' GEMMs are kernels of the .cuh (a step: two kernel launches, no ATen
// dispatch): the row GEMM up to kRowGemmRows, the tiled GEMM up to kSmallGemmRows, cuBLAS above; cuBLAS at every B
// while the stream is captured into a CUDA graph (a replay pays no host time a launch, which is what the own
// kernels save; on the device cuBLAS is the faster). Thresholds and the rule under capture: docs/design/gpu.md,
// "Step GEMMs" (measured on an H100 and an H200; the rule itself not yet run on a GPU).
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
    TORCH_WARN(message("dtmt: DTMT_CUDA_STEP_GEMM=", v.c_str(),
                       " ignored: not one of auto, rows, tiled, cublas, cublas-direct"));
    return -1;
  }();
  return forced;
}
// Whether the current stream is being captured into a CUDA graph (never in the emulation).
bool stream_capturing() {
#if defined(DTMT_CUDA_EMULATION)
  return false;
#else
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#endif
}
StepGemm step_gemm(int64_t B) {
  const int forced = forced_step_gemm();
  if (forced >= 0) return static_cast<StepGemm>(forced);
  if (stream_capturing()) return StepGemm::kAten;
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
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, message("dtmt: cublasGemmEx failed (status ",
                                                       static_cast<int>(status), ") in the cuda backend's step GEMM"));
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

// The kernels count steps and index a step's values with int (offsets of whole steps are 64-bit): a layer with more
// than INT_MAX steps, or a step with more than INT_MAX values in its widest tensor (B rows of the pre-activations,
// n x H values each, or of x), is refused here rather than wrapped. Every driver entry checks it first.
void check_step_sizes(const Dims& d, const char* op) {
  const int64_t widest = std::max<int64_t>({d.n_in, d.n_h, 3}) * d.H;
  TORCH_CHECK(d.T <= INT_MAX && d.B * widest <= INT_MAX && d.B * d.I <= INT_MAX,
              message("dtmt::", op, " on CUDA: T (", d.T, ") and a step's values (B x ", widest, " = ", d.B * widest,
                      ", B x I = ", d.B * d.I, ") must be at most 2^31 - 1"));
}

// Every given tensor of a call on x's device: the dispatcher runs these kernels where any argument is a CUDA tensor,
// and a kernel handed a host tensor's pointer (a mask, bias or grad_hn left on the CPU) reads or writes host memory
// from the device. A one-line error naming the argument instead, before the device guard.
void check_devices(const Tensor& x, std::initializer_list<std::pair<const Tensor*, const char*>> ts, const char* op) {
  for (const auto& [t, name] : ts)
    TORCH_CHECK(!present(*t) || t->device() == x.device(),
                message("dtmt::", op, " on CUDA: ", name, " is on ", t->device().str().c_str(), " but x is on ",
                        x.device().str().c_str()));
}
void check_devices(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                   const TransitionWeights& w, const char* op, const char* h_name = "h0") {
  check_devices(x, {{&h0, h_name}, {&mask, "mask"}, {&drop, "drop"}, {&w.w_ih, "w_ih"}, {&w.b_ih, "b_ih"},
                    {&w.w_hh, "w_hh"}, {&w.b_hh, "b_hh"}, {&w.ln_w, "ln_w"}, {&w.ln_b, "ln_b"}, {&w.t_w, "t_w"},
                    {&w.t_b, "t_b"}, {&w.t_ln_w, "t_ln_w"}, {&w.t_ln_b, "t_ln_b"}}, op);
}
void check_devices(const BackwardInputs& in, const TransitionWeights& w, const SavedForward& saved) {
  constexpr const char* op = "transition_backward";
  check_devices(in.x, in.grad_hn, in.mask, in.drop, w, op, "grad_hn");
  check_devices(in.x, {{&in.grad_out, "grad_out"}, {&saved.xp, "xp"}, {&saved.hs, "hs"}, {&saved.hs_lp, "hs_lp"},
                       {&saved.hp, "hp"}, {&saved.hpt, "hpt"}}, op);
}

// The weight gradients multiply by the states in x's dtype: 16-bit inputs need the forward's 16-bit copy of them.
// (The op's checks take hs_lp as optional; without it the float states met 16-bit gradients in an ATen product
// whose error named nothing. The CPU op refuses it so.)
void check_saved_low_precision(const BackwardInputs& in, const SavedForward& saved) {
  TORCH_CHECK(present(saved.hs_lp) || (in.x.scalar_type() != at::kHalf && in.x.scalar_type() != at::kBFloat16),
              "dtmt::transition_backward on CUDA: 16-bit inputs need the forward's hs_lp");
}

// The per-call tensors in the dtype the kernels read them in, x's. A mask or dropout multipliers of another dtype
// (a bool mask) and layer-norm parameters of another float dtype are converted, as the CPU op converts them (to its
// accumulation dtype); the matrices and biases, which the GEMMs read as they are, must have x's dtype (int8 rows are
// the CPU's inference form). Before, ATen's "expected scalar type" named no argument.
Tensor in_x_dtype(const Tensor& t, const Tensor& x) {
  return !present(t) || t.scalar_type() == x.scalar_type() ? t : t.to(x.scalar_type());
}
TransitionWeights in_x_dtype(const TransitionWeights& w, const Tensor& x, const char* op) {
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&w.w_ih, "w_ih"}, {&w.b_ih, "b_ih"},
                                {&w.w_hh, "w_hh"}, {&w.b_hh, "b_hh"}, {&w.t_w, "t_w"}, {&w.t_b, "t_b"}})
    TORCH_CHECK(!present(*t) || t->scalar_type() == x.scalar_type(),
                message("dtmt::", op, " on CUDA: ", name, " must have x's dtype (", c10::toString(x.scalar_type()),
                        "), got ", c10::toString(t->scalar_type())));
  TransitionWeights c = w;
  c.ln_w = in_x_dtype(w.ln_w, x), c.ln_b = in_x_dtype(w.ln_b, x);
  c.t_ln_w = in_x_dtype(w.t_ln_w, x), c.t_ln_b = in_x_dtype(w.t_ln_b, x);
  return c;
}
BackwardInputs in_x_dtype(const BackwardInputs& in) {
  return {in.grad_out, in.grad_hn, in.x, in_x_dtype(in.mask, in.x), in_x_dtype(in.drop, in.x)};
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
  TORCH_CHECK(bytes <= static_cast<size_t>(limit),
              message("dtmt: the cuda backend's ", pass, " kernel needs ", bytes, " bytes of shared memory per block "
                      "at hidden size ", d.H, "; this device allows ", limit, ". Use backend='triton' for this size."));
#else
  (void)d, (void)rows_per_group, (void)pass;
#endif
}

// The per-step forward of one layer call, as an object: for each time step and sub-cell, the recurrent product
// (`product`) and one element-wise launch (`launch`), writing the tensors the backward reads. forward_impl runs it.
template <typename S>
class StepForward {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;

 public:
  StepForward(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
              bool reverse, double eps)
      : w_(w), mask_(mask), drop_(drop), d_(dims_of(x, w)), eps_(eps),
        lp_(acc_type(x.scalar_type()) != x.scalar_type()), ln_(present(w.ln_w)), tln_(present(w.t_ln_w)),
        stream_(c10::cuda::getCurrentCUDAStream()), gemm_(step_gemm(d_.B)), order_(step_order(d_.T, reverse)) {
    check_shared_memory<A>(d_, 1, "forward");
    const int64_t T_ = d_.T, B = d_.B, H = d_.H, D = d_.D;
    const auto opts = x.options();
    const auto acc_opts = opts.dtype(acc_type(x.scalar_type()));
    xp_ = at::addmm(w.b_ih, x.reshape({T_ * B, d_.I}), w.w_ih.t()).view({T_, B, d_.n_in * H});
    hs_ = at::empty({D + 1, T_, B, H}, acc_opts);
    hs_lp_ = lp_ ? at::empty({D + 1, T_, B, H}, opts) : hs_;
    hp_ = at::empty({T_, B, d_.n_h * H}, opts);
    hpt_ = at::empty({D, T_, B, 3 * H}, opts);
    out_ = at::empty({T_, B, H}, opts);
    h_last_ = at::empty({B, H}, acc_opts);
    if (T_ == 0) {   // (no step: h_n is h0)
      h_last_.copy_(h0);
    } else {
      hs_[0][order_[0]].copy_(h0);
      if (lp_) hs_lp_[0][order_[0]].copy_(h0);
    }
    w_hh_ = w.w_hh.contiguous();
    t_w_ = D > 0 ? w.t_w.contiguous() : w.t_w;
    u_t_.push_back(w_hh_.t());   // U^T of each sub-cell, for ATen's mm
    if (gemm_ == StepGemm::kAten)
      for (int64_t k = 0; k < D; ++k) u_t_.push_back(t_w_[k].t());
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
    handle_ = gemm_ == StepGemm::kCublas ? at::cuda::getCurrentCUDABlasHandle() : nullptr;
#endif
  }

  // {out, h_n, xp, hs, hs_lp (empty unless 16-bit), hp, hpt}: the op's outputs
  std::vector<Tensor> run(const Tensor& h0) {
    for (int64_t step = 0; step < d_.T; ++step) {
      for (int64_t k = 0; k <= d_.D; ++k) {
        product(k, order_[step]);
        launch(step, k);
      }
    }
    return {out_, h_last_.to(h0.scalar_type()), xp_, hs_, lp_ ? hs_lp_ : at::empty({0}, out_.options()), hp_, hpt_};
  }

 private:
  // sub-cell k's recurrent products at time t: hp[t] (k = 0) or hpt[k - 1][t] = its state (hs_lp's row [k][t], the
  // state in the GEMM dtype) . U^T
  void product(int64_t k, int64_t t) {
    const int64_t B = d_.B, H = d_.H, n = k == 0 ? d_.n_h * H : 3 * H;
    const T* state = cptr<T, S>(hs_lp_, (k * d_.T + t) * B * H);
    const T* u = k == 0 ? cptr<T, S>(w_hh_) : cptr<T, S>(t_w_, (k - 1) * 3 * H * H);
    T* c = k == 0 ? mptr<T, S>(hp_, t * B * n) : mptr<T, S>(hpt_, ((k - 1) * d_.T + t) * B * n);
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
    if (gemm_ == StepGemm::kCublas) {
      cublas_gemm<T>(handle_, state, u, c, static_cast<int>(B), static_cast<int>(n), static_cast<int>(H),
                     /*w_transposed=*/true);
      return;
    }
#endif
    if (gemm_ == StepGemm::kRows || gemm_ == StepGemm::kTiled) {
      const cuda::GemmArgs<T> g{state, u, c, static_cast<int>(B), static_cast<int>(n), static_cast<int>(H)};
      C10_CUDA_CHECK((gemm_ == StepGemm::kRows ? cuda::launch_rows_gemm<T, A>(g, stream_)
                                               : cuda::launch_tiled_gemm<true, T, A>(g, stream_)));
    } else {
      Tensor out_rows = k == 0 ? hp_[t] : hpt_[k - 1][t];
      at::mm_out(out_rows, hs_lp_[k][t], u_t_[k]);
    }
  }

  // sub-cell k's element-wise kernel at the step-th time step: its state into the next sub-cell's (or, for the
  // last, the output and the next step's first state, the last step's into h_last)
  void launch(int64_t step, int64_t k) {
    const int64_t t = order_[step], T_ = d_.T, B = d_.B, H = d_.H, BH = B * H;
    cuda::StepForwardArgs<T, A> a{};
    const int kind = k == 0 ? static_cast<int>(w_.kind) : kTGRU;
    if (k == 0) {
      a.xp = cptr<T, S>(xp_, t * B * d_.n_in * H);
      a.hp = cptr<T, S>(hp_, t * B * d_.n_h * H);
      a.bh = cptr<T, S>(w_.b_hh);
      a.lnw = ln_ ? cptr<T, S>(w_.ln_w) : nullptr;
      a.lnb = ln_ ? cptr<T, S>(w_.ln_b) : nullptr;
    } else {
      a.hp = cptr<T, S>(hpt_, ((k - 1) * T_ + t) * B * 3 * H);
      a.bh = cptr<T, S>(w_.t_b, (k - 1) * 3 * H);
      a.lnw = tln_ ? cptr<T, S>(w_.t_ln_w, (k - 1) * 2 * H) : nullptr;
      a.lnb = tln_ ? cptr<T, S>(w_.t_ln_b, (k - 1) * 2 * H) : nullptr;
    }
    a.hin = cptr<A, A>(hs_, (k * T_ + t) * BH);
    a.drop = kind != kATR ? cptr<T, S>(drop_, k * BH) : nullptr;
    if (k < d_.D) {
      a.hout = mptr<A, A>(hs_, ((k + 1) * T_ + t) * BH);
      a.hlp = lp_ ? mptr<T, S>(hs_lp_, ((k + 1) * T_ + t) * BH) : nullptr;
    } else {
      a.mask = cptr<T, S>(mask_, t * B);
      a.hblk = cptr<A, A>(hs_, t * BH);
      a.out = mptr<T, S>(out_, t * BH);
      const bool more = step + 1 < T_;
      a.hout = more ? mptr<A, A>(hs_, order_[step + 1] * BH) : mptr<A, A>(h_last_);
      a.hlp = more && lp_ ? mptr<T, S>(hs_lp_, order_[step + 1] * BH) : nullptr;
    }
    a.H = static_cast<int>(H);
    a.eps = static_cast<A>(eps_);
    C10_CUDA_CHECK((cuda::launch_step_forward<T, A>(kind, a, static_cast<int>(B), stream_)));
  }

  const TransitionWeights& w_;
  const Tensor &mask_, &drop_;
  const Dims d_;
  const double eps_;
  const bool lp_, ln_, tln_;
  const cudaStream_t stream_;
  const StepGemm gemm_;
  const std::vector<int64_t> order_;
  Tensor xp_, hs_, hs_lp_, hp_, hpt_, out_, h_last_, w_hh_, t_w_;
  std::vector<Tensor> u_t_;
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
  cublasHandle_t handle_ = nullptr;
#endif
};

template <typename S>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                 const TransitionWeights& w, bool reverse, double eps) {
  return StepForward<S>(x, h0, mask, drop, w, reverse, eps).run(h0);
}

// DTMT_CUDA_PRODUCTS (a benchmarks' setting until a GPU session has compared the two end to end, issue 72): "fma",
// the persistent launches' products on FMA in every math mode (16-bit storage widened to float, float sums, as the
// MMA's; float32 with TF32 allowed: strict fp32 products); unset or "auto", persistent_mma's rule. Read once a
// process on a GPU; at each call in the emulation, whose tests set it.
bool fma_products_requested() {
  auto read = [] {
    const char* env = std::getenv("DTMT_CUDA_PRODUCTS");
    const std::string v = env != nullptr ? env : "";
    if (!v.empty() && v != "auto" && v != "fma")
      TORCH_WARN(message("dtmt: DTMT_CUDA_PRODUCTS=", v.c_str(), " ignored: not one of auto, fma"));
    return v == "fma";
  };
#if defined(DTMT_CUDA_EMULATION)
  return read();
#else
  static const bool fma = read();
  return fma;
#endif
}

// Whether the persistent launches' products run on tensor cores (docs/design/persistent_recurrence.md, "Products on
// tensor cores"): cuda::persistent_tensor_cores's rule, with torch's TF32 flag read at each call as cuBLAS reads it
// (torch.backends.cuda.matmul.allow_tf32, or float32 matmul precision "high") and this device's compute capability
// (the emulation counts as 8.0); never for a type without an MMA (double), nor under DTMT_CUDA_PRODUCTS=fma.
template <typename T> bool persistent_mma() {
  if constexpr (!cuda::Mma<T>::available) {
    return false;
  } else {
    if (fma_products_requested()) return false;
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

// The counts of persistent_launch_counts (transition.h).
std::atomic<int64_t> launches_grid{0}, launches_cluster{0}, launches_refused{0}, launches_multicast{0},
    launches_mma{0}, launches_steps{0};

// Whether this process has not yet said `what` (why the persistent launches do not run, or not in the form asked for)
// of a layer of this cell, H, depth and dtype, with the products on tensor cores or not (`mma`: TF32 on or off makes
// another plan): said once a layer shape, not once a process (a model whose two layer shapes are both past the plan
// names both) nor once a batch size (a training run's batches vary in B: the first B is named, and
// persistent_launch_counts' `steps` counts every per-step run).
bool first_said(const std::string& what, int64_t kind, int64_t H, int64_t D, at::ScalarType dtype, bool mma) {
  static std::mutex lock;
  static std::set<std::tuple<std::string, int64_t, int64_t, int64_t, int, bool>> said;
  const std::lock_guard<std::mutex> guard(lock);
  return said.emplace(what, kind, H, D, static_cast<int>(dtype), mma).second;
}

// Whether a persistent launch's error says the device cannot place it (too much shared memory, too many blocks to
// be resident at once, a cluster it cannot schedule, a form its code was not compiled for): the caller then runs
// another form. Any other error is a fault, raised.
bool launch_refused(cudaError_t err) {
  return err == cudaErrorCooperativeLaunchTooLarge || err == cudaErrorInvalidClusterSize ||
         err == cudaErrorLaunchOutOfResources || err == cudaErrorInvalidConfiguration ||
         err == cudaErrorInvalidValue || err == cudaErrorNotSupported;
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
// The spill buffer of a persistent launch (persistent_plan.h: the matrices of sub-cells `resident`..D, every block's,
// read through L2; empty where all are resident) for `grid` blocks of `slice` units, and the launch's arguments that
// name it. The caller keeps the tensor alive through the launch.
template <typename T, typename S, typename Args>
Tensor set_persistent_spill(Args& a, bool backward, const TransitionWeights& w, const Dims& d, int64_t slice,
                            int64_t grid, int64_t resident, const at::TensorOptions& opts) {
  a.resident = cuda::resident_subcells(static_cast<int>(d.D), static_cast<int>(resident));
  Tensor spill = at::empty({grid * static_cast<int64_t>(cuda::spill_elems(backward, static_cast<int>(w.kind),
                                                                          static_cast<int>(d.D), static_cast<int>(d.H),
                                                                          static_cast<int>(slice), a.resident))},
                           opts);
  a.spill = spill.numel() ? mptr<T, S>(spill) : nullptr;
  return spill;
}
// (rows: the batch rows of one group of blocks, the cluster form's clusters each their own; the tensors' rows: d.B)
template <typename Args>
void set_persistent_sizes(Args& a, const Dims& d, int64_t slice, bool reverse, double eps, int64_t rows,
                          int64_t blocks) {
  a.steps = static_cast<int>(d.T);
  a.B = static_cast<int>(rows);
  a.ldb = static_cast<int>(d.B);
  a.blocks = static_cast<int>(blocks);
  a.H = static_cast<int>(d.H);
  a.D = static_cast<int>(d.D);
  a.slice = static_cast<int>(slice);
  a.reverse = reverse;
  a.eps = static_cast<decltype(a.eps)>(eps);
}

// The device's SM count, the shared memory a block may opt into, its L2 cache's bytes and the most blocks of one
// thread-block cluster (0 where it has no cluster launch; the emulation: its SMs, 4 unless a test sets more, of an
// H100's 227 KB, its 50 MiB of L2 and clusters of 16).
struct DeviceLimits {
  int multiprocessors;
  size_t smem_optin, l2_bytes;
  int cluster_blocks;
};
DeviceLimits device_limits() {
#if defined(DTMT_CUDA_EMULATION)
  return {::dtmt_emu::multiprocessors, ::dtmt_emu::smem_optin, 52428800, cuda::kClusterMaxBlocks};
#else
  int device = 0, count = 0, optin = 0, l2 = 0, clusters = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
  return {count, static_cast<size_t>(optin), static_cast<size_t>(l2), clusters ? cuda::kClusterMaxBlocks : 0};
#endif
}

// The FMA products' stage of a launch asked for without a plan (persistent_plan's rule in this device's shared
// memory, less the mbarriers of a stage shared by clusters of `multicast` blocks): columns of each of a block's `rows`
// batch rows, forward or backward.
template <typename T, typename A>
int default_stage(bool backward, const TransitionWeights& w, const Dims& d, int64_t slice, int64_t resident,
                  int64_t multicast, int64_t rows) {
  const size_t optin = device_limits().smem_optin, share = cuda::stage_share_bytes(static_cast<int>(multicast), 1);
  return cuda::persistent_stage_columns(backward, static_cast<int>(w.kind), static_cast<int>(d.D),
                                        static_cast<int>(rows), static_cast<int>(d.H), static_cast<int>(slice),
                                        sizeof(T), sizeof(A), static_cast<int>(resident), optin - share);
}

// A persistent launch's clusters that share the stage: 1 (none) up to kClusterMaxBlocks, dividing the grid, and
// not with the cluster form (one cluster already); and the form's words in a warning.
void check_multicast(const char* direction, int64_t multicast, bool cluster, int64_t grid) {
  TORCH_CHECK(multicast >= 1 && multicast <= cuda::kClusterMaxBlocks && (multicast == 1 || !cluster) &&
                  grid % multicast == 0,
              message("dtmt: the persistent ", direction, "'s clusters sharing the stage must be 1 to ",
                      cuda::kClusterMaxBlocks, " blocks dividing the grid, in the grid form; got ", multicast,
                      " for a grid of ", grid, cluster ? " in the cluster form" : ""));
}
std::string form_name(bool cluster, int multicast) {
  return cluster ? " in clusters"
         : multicast > 1 ? message(" in clusters of ", multicast, " sharing the stage")
                         : std::string();
}

// The warning that the device refused a persistent `direction` ("forward" or "backward") in its form (`err` its
// error), once a layer shape and form (first_said): the grid form or the per-step path runs instead.
void say_refused(const char* direction, bool cluster, int multicast, const TransitionWeights& w, const Tensor& x,
                 int64_t H, int64_t D, int64_t B, cudaError_t err, bool mma) {
  const std::string form = form_name(cluster, multicast);
  if (first_said(direction + std::string(" refused") + form, static_cast<int64_t>(w.kind), H, D, x.scalar_type(),
                 mma))
    TORCH_WARN(message("dtmt: the device refused the persistent ", direction, form.c_str(), " at H=", H, ", depth ",
                       D, ", B=", B, " (", cudaGetErrorString(err), "): ",
                       cluster || multicast > 1 ? "the grid form or " : "", "the per-step ", direction,
                       " runs instead"));
}

// The cluster form's clusters of batch rows (docs/design/persistent_recurrence.md, "Clusters of batch rows"): `groups`
// clusters (1 up to B; 1 outside the cluster form) of ceil(B / groups) rows each, as many as leave none empty; and the
// layer-norm partials' elements of every group's blocks (`blocks` each), whatever fewer, larger groups the launch
// takes where the device holds fewer clusters (launch_persistent: each group (blocks + 1) x rows x 3 x 2, `sets` of
// them, and groups x rows <= B + groups - 1).
cuda::RowSplit row_groups(const char* direction, int64_t groups, bool cluster, int64_t B) {
  TORCH_CHECK(groups >= 1 && (groups == 1 || cluster) && (groups <= B || B == 0),
              message("dtmt: the persistent ", direction, "'s clusters of batch rows must be 1 to B (", B,
                      "), in the cluster form; got ", groups, cluster ? "" : " in the grid form"));
  return cuda::split_rows(B, groups);
}
int64_t partials_elems(int64_t blocks, int64_t B, int64_t groups, int64_t sets) {
  return sets * (blocks + 1) * (B + groups) * 3 * 2;
}

// The forward as one persistent cooperative launch of `grid` blocks (persistent_cuda_kernels.cuh): the same
// outputs and saved tensors as forward_impl, so backward_impl runs on them unchanged. The rows of the first
// `resident` sub-cells stay in shared memory, the others' in a spill buffer read through L2 (< 0: all in shared
// memory; persistent_plan chooses). `cluster`: the launch is thread-block clusters of `grid` blocks (at most
// kClusterMaxBlocks), `groups` of them each its own ceil(B / groups) batch rows (row_groups), their barrier the
// cluster's, instead of a cooperative grid. `fallible`: a launch the device
// refuses (too much shared memory, blocks that cannot all be resident, a cluster it cannot place) returns {} instead
// of throwing. `stage_cols`: the FMA products' stage (persistent_plan's, columns of each batch row; < 0: the plan's
// rule, in the shared memory this device leaves the block), none with tensor-core products. `multicast` > 1: the
// grid form in thread-block clusters of that many blocks (dividing the grid), each chunk of the stage read from L2
// once a cluster (persistent_cuda_kernels.cuh's StageShare; only with a stage).
template <typename S>
std::vector<Tensor> forward_persistent_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                            const TransitionWeights& w, bool reverse, double eps, int64_t grid,
                                            int64_t threads, int64_t resident = -1, bool cluster = false,
                                            bool fallible = false, int64_t stage_cols = -1, int64_t multicast = 1,
                                            int64_t groups = 1) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const cuda::RowSplit rg = row_groups("forward", groups, cluster, d.B);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, S_ = D + 1;
  TORCH_CHECK(grid >= 1 && grid <= H,
              message("dtmt: the persistent forward needs 1 <= grid <= H, got grid ", grid, ", H ", H));
  TORCH_CHECK(threads >= 32 && threads % 32 == 0,   // (block_dots and join_blocks shuffle across whole warps)
              message("dtmt: the persistent forward needs a whole number of warps a block, got ", threads,
                      " threads"));
  TORCH_CHECK(!cluster || grid <= cuda::kClusterMaxBlocks,
              message("dtmt: the persistent forward's cluster form holds at most ", cuda::kClusterMaxBlocks,
                      " blocks, got grid ", grid));
  const int64_t slice = (H + grid - 1) / grid;
  grid = (H + slice - 1) / slice;   // every block owns at least one unit
  check_multicast("forward", multicast, cluster, grid);
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
  // (each group's: its blocks', then the joined statistics)
  Tensor partials = at::empty({partials_elems(grid, B, rg.groups, 1)}, acc_opts);
  const int64_t first = reverse ? T_ - 1 : 0;
  if (T_ == 0) {   // (no step: nothing is launched, h_n is h0)
    h_last.copy_(h0);
  } else {
    hs[0][first].copy_(h0);
    if (lp) hs_lp[0][first].copy_(h0);
  }
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
  const Tensor spill = set_persistent_spill<T, S>(a, false, w, d, slice, grid, resident, opts);   // (shared by groups)
  set_persistent_sizes(a, d, slice, reverse, eps, rg.rows, grid);
  a.mma = persistent_mma<T>();
  a.stage_cols = a.mma ? 0
                 : stage_cols >= 0 ? static_cast<int>(stage_cols)
                                   : default_stage<T, A>(false, w, d, slice, resident, multicast, rg.rows);
  a.cluster = cluster;
  a.multicast = a.stage_cols > 0 ? static_cast<int>(multicast) : 1;
  if (T_ > 0) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const cudaError_t err = cuda::launch_persistent_forward<T, A>(
        static_cast<int>(w.kind), a, static_cast<int>(grid * rg.groups), static_cast<int>(threads), stream);
    if (err != cudaSuccess && fallible && launch_refused(err)) {   // the device cannot place it: nothing ran
      (void)cudaGetLastError();   // (the launch's error, cleared)
      ++launches_refused;
      say_refused("forward", cluster, a.multicast, w, x, H, D, B, err, a.mma);
      return {};
    }
    C10_CUDA_CHECK(err);
    ++(cluster ? launches_cluster : a.multicast > 1 ? launches_multicast : launches_grid);
    if (a.mma) ++launches_mma;
  }
  return {out, h_last.to(h0.scalar_type()), xp, hs, lp ? hs_lp : at::empty({0}, opts), hp, hpt};
}

// DTMT_CUDA_RECURRENCE (read once a process; a benchmarks' setting until a GPU session has measured it, issue 72):
// "persistent", forward and backward as the persistent launches, one block per SM (at most one per hidden unit),
// where the layer fits the device (persistent_plan); where it does not, the per-step path, with a warning once a
// layer shape (first_said) and persistent_launch_counts' `steps` counting each such run.
// "persistent-cluster", the cluster form first (one thread-block cluster of at most 16 blocks, its barrier the
// cluster's; devices of compute capability 9.0 and up), where it does not fit the grid form, with a warning (once a
// layer shape). "persistent-multicast", the grid form in clusters of kStageMulticastBlocks blocks that read the
// products' stage once a cluster (code for sm_90a), where the device refuses it the grid form, with a warning.
// Unset or "steps": the per-step path.
enum class Recurrence { kSteps, kPersistent, kPersistentCluster, kPersistentMulticast };
constexpr int kStageMulticastBlocks = 2;   // a first choice, to be measured (benchmarks/phase_probe.cu: 2 and 4)
Recurrence recurrence_requested() {
  static const Recurrence requested = [] {
    const char* env = std::getenv("DTMT_CUDA_RECURRENCE");
    const std::string v = env != nullptr ? env : "";
    if (v == "persistent") return Recurrence::kPersistent;
    if (v == "persistent-cluster") return Recurrence::kPersistentCluster;
    if (v == "persistent-multicast") return Recurrence::kPersistentMulticast;
    if (!v.empty() && v != "steps")
      TORCH_WARN(message("dtmt: DTMT_CUDA_RECURRENCE=", v.c_str(),
                         " ignored: not one of steps, persistent, persistent-cluster, persistent-multicast"));
    return Recurrence::kSteps;
  }();
  return requested;
}
bool persistent_requested() { return recurrence_requested() != Recurrence::kSteps; }


// The persistent plan of a layer on this device (persistent_plan); where it does not fit, grid 0 and a warning
// naming what does not fit, once a layer shape (first_said): the per-step path runs then. Under
// DTMT_CUDA_RECURRENCE=persistent-cluster the cluster form where it fits, under persistent-multicast the grid form in
// clusters sharing the stage (`cluster` false: the plain grid form only, after the device refused either).
template <typename S>
cuda::PersistentPlan device_plan(const Tensor& x, const TransitionWeights& w, bool cluster = true) {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const DeviceLimits limits = device_limits();
  const auto said_first = [&](const char* what) {
    return first_said(what, static_cast<int64_t>(w.kind), d.H, d.D, x.scalar_type(), persistent_mma<T>());
  };
  if (d.D > cuda::kPlanMaxDepth || d.H > cuda::kPlanMaxHidden || d.B > cuda::kPlanMaxRows) {
    if (said_first("past the plan's sizes"))
      TORCH_WARN(message("dtmt: a layer of H=", d.H, ", depth ", d.D, ", B=", d.B, " is past the persistent plan's "
                         "sizes (depth <= ", cuda::kPlanMaxDepth, ", H <= ", cuda::kPlanMaxHidden, ", B <= ",
                         cuda::kPlanMaxRows, "): the per-step path runs (DTMT_CUDA_RECURRENCE=persistent)"));
    return cuda::PersistentPlan{};
  }
  auto plan_of = [&](int cluster_blocks, int multicast = 1) {   // (the sizes within int: checked above)
    return cuda::persistent_plan(static_cast<int>(w.kind), static_cast<int>(d.D), static_cast<int>(d.B),
                                 static_cast<int>(d.H), sizeof(T), sizeof(A), limits.multiprocessors,
                                 limits.smem_optin, persistent_mma<T>(), cuda::kPersistentThreads, limits.l2_bytes,
                                 cluster_blocks, multicast);
  };
  if (cluster && recurrence_requested() == Recurrence::kPersistentCluster) {
    if (limits.cluster_blocks == 0) {
      TORCH_WARN_ONCE("dtmt: this device has no thread-block clusters: the grid form of the persistent launches is "
                      "tried (DTMT_CUDA_RECURRENCE=persistent-cluster)");
    } else {
      const cuda::PersistentPlan one = plan_of(limits.cluster_blocks);
      if (one.fits) return one;
      if (said_first("past one cluster"))
        TORCH_WARN(message("dtmt: a layer of H=", d.H, ", depth ", d.D, ", B=", d.B, " does not fit one "
                           "thread-block cluster: the grid form of the persistent launches is tried "
                           "(DTMT_CUDA_RECURRENCE=persistent-cluster)"));
    }
  }
  bool multicast = cluster && recurrence_requested() == Recurrence::kPersistentMulticast;
#if !defined(DTMT_SM90A) && !defined(DTMT_CUDA_EMULATION)
  if (multicast) {   // (the bulk copies' multicast is code for sm_90a: setup.py's DTMT_SM90A)
    TORCH_WARN_ONCE("dtmt: DTMT_CUDA_RECURRENCE=persistent-multicast needs the extension built for sm_90a "
                    "(TORCH_CUDA_ARCH_LIST=9.0a): the grid form of the persistent launches is tried");
    multicast = false;
  }
#endif
  if (multicast && limits.cluster_blocks == 0)
    TORCH_WARN_ONCE("dtmt: this device has no thread-block clusters: the grid form of the persistent launches is "
                    "tried (DTMT_CUDA_RECURRENCE=persistent-multicast)");
  cuda::PersistentPlan plan = plan_of(0, multicast && limits.cluster_blocks > 0 ? kStageMulticastBlocks : 1);
  if (!plan.fits) {
    if (said_first("past the device"))
      TORCH_WARN(message("dtmt: a layer of H=", d.H, ", depth ", d.D, ", B=", d.B, " needs ",
                         plan.forward_bytes / 1024, " KB (forward) and ", plan.backward_bytes / 1024,
                         " KB (backward) of shared memory a block in ", plan.grid, " blocks, with the matrices of ",
                         d.D + 1 - plan.forward_resident, " / ", d.D + 1 - plan.backward_resident,
                         " sub-cells read from L2 (", plan.forward_spill >> 20, " / ", plan.backward_spill >> 20,
                         " MiB of the ", (limits.l2_bytes / cuda::kSpillL2Share) >> 20,
                         " MiB allowed); this device allows ", limits.smem_optin / 1024,
                         " KB: the per-step path runs (DTMT_CUDA_RECURRENCE=persistent)"));
    plan.grid = 0;
  }
  return plan;
}

// Whether DTMT_CUDA_RECURRENCE asks for the persistent launches and a call on x has work for them: a step and a row
// (an empty batch had been planned, "needing 0 KB", its warning taking the place of a real one, and counted).
bool persistent_asked_for(const Tensor& x) { return persistent_requested() && x.size(0) > 0 && x.size(1) > 0; }

// The persistent plan the driver takes for a call on x (grid 0: the per-step path): device_plan's where
// DTMT_CUDA_RECURRENCE asks for the persistent launches and there is a step to run.
template <typename S> cuda::PersistentPlan recurrence_plan(const Tensor& x, const TransitionWeights& w) {
  return persistent_asked_for(x) ? device_plan<S>(x, w) : cuda::PersistentPlan{};
}

// The backward's pre-activation gradients a chunk of time steps at a time (docs/design/gpu.md, "Memory of the cuda
// backend"): buffers dxp, dhp, dhpt of `steps` time steps each (laid out as the saved xp, hp, hpt of those steps,
// dhpt's sub-cells `steps` apart), which the kernels fill for one chunk; closing it forms that chunk's rows of dx and
// its share of the weight and bias gradients (summed over the chunks in the accumulation type), and the buffers serve
// the next chunk. So the backward's peak holds a chunk's gradients, not the whole sequence's. chunk_steps picks the
// chunk; one chunk (steps = T) is the whole sequence at once, as is the backward without `weight_grads` (the caller
// forms the weight and bias gradients itself from the whole buffers, over many calls at once:
// dtmt_kernels.nn.unrolled). `each` runs the chunks in the backward's order; `outputs` gives the op's 12 outputs
// (the layer-norm gradients as column sums of the row accumulators: deterministic).
constexpr int64_t kChunkRows = 512;   // a chunk's weight GEMMs reduce over at least this many rows (B x steps;
                                      // the last chunk, what is left, may be shorter)
constexpr int64_t kMaxChunks = 4;     // and the gradients of at most a quarter of the sequence are held at once
int64_t chunk_steps(const Dims& d, bool weight_grads) {
  if (!weight_grads || d.T == 0) return d.T;
  const int64_t chunks = std::max<int64_t>(1, std::min({kMaxChunks, d.T, d.T * d.B / kChunkRows}));
  return (d.T + chunks - 1) / chunks;
}

class GradientChunks {
 public:
  GradientChunks(const Tensor& x, const TransitionWeights& w, const Dims& d, const Tensor& hs_lp, bool reverse,
                 bool weight_grads, int64_t steps)
      : x_(x), w_(w), d_(d), hs_lp_(hs_lp), reverse_(reverse), weight_grads_(weight_grads),
        steps_(weight_grads ? std::max<int64_t>(1, std::min(steps, d.T)) : d.T),
        acc_(acc_type(x.scalar_type())) {
    const auto opts = x.options();
    dxp_ = at::empty({steps_, d.B, d.n_in * d.H}, opts);
    dhp_ = at::empty({steps_, d.B, d.n_h * d.H}, opts);
    dhpt_ = at::empty({d.D, steps_, d.B, 3 * d.H}, opts);
    dx_ = at::empty({d.T, d.B, d.I}, opts);
  }

  int64_t steps() const { return steps_; }
  int64_t first_time() const { return t0_; }   // the time of the buffers' first rows (in the open chunk)
  const Tensor& dxp() const { return dxp_; }
  const Tensor& dhp() const { return dhp_; }
  const Tensor& dhpt() const { return dhpt_; }

  // f(lo, hi) fills the buffers for the steps lo..hi-1 (of the backward's order, step s at time s, or T-1-s where
  // reversed), the chunks from the last steps back (once, with lo = hi = 0, where T = 0); f returning false stops
  // there, that chunk not formed
  template <typename F> void each(F&& f) {
    int64_t hi = d_.T;
    do {
      const int64_t lo = std::max<int64_t>(0, hi - steps_);
      t0_ = reverse_ ? d_.T - hi : lo;
      if (!f(lo, hi)) return;
      close(hi - lo);
      hi = lo;
    } while (hi > 0);
  }

  std::vector<Tensor> outputs(const Tensor& dh0, const Tensor& dln_rows, const Tensor& dlnb_rows,
                              const Tensor& dtln_rows, const Tensor& dtlnb_rows) const {
    const bool ln = present(w_.ln_w), tln = present(w_.t_ln_w);
    const at::ScalarType st = x_.scalar_type();
    Tensor dln_w = ln ? dln_rows.sum(0).to(st) : Tensor();
    Tensor dln_b = ln ? dlnb_rows.sum(0).to(st) : Tensor();
    Tensor dt_ln_w = tln ? dtln_rows.sum(1).to(st) : Tensor();
    Tensor dt_ln_b = tln ? dtlnb_rows.sum(1).to(st) : Tensor();
    const int64_t N = d_.T * d_.B;
    if (!weight_grads_)
      return {dx_, dh0, dxp_.view({N, d_.n_in * d_.H}), Tensor(), dhp_.view({N, d_.n_h * d_.H}), Tensor(), dln_w,
              dln_b, dhpt_.view({d_.D, N, 3 * d_.H}), Tensor(), dt_ln_w, dt_ln_b};
    return {dx_, dh0, g_[0].to(st), g_[1].to(st), g_[2].to(st), g_[3].to(st), dln_w, dln_b, g_[4].to(st),
            g_[5].to(st), dt_ln_w, dt_ln_b};
  }

 private:
  // the chunk's n steps from time t0_: its rows of dx, and its share of the weight and bias gradients
  void close(int64_t n) {
    const int64_t B = d_.B, H = d_.H, D = d_.D, N = n * B, t0 = t0_;
    const Tensor dxp = dxp_.narrow(0, 0, n).view({N, d_.n_in * H});
    Tensor dx = dx_.narrow(0, t0, n).view({N, d_.I});
    at::mm_out(dx, dxp, w_.w_ih);
    if (!weight_grads_) return;
    const Tensor dhp = dhp_.narrow(0, 0, n).view({N, d_.n_h * H});
    const Tensor dhpt = dhpt_.narrow(1, 0, n).view({D, N, 3 * H});
    const Tensor states = hs_lp_.narrow(1, t0, n).view({D + 1, N, H});
    add_product(g_[0], dxp.t(), x_.narrow(0, t0, n).reshape({N, d_.I}));
    add_sum(g_[1], dxp, 0);
    add_product(g_[2], dhp.t(), states[0]);
    add_sum(g_[3], dhp, 0);
    add_product(g_[4], dhpt.transpose(1, 2), states.narrow(0, 1, D));
    add_sum(g_[5], dhpt, 1);
  }
  // g += a . b (matrices, or batches of them), in the accumulation type: the first chunk's product as it is (one
  // chunk gives what one product over the whole sequence gives), then summed in place where the storage type is
  // the accumulation type, else through the product in the storage type. With one chunk the product stays in the
  // storage type: a 16-bit product's copy in float and back gave the same values, in 3x a weight's bytes at the
  // peak (bf16 peak memory over the reference's, H200, 2026-12-04)
  void add_product(Tensor& g, const Tensor& a, const Tensor& b) const {
    const bool batched = a.dim() == 3;
    if (!g.defined()) {
      g = batched ? at::bmm(a, b) : a.mm(b);
      if (steps_ < d_.T) g = g.to(acc_);   // (more chunks to sum in the accumulation type)
    } else if (a.scalar_type() == acc_) {
      if (batched) {
        g.baddbmm_(a, b);
      } else {
        g.addmm_(a, b);
      }
    } else {
      g.add_(batched ? at::bmm(a, b) : a.mm(b));
    }
  }
  void add_sum(Tensor& g, const Tensor& v, int64_t dim) const {
    Tensor s = v.sum(std::vector<int64_t>{dim}, false, acc_);
    if (!g.defined()) {
      g = s;
    } else {
      g.add_(s);
    }
  }

  const Tensor& x_;
  const TransitionWeights& w_;
  const Dims d_;
  const Tensor hs_lp_;
  const bool reverse_, weight_grads_;
  const int64_t steps_;
  const at::ScalarType acc_;
  Tensor dxp_, dhp_, dhpt_, dx_;
  Tensor g_[6];   // dw_ih, db_ih, dw_hh, db_hh, dt_w, dt_b
  int64_t t0_ = 0;
};

// The per-step backward of one layer call over reversed time, as an object: for each time step and sub-cell, from
// the top, one element-wise launch (`launch`) and the product of its pre-activation gradients with U (`product`),
// which the next launch adds in. Two gradients are carried, each double-buffered: `carry` across time steps (with
// its product `carry_g`), `inner` between the sub-cells of a step (with `inner_g`). The pre-activation gradients go
// to `chunks` (GradientChunks, chunks of `chunk` steps), which forms the weight gradients. backward_impl runs it.
template <typename S>
class StepBackward {
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;

 public:
  StepBackward(const BackwardInputs& in, const TransitionWeights& w, const SavedForward& saved, bool reverse,
               double eps, bool weight_grads, int64_t chunk)
      : grad_out_(in.grad_out), mask_(in.mask), drop_(in.drop), w_(w), xp_(saved.xp), hs_(saved.hs), hp_(saved.hp),
        hpt_(saved.hpt), d_(dims_of(in.x, w)), eps_(eps), ln_(present(w.ln_w)), tln_(present(w.t_ln_w)),
        stream_(c10::cuda::getCurrentCUDAStream()), gemm_(step_gemm(d_.B)), order_(step_order(d_.T, reverse)),
        chunks_(in.x, w, d_, present(saved.hs_lp) ? saved.hs_lp : saved.hs, reverse, weight_grads, chunk) {
    check_shared_memory<A>(d_, 2, "backward");
    const int64_t B = d_.B, H = d_.H, D = d_.D;
    const auto opts = in.x.options();
    const at::ScalarType acc = acc_type(in.x.scalar_type());
    const auto acc_opts = opts.dtype(acc);
    dln_rows_ = at::zeros({ln_ ? B : 0, d_.n_g * H}, acc_opts);
    dlnb_rows_ = at::zeros({ln_ ? B : 0, d_.n_g * H}, acc_opts);
    dtln_rows_ = at::zeros({tln_ ? D : 0, B, 2 * H}, acc_opts);
    dtlnb_rows_ = at::zeros({tln_ ? D : 0, B, 2 * H}, acc_opts);
    carry_[0] = in.grad_hn.to(acc, /*non_blocking=*/false, /*copy=*/true).contiguous();
    carry_[1] = at::empty({B, H}, acc_opts);
    carry_g_ = at::empty({B, H}, opts);
    inner_[0] = at::empty({B, H}, acc_opts);
    inner_[1] = at::empty({B, H}, acc_opts);
    inner_g_ = at::empty({B, H}, opts);
    const bool rows = gemm_ == StepGemm::kRows;
    w_hh_ = w.w_hh.contiguous();
    t_w_ = D > 0 ? w.t_w.contiguous() : w.t_w;
    // the row GEMM multiplies by w^T with w [N, K] row-major: here U^T [H, n], made once for the loop
    w_hh_rows_ = rows ? w_hh_.t().contiguous() : w_hh_;
    t_w_rows_ = rows && D > 0 ? t_w_.transpose(1, 2).contiguous() : t_w_;
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
    handle_ = gemm_ == StepGemm::kCublas ? at::cuda::getCurrentCUDABlasHandle() : nullptr;
#endif
  }

  // the op's 12 outputs (GradientChunks::outputs)
  std::vector<Tensor> run(const Tensor& grad_hn) {
    chunks_.each([&](int64_t lo, int64_t hi) {
      for (int64_t step = hi - 1; step >= lo; --step) {
        const int64_t t = order_[step], r = t - chunks_.first_time();   // r: t's rows in the chunk's buffers
        for (int64_t k = d_.D; k >= 0; --k) {
          launch(t, r, k);
          if (k == 0) {
            product(carry_g_, chunks_.dhp(), r * d_.B * d_.n_h * d_.H, w_hh_, w_hh_rows_, 0, d_.n_h * d_.H);
            c_ = 1 - c_;
            has_cg_ = true;
          } else {
            product(inner_g_, chunks_.dhpt(), ((k - 1) * chunks_.steps() + r) * d_.B * 3 * d_.H, t_w_, t_w_rows_,
                    (k - 1) * 3 * d_.H * d_.H, 3 * d_.H);
            i_ = 1 - i_;
          }
        }
        i_ = 0;
      }
      return true;
    });
    // (carry_g holds a product only after a step: with T = 0, dh0 is grad_hn)
    const Tensor carried = has_cg_ ? carry_[c_] + carry_g_.to(carry_[c_].scalar_type()) : carry_[c_];
    Tensor dh0 = carried.to(grad_hn.scalar_type());
    return chunks_.outputs(dh0, dln_rows_, dlnb_rows_, dtln_rows_, dtlnb_rows_);
  }

 private:
  // sub-cell k's backward kernel at time t (rows r of the chunk's gradient buffers): the base cell (k = 0) writes the
  // carried gradient of the step before, a T-GRU the inner gradient of the sub-cell below
  void launch(int64_t t, int64_t r, int64_t k) {
    const int64_t T_ = d_.T, B = d_.B, H = d_.H, BH = B * H;
    cuda::StepBackwardArgs<T, A> a{};
    const bool base = k == 0;
    const int kind = base ? static_cast<int>(w_.kind) : kTGRU;
    if (base) {
      a.xp = cptr<T, S>(xp_, t * B * d_.n_in * H);
      a.hp = cptr<T, S>(hp_, t * B * d_.n_h * H);
      a.bh = cptr<T, S>(w_.b_hh);
      a.lnw = ln_ ? cptr<T, S>(w_.ln_w) : nullptr;
      a.lnb = ln_ ? cptr<T, S>(w_.ln_b) : nullptr;
      a.dxp = mptr<T, S>(chunks_.dxp(), r * B * d_.n_in * H);
      a.dhp = mptr<T, S>(chunks_.dhp(), r * B * d_.n_h * H);
      a.dlnw = ln_ ? mptr<A, A>(dln_rows_) : nullptr;
      a.dlnb = ln_ ? mptr<A, A>(dlnb_rows_) : nullptr;
      a.dh = mptr<A, A>(carry_[1 - c_]);
    } else {
      const int64_t off = ((k - 1) * T_ + t) * B * 3 * H;
      a.hp = cptr<T, S>(hpt_, off);
      a.bh = cptr<T, S>(w_.t_b, (k - 1) * 3 * H);
      a.lnw = tln_ ? cptr<T, S>(w_.t_ln_w, (k - 1) * 2 * H) : nullptr;
      a.lnb = tln_ ? cptr<T, S>(w_.t_ln_b, (k - 1) * 2 * H) : nullptr;
      a.dhp = mptr<T, S>(chunks_.dhpt(), ((k - 1) * chunks_.steps() + r) * B * 3 * H);
      a.dlnw = tln_ ? mptr<A, A>(dtln_rows_, (k - 1) * BH * 2) : nullptr;
      a.dlnb = tln_ ? mptr<A, A>(dtlnb_rows_, (k - 1) * BH * 2) : nullptr;
      a.dh = mptr<A, A>(inner_[1 - i_]);
    }
    a.hin = cptr<A, A>(hs_, (k * T_ + t) * BH);
    a.drop = kind != kATR ? cptr<T, S>(drop_, k * BH) : nullptr;
    a.din = cptr<A, A>(inner_[i_]);
    a.gin = cptr<T, S>(inner_g_);
    a.cd = cptr<A, A>(carry_[c_]);
    a.cg = has_cg_ ? cptr<T, S>(carry_g_) : nullptr;
    a.go = cptr<T, S>(grad_out_, t * BH);
    a.mask = cptr<T, S>(mask_, t * B);
    a.H = static_cast<int>(H);
    a.eps = static_cast<A>(eps_);
    a.top = k == d_.D;
    a.base = base;
    C10_CUDA_CHECK((cuda::launch_step_backward<T, A>(kind, a, static_cast<int>(B), stream_)));
  }

  // out[B, H] = d(pre-activations)[B, n] . U[n, H]; the pre-activation gradients and U are rows of `dpre` and `u`
  // from the element offsets given (`u_rows`: the same matrix as U^T, same offset)
  void product(Tensor& out, const Tensor& dpre, int64_t dpre_off, const Tensor& u, const Tensor& u_rows,
               int64_t u_off, int64_t n) {
    const int64_t B = d_.B, H = d_.H;
    const bool rows = gemm_ == StepGemm::kRows;
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
    if (gemm_ == StepGemm::kCublas) {
      cublas_gemm<T>(handle_, cptr<T, S>(dpre, dpre_off), cptr<T, S>(u, u_off), mptr<T, S>(out),
                     static_cast<int>(B), static_cast<int>(H), static_cast<int>(n), /*w_transposed=*/false);
      return;
    }
#endif
    if (rows || gemm_ == StepGemm::kTiled) {
      const cuda::GemmArgs<T> g{cptr<T, S>(dpre, dpre_off), cptr<T, S>(rows ? u_rows : u, u_off), mptr<T, S>(out),
                                static_cast<int>(B), static_cast<int>(H), static_cast<int>(n)};
      C10_CUDA_CHECK(
          (rows ? cuda::launch_rows_gemm<T, A>(g, stream_) : cuda::launch_tiled_gemm<false, T, A>(g, stream_)));
    } else {
      at::mm_out(out, dpre.view({-1}).narrow(0, dpre_off, B * n).view({B, n}),
                 u.view({-1}).narrow(0, u_off, n * H).view({n, H}));
    }
  }

  const Tensor &grad_out_, &mask_, &drop_;
  const TransitionWeights& w_;
  const Tensor &xp_, &hs_, &hp_, &hpt_;
  const Dims d_;
  const double eps_;
  const bool ln_, tln_;
  const cudaStream_t stream_;
  const StepGemm gemm_;
  const std::vector<int64_t> order_;
  GradientChunks chunks_;
  Tensor dln_rows_, dlnb_rows_, dtln_rows_, dtlnb_rows_, carry_g_, inner_g_;
  Tensor carry_[2], inner_[2];
  Tensor w_hh_, t_w_, w_hh_rows_, t_w_rows_;
  int c_ = 0, i_ = 0;      // the carry and inner buffers read now
  bool has_cg_ = false;    // carry_g holds a product (from the step after this one)
#if defined(DTMT_CUBLAS_DIRECT_BUILT)
  cublasHandle_t handle_ = nullptr;
#endif
};

template <typename S>
std::vector<Tensor> backward_impl(const BackwardInputs& in, const TransitionWeights& w, const SavedForward& saved,
                                  bool reverse, double eps, bool weight_grads, int64_t chunk = -1) {
  if (chunk < 0) chunk = chunk_steps(dims_of(in.x, w), weight_grads);
  return StepBackward<S>(in, w, saved, reverse, eps, weight_grads, chunk).run(in.grad_hn);
}

// The backward as persistent cooperative launches of `grid` blocks (persistent_cuda_kernels.cuh) on the forward's
// saved tensors (either forward's), one a chunk of steps (GradientChunks, `chunk` steps; < 0: chunk_steps), each
// followed by its chunk's share of the weight gradients; `fallible` and `stage_cols` as forward_persistent_impl's.
template <typename S>
std::vector<Tensor> backward_persistent_impl(const BackwardInputs& in, const TransitionWeights& w,
                                             const SavedForward& saved, bool reverse, double eps, int64_t grid,
                                             int64_t threads, int64_t resident = -1, bool cluster = false,
                                             bool fallible = false, bool weight_grads = true,
                                             int64_t stage_cols = -1, int64_t chunk = -1, int64_t multicast = 1,
                                             int64_t groups = 1) {
  const Tensor &grad_out = in.grad_out, &grad_hn = in.grad_hn, &x = in.x, &mask = in.mask, &drop = in.drop;
  const Tensor &xp = saved.xp, &hs = saved.hs, &hs_lp_saved = saved.hs_lp, &hp = saved.hp, &hpt = saved.hpt;
  using T = typename DeviceType<S>::type;
  using A = std::conditional_t<std::is_same<S, double>::value, double, float>;
  const Dims d = dims_of(x, w);
  const cuda::RowSplit rg = row_groups("backward", groups, cluster, d.B);
  const int64_t B = d.B, H = d.H, D = d.D;
  TORCH_CHECK(grid >= 1 && grid <= H,
              message("dtmt: the persistent backward needs 1 <= grid <= H, got grid ", grid, ", H ", H));
  TORCH_CHECK(threads >= 32 && threads % 32 == 0,
              message("dtmt: the persistent backward needs a whole number of warps a block, got ", threads,
                      " threads"));
  TORCH_CHECK(!cluster || grid <= cuda::kClusterMaxBlocks,
              message("dtmt: the persistent backward's cluster form holds at most ", cuda::kClusterMaxBlocks,
                      " blocks, got grid ", grid));
  const int64_t slice = (H + grid - 1) / grid;
  grid = (H + slice - 1) / slice;
  check_multicast("backward", multicast, cluster, grid);
  const auto opts = x.options();
  const at::ScalarType acc = acc_type(x.scalar_type());
  const auto acc_opts = opts.dtype(acc);
  const Tensor hs_lp = present(hs_lp_saved) ? hs_lp_saved : hs;
  const bool ln = present(w.ln_w), tln = present(w.t_ln_w);
  GradientChunks chunks(x, w, d, hs_lp, reverse, weight_grads, chunk < 0 ? chunk_steps(d, weight_grads) : chunk);
  Tensor dln_rows = at::zeros({ln ? B : 0, d.n_g * H}, acc_opts);
  Tensor dlnb_rows = at::zeros({ln ? B : 0, d.n_g * H}, acc_opts);
  Tensor dtln_rows = at::zeros({tln ? D : 0, B, 2 * H}, acc_opts);
  Tensor dtlnb_rows = at::zeros({tln ? D : 0, B, 2 * H}, acc_opts);
  Tensor dh[2] = {at::empty({B, H}, acc_opts), at::empty({B, H}, acc_opts)};   // each chunk's dh0, in turn
  Tensor partials = at::empty({partials_elems(grid, B, rg.groups, 2)}, acc_opts);
  const Tensor ghn = grad_hn.to(acc).contiguous(), gout = grad_out.contiguous();
  const Tensor w_hh = w.w_hh.contiguous(), t_w = D > 0 ? w.t_w.contiguous() : w.t_w;

  cuda::PersistentBackwardArgs<T, A> a{};
  a.xp = cptr<T, S>(xp);
  a.hp = cptr<T, S>(hp);
  a.hpt = D > 0 ? cptr<T, S>(hpt) : nullptr;
  a.hs = cptr<A, A>(hs);
  set_persistent_weights<T, S>(a, w, w_hh, t_w, drop, mask);
  a.grad_out = cptr<T, S>(gout);
  a.dxp = mptr<T, S>(chunks.dxp());
  a.dhp = mptr<T, S>(chunks.dhp());
  a.dhpt = D > 0 ? mptr<T, S>(chunks.dhpt()) : nullptr;
  a.chunk_steps = static_cast<int>(chunks.steps());
  a.dln_rows = ln ? mptr<A, A>(dln_rows) : nullptr;
  a.dlnb_rows = ln ? mptr<A, A>(dlnb_rows) : nullptr;
  a.dtln_rows = tln ? mptr<A, A>(dtln_rows) : nullptr;
  a.dtlnb_rows = tln ? mptr<A, A>(dtlnb_rows) : nullptr;
  a.partials = mptr<A, A>(partials);
  const Tensor spill = set_persistent_spill<T, S>(a, true, w, d, slice, grid, resident, opts);   // (shared by groups)
  set_persistent_sizes(a, d, slice, reverse, eps, rg.rows, grid);
  a.mma = persistent_mma<T>();
  a.stage_cols = a.mma ? 0
                 : stage_cols >= 0 ? static_cast<int>(stage_cols)
                                   : default_stage<T, A>(true, w, d, slice, resident, multicast, rg.rows);
  a.cluster = cluster;
  a.multicast = a.stage_cols > 0 ? static_cast<int>(multicast) : 1;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int c = 0;   // the chunks launched
  cudaError_t refused = cudaSuccess;
  chunks.each([&](int64_t lo, int64_t hi) {
    a.step_lo = static_cast<int>(lo);
    a.step_hi = static_cast<int>(hi);
    a.chunk_t0 = static_cast<int>(chunks.first_time());
    a.grad_hn = c == 0 ? cptr<A, A>(ghn) : cptr<A, A>(dh[(c - 1) % 2]);
    a.dh0 = mptr<A, A>(dh[c % 2]);
    const cudaError_t err = cuda::launch_persistent_backward<T, A>(
        static_cast<int>(w.kind), a, static_cast<int>(grid * rg.groups), static_cast<int>(threads), stream);
    if (err != cudaSuccess && fallible && launch_refused(err)) {   // the device cannot place it: this one not run
      (void)cudaGetLastError();
      refused = err;
      return false;
    }
    C10_CUDA_CHECK(err);
    ++c;
    return true;
  });
  // A refusal comes at the first chunk (every launch asks for the same grid and memory; at a later one the chunks
  // before it would have run for nothing): the per-step backward starts afresh. The counts are of backward calls.
  if (refused != cudaSuccess) {
    ++launches_refused;
    say_refused("backward", cluster, a.multicast, w, x, H, D, B, refused, a.mma);
    return {};
  }
  ++(cluster ? launches_cluster : a.multicast > 1 ? launches_multicast : launches_grid);
  if (a.mma) ++launches_mma;
  return chunks.outputs(dh[(c - 1) % 2].to(grad_hn.scalar_type()), dln_rows, dlnb_rows, dtln_rows, dtlnb_rows);
}

}  // namespace

// Returns {out, h_n, xp, hs, hs_lp (empty for float / double), hp, hpt}.
std::vector<Tensor> transition_forward_cuda(const Tensor& x, const Tensor& h0, const Tensor& mask_in,
                                            const Tensor& drop_in, const TransitionWeights& w_in, bool reverse,
                                            double eps) {
  check_devices(x, h0, mask_in, drop_in, w_in, "transition_forward");
  const c10::cuda::CUDAGuard guard(x.device());
  const TransitionWeights w = in_x_dtype(w_in, x, "transition_forward");
  const Tensor mask = in_x_dtype(mask_in, x), drop = in_x_dtype(drop_in, x);
  check_step_sizes(dims_of(x, w), "transition_forward");
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "dtmt_transition_forward_cuda", [&] {
    cuda::PersistentPlan plan = recurrence_plan<scalar_t>(x, w);
    if (plan.grid > 0)
      result = forward_persistent_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps, plan.grid,
                                                 cuda::kPersistentThreads, plan.forward_resident, plan.cluster,
                                                 /*fallible=*/true, plan.forward_stage, plan.multicast, plan.groups);
    if (result.empty() && (plan.cluster || plan.multicast > 1) &&
        (plan = device_plan<scalar_t>(x, w, false)).grid > 0)   // the plain grid form
      result = forward_persistent_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps, plan.grid,
                                                 cuda::kPersistentThreads, plan.forward_resident, false,
                                                 /*fallible=*/true, plan.forward_stage);
    if (result.empty()) {
      if (persistent_asked_for(x)) ++launches_steps;   // (asked for, not run: counted)
      result = forward_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps);
    }
  });
  return result;
}

// The same, as one persistent launch of `grid` blocks of `threads` threads with the first `resident` sub-cells'
// rows in shared memory (< 0: all), thread-block clusters with `cluster` (`groups` of them, each its batch rows),
// clusters of `multicast` blocks sharing the stage (forward_persistent_impl).
std::vector<Tensor> transition_forward_persistent_cuda(const Tensor& x, const Tensor& h0, const Tensor& mask_in,
                                                       const Tensor& drop_in, const TransitionWeights& w_in,
                                                       bool reverse, double eps, int64_t grid, int64_t threads,
                                                       int64_t resident, bool cluster, int64_t multicast,
                                                       int64_t groups = 1) {
  check_devices(x, h0, mask_in, drop_in, w_in, "transition_forward");
  const c10::cuda::CUDAGuard guard(x.device());
  const TransitionWeights w = in_x_dtype(w_in, x, "transition_forward");
  const Tensor mask = in_x_dtype(mask_in, x), drop = in_x_dtype(drop_in, x);
  check_step_sizes(dims_of(x, w), "transition_forward");
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(x.scalar_type(), "dtmt_transition_forward_persistent_cuda", [&] {
    result = forward_persistent_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps, grid, threads, resident, cluster,
                                               false, -1, multicast, groups);
  });
  return result;
}

// The backward as one persistent launch of `grid` blocks of `threads` threads, `resident`, `cluster`, `multicast`
// and `groups` as the forward's (backward_persistent_impl).
std::vector<Tensor> transition_backward_persistent_cuda(const BackwardInputs& in_given,
                                                        const TransitionWeights& w_in, const SavedForward& saved,
                                                        bool reverse, double eps, int64_t grid, int64_t threads,
                                                        int64_t resident, bool cluster, int64_t multicast,
                                                        int64_t groups = 1) {
  check_devices(in_given, w_in, saved);
  check_saved_low_precision(in_given, saved);
  const c10::cuda::CUDAGuard guard(in_given.x.device());
  const BackwardInputs in = in_x_dtype(in_given);
  const TransitionWeights w = in_x_dtype(w_in, in.x, "transition_backward");
  check_step_sizes(dims_of(in.x, w), "transition_backward");
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(in.x.scalar_type(), "dtmt_transition_backward_persistent_cuda", [&] {
    result = backward_persistent_impl<scalar_t>(in, w, saved, reverse, eps, grid, threads, resident, cluster, false,
                                                true, -1, -1, multicast, groups);
  });
  return result;
}

// Returns {dx, dh0, dw_ih, db_ih, dw_hh, db_hh, dln_w, dln_b, dt_w, dt_b, dt_ln_w, dt_ln_b}.
std::vector<Tensor> transition_backward_cuda(const BackwardInputs& in_given, const TransitionWeights& w_in,
                                             const SavedForward& saved, bool reverse, double eps, bool weight_grads) {
  check_devices(in_given, w_in, saved);
  check_saved_low_precision(in_given, saved);
  const c10::cuda::CUDAGuard guard(in_given.x.device());
  const BackwardInputs in = in_x_dtype(in_given);
  const TransitionWeights w = in_x_dtype(w_in, in.x, "transition_backward");
  check_step_sizes(dims_of(in.x, w), "transition_backward");
  std::vector<Tensor> result;
  DTMT_DISPATCH_TYPES(in.x.scalar_type(), "dtmt_transition_backward_cuda", [&] {
    cuda::PersistentPlan plan = recurrence_plan<scalar_t>(in.x, w);
    if (plan.grid > 0)
      result = backward_persistent_impl<scalar_t>(in, w, saved, reverse, eps, plan.grid, cuda::kPersistentThreads,
                                                  plan.backward_resident, plan.cluster, /*fallible=*/true,
                                                  weight_grads, plan.backward_stage, -1, plan.multicast, plan.groups);
    if (result.empty() && (plan.cluster || plan.multicast > 1) &&
        (plan = device_plan<scalar_t>(in.x, w, false)).grid > 0)   // the plain grid form
      result = backward_persistent_impl<scalar_t>(in, w, saved, reverse, eps, plan.grid, cuda::kPersistentThreads,
                                                  plan.backward_resident, false, /*fallible=*/true, weight_grads,
                                                  plan.backward_stage);
    if (result.empty()) {
      if (persistent_asked_for(in.x)) ++launches_steps;
      result = backward_impl<scalar_t>(in, w, saved, reverse, eps, weight_grads);
    }
  });
  return result;
}

PersistentLaunchCounts persistent_launch_counts() {
  return {launches_grid.load(), launches_cluster.load(), launches_refused.load(), launches_multicast.load(),
          launches_mma.load(), launches_steps.load()};
}

}  // namespace dtmt
