// The small-row linear kernel (see small_gemm.h for why).
//
// out[m, n] = bias[n] + sum_k x[m, k] W[n, k]. The K loop over a weight row loads each 8 floats of it once and
// multiplies them into all M rows of x (vector accumulators, reduced across lanes once per row). So every weight
// byte is read once per call, in address order, and x (at most 8 x K floats) is re-read from L1. Ranges of rows
// are shared among threads with at::parallel_for; each output element is written by one thread and summed in a
// fixed order, so results do not depend on the thread count.
//
// Built with AVX2 + FMA intrinsics where the compiler targets them (the default -march=native build on
// x86-64); elsewhere small_rows_applicable() is false and linear_into() falls back to ATen's GEMM.
#include "small_gemm.h"

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DTMT_SMALL_ROWS 1
#else
#define DTMT_SMALL_ROWS 0
#endif

namespace dtmt {
namespace {

#if DTMT_SMALL_ROWS
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [n0, n1) of the output for a compile-time number of x rows M. One weight row at a time (a single
// sequential stream: on the EPYC of NOTES.md two or more interleaved row streams read DRAM slower), U chunks of 8
// floats per iteration with their own accumulators (M*U of them, so that the FMA latency is hidden), and a
// software prefetch kPrefetch floats ahead.
constexpr int64_t kPrefetch = 256;

template <int M, int U>
void rows_block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t KU = K - K % (8 * U);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    const float* wr = w + n * K;
    for (int64_t k = 0; k < KU; k += 8 * U) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k + kPrefetch), _MM_HINT_T0);
      __m256 wv[U];
      for (int u = 0; u < U; ++u) wv[u] = _mm256_loadu_ps(wr + k + 8 * u);
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < U; ++u)
          acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * u), wv[u], acc[m][u]);
    }
    for (int m = 0; m < M; ++m) {
      __m256 a = acc[m][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[m][u]);
      float s = lane_sum(a);
      for (int64_t k = KU; k < K; ++k) s += x[m * ldx + k] * wr[k];
      out[m * ldo + n] = bias ? s + bias[n] : s;
    }
  }
}

// Chunks per iteration: enough accumulators to hide the FMA latency, within the 16 vector registers.
template <int M> constexpr int unroll() { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }

template <int M>
void run_rows(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, const float* bias, float* out,
              int64_t ldo) {
  // at least 256 KiB of weights per task (~15 us of reading): below that, starting a second thread costs more
  // than it saves
  const int64_t grain = std::max<int64_t>(1, (256 * 1024 / 4) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_block<M, unroll<M>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
  });
}

using RunRows = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t);
constexpr RunRows kRunRows[kSmallRowsMax] = {run_rows<1>, run_rows<2>, run_rows<3>, run_rows<4>,
                                             run_rows<5>, run_rows<6>, run_rows<7>, run_rows<8>};
#endif  // DTMT_SMALL_ROWS

}  // namespace

bool small_rows_applicable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& out) {
#if DTMT_SMALL_ROWS
  const auto f32 = at::kFloat;
  if (x.dim() != 2 || w.dim() != 2 || out.dim() != 2) return false;
  if (!x.device().is_cpu() || !w.device().is_cpu() || !out.device().is_cpu() || x.scalar_type() != f32 ||
      w.scalar_type() != f32 || out.scalar_type() != f32)
    return false;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M < 1 || M > kSmallRowsMax || w.size(1) != K || out.size(0) != M || out.size(1) != N) return false;
  if ((K > 1 && x.stride(1) != 1) || !w.is_contiguous() || (N > 1 && out.stride(1) != 1)) return false;
  if (bias.defined() && bias.numel() > 0 &&
      (!bias.device().is_cpu() || bias.scalar_type() != f32 || bias.dim() != 1 || bias.size(0) != N ||
       !bias.is_contiguous()))
    return false;
  return true;
#else
  (void)x, (void)w, (void)bias, (void)out;
  return false;
#endif
}

void linear_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x, const at::Tensor& w) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
#if DTMT_SMALL_ROWS
  if (small_rows_applicable(x, w, bias, out)) {
    const int64_t M = x.size(0);
    kRunRows[M - 1](x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.size(0), x.size(1),
                    has_bias ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0));
    return;
  }
#endif
  if (has_bias) {
    at::addmm_out(out, bias, x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dtmt._C.small_rows_linear: x [M, K] and "
              "w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && (!bias.defined() || bias.device().is_cpu()),
              "dtmt._C.small_rows_linear takes CPU tensors");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_into(out, bias, x, w.is_contiguous() ? w : w.contiguous());
  return out;
}

bool small_rows_kernel_built() { return DTMT_SMALL_ROWS != 0; }

}  // namespace dtmt
