// The small-row linear kernel (see small_gemm.h for why, small_gemm_cpu.cpp for the threads) over a range of
// output columns. One copy per instruction set (kernels.h).
//
// out[m, n] = bias[n] + sum_k x[m, k] W[n, k]. The K loop over a weight row loads each chunk of it once and
// multiplies it into all M rows of x (vector accumulators, reduced across lanes once per row). So every weight
// byte is read once per call, in address order, and x (at most 8 x K floats) is re-read from L1. Each output
// element is summed in a fixed order, so results do not depend on how the columns are split among threads.
//
// With AVX2 + FMA (the avx2 and avx512 copies, or a native build on such a CPU) chunks of 8 floats in intrinsics;
// otherwise (the baseline copy) plain loops over chunks of 4 floats that the compiler turns into SSE2 (or another
// target's) vectors, without FMA: the same order of reads, other rounding.
//
// small_rows_int8 is the same walk over int8 weight rows (small_gemm.h's int8 format): each chunk of weights is
// widened to floats (exactly) before the multiply-adds, and a row's sums are multiplied by its scale at the end.
// The activations stay float32: no rounding besides the weights' own.
#include "kernels.h"

#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DTMT_SMALL_ROWS_AVX2 1
#else
#define DTMT_SMALL_ROWS_AVX2 0
#endif

namespace dtmt {
namespace DTMT_ISA {
namespace {

// Software prefetch distance along a weight row, in floats.
constexpr int64_t kPrefetch = 256;
constexpr int64_t kPrefetchInt8 = 1024;  // the same for int8 weight rows, in bytes

// The float32 scale stored after the K int8 values of an int8 weight row (small_gemm.h).
inline float row_scale(const int8_t* row, int64_t K) {
  float scale;
  std::memcpy(&scale, row + K, sizeof scale);
  return scale;
}

// Chunks per iteration: enough accumulators to hide the FMA latency, within the 16 vector registers.
template <int M> constexpr int unroll() { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }

#if DTMT_SMALL_ROWS_AVX2
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [n0, n1) of the output for a compile-time number of x rows M. One weight row at a time (a single
// sequential stream, by design: benchmarks/NOTES.md, log item 10), U chunks of 8
// floats per iteration with their own accumulators (M*U of them, so that the FMA latency is hidden), and a
// software prefetch kPrefetch floats ahead.
template <int M, int U>
void rows_block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
                int64_t n0, int64_t n1) {
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

// The int8 walk (weight rows of K int8 values, small_gemm.h's int8 row format, `ldw` bytes apart): each chunk
// of 8 int8 weights is widened to 8 floats (exact) and multiplied into all M rows of x as above; the row's sum
// is then multiplied by its scale. A quarter of the bytes of the float walk per output.
template <int M, int U>
void rows_block_int8(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t ldw, const float* bias,
                     float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t KU = K - K % (8 * U);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    const int8_t* wr = w + n * ldw;
    for (int64_t k = 0; k < KU; k += 8 * U) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k + kPrefetchInt8), _MM_HINT_T0);
      __m256 wv[U];
      for (int u = 0; u < U; ++u)
        wv[u] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k + 8 * u))));
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < U; ++u)
          acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * u), wv[u], acc[m][u]);
    }
    const float scale = row_scale(wr, K);
    for (int m = 0; m < M; ++m) {
      __m256 a = acc[m][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[m][u]);
      float s = lane_sum(a);
      for (int64_t k = KU; k < K; ++k) s += x[m * ldx + k] * static_cast<float>(wr[k]);
      out[m * ldo + n] = bias ? s * scale + bias[n] : s * scale;
    }
  }
}
#else
// The same walk in plain C++: per weight row, U chunks of L floats an iteration, one accumulator of L lanes per
// (row of x, chunk), summed lane by lane at the end.
template <int M, int U>
void rows_block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
                int64_t n0, int64_t n1) {
  constexpr int L = 4;
  const int64_t KU = K - K % (L * U);
  for (int64_t n = n0; n < n1; ++n) {
    float acc[M][U][L];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u)
        for (int l = 0; l < L; ++l) acc[m][u][l] = 0.0f;
    const float* DTMT_RESTRICT wr = w + n * K;
    for (int64_t k = 0; k < KU; k += L * U) {
      __builtin_prefetch(wr + k + kPrefetch);
      for (int m = 0; m < M; ++m) {
        const float* DTMT_RESTRICT xr = x + m * ldx + k;
        for (int u = 0; u < U; ++u)
          for (int l = 0; l < L; ++l) acc[m][u][l] += xr[u * L + l] * wr[k + u * L + l];
      }
    }
    for (int m = 0; m < M; ++m) {
      float lanes[L];
      for (int l = 0; l < L; ++l) {
        lanes[l] = acc[m][0][l];
        for (int u = 1; u < U; ++u) lanes[l] += acc[m][u][l];
      }
      float s = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
      for (int64_t k = KU; k < K; ++k) s += x[m * ldx + k] * wr[k];
      out[m * ldo + n] = bias ? s + bias[n] : s;
    }
  }
}
// The int8 walk in plain C++ (chunks of L widened weights, as the float walk's).
template <int M, int U>
void rows_block_int8(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t ldw, const float* bias,
                     float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int L = 4;
  const int64_t KU = K - K % (L * U);
  for (int64_t n = n0; n < n1; ++n) {
    float acc[M][U][L];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u)
        for (int l = 0; l < L; ++l) acc[m][u][l] = 0.0f;
    const int8_t* DTMT_RESTRICT wr = w + n * ldw;
    for (int64_t k = 0; k < KU; k += L * U) {
      __builtin_prefetch(wr + k + kPrefetchInt8);
      float wf[U * L];
      for (int i = 0; i < U * L; ++i) wf[i] = static_cast<float>(wr[k + i]);
      for (int m = 0; m < M; ++m) {
        const float* DTMT_RESTRICT xr = x + m * ldx + k;
        for (int u = 0; u < U; ++u)
          for (int l = 0; l < L; ++l) acc[m][u][l] += xr[u * L + l] * wf[u * L + l];
      }
    }
    const float scale = row_scale(wr, K);
    for (int m = 0; m < M; ++m) {
      float lanes[L];
      for (int l = 0; l < L; ++l) {
        lanes[l] = acc[m][0][l];
        for (int u = 1; u < U; ++u) lanes[l] += acc[m][u][l];
      }
      float s = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
      for (int64_t k = KU; k < K; ++k) s += x[m * ldx + k] * static_cast<float>(wr[k]);
      out[m * ldo + n] = bias ? s * scale + bias[n] : s * scale;
    }
  }
}
#endif

}  // namespace

void small_rows(int M, const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                int64_t ldo, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return rows_block<1, unroll<1>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 2: return rows_block<2, unroll<2>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 3: return rows_block<3, unroll<3>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 4: return rows_block<4, unroll<4>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 5: return rows_block<5, unroll<5>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 6: return rows_block<6, unroll<6>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 7: return rows_block<7, unroll<7>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 8: return rows_block<8, unroll<8>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
  }
}

void small_rows_int8(int M, const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t ldw, const float* bias,
                     float* out, int64_t ldo, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return rows_block_int8<1, unroll<1>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 2: return rows_block_int8<2, unroll<2>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 3: return rows_block_int8<3, unroll<3>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 4: return rows_block_int8<4, unroll<4>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 5: return rows_block_int8<5, unroll<5>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 6: return rows_block_int8<6, unroll<6>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 7: return rows_block_int8<7, unroll<7>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
    case 8: return rows_block_int8<8, unroll<8>()>(x, ldx, w, K, ldw, bias, out, ldo, n0, n1);
  }
}

}  // namespace DTMT_ISA
}  // namespace dtmt
