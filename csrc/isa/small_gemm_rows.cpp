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
// small_rows_int8 is the same walk over int8 weight rows (small_gemm.h's int8 format) with int8 activations (each
// row of x quantized by the caller with its own scale): int32 sums of int8 products, exact and in any order the
// same, then multiplied by the two scales. AVX2: 32 products per instruction pair (vpmaddubsw + vpmaddwd);
// baseline: plain int32 loops.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

inline int32_t lane_sum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The int8 walk: chunks of 32 int8 weights against 32 int8 activations of each of the M rows, multiplied and
// summed exactly in int32. R weight rows at a time (R = 2 for M <= 4: each x chunk and its |x| serve both, and their
// sums are reduced together). The body is written once (DTMT_INT8_ROWS) for the two ways of the multiply-add
// (DOT_ADD(acc, xabs, wsigned): add to the int32 lanes of acc the products of |x| (unsigned bytes) and w carrying
// x's sign (vpsignb), four adjacent ones a lane; |x|, |w| <= 127):
//   AVX2: vpmaddubsw (pairs into int16: at most 2 * 127 * 127, no saturation) + vpmaddwd + vpaddd;
//   VNNI: vpdpbusd, the three in one (AVX512-VNNI's 256-bit form; chosen at run time, see small_rows_int8).
#define DTMT_INT8_ROWS(NAME, DOT_ADD, ATTR)                                                                       \
  template <int M, int R>                                                                                        \
  ATTR void NAME(const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K, int64_t ldw,        \
            const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {                                 \
    const int64_t K32 = K - K % 32;                                                                              \
    int64_t n = n0;                                                                                              \
    for (; n + R <= n1; n += R) {                                                                                \
      const int8_t* wr = w + n * ldw;                                                                            \
      __m256i acc[R][M];                                                                                         \
      for (int r = 0; r < R; ++r)                                                                                \
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_si256();                                          \
      for (int64_t k = 0; k < K32; k += 32) {                                                                    \
        __m256i wv[R];                                                                                           \
        for (int r = 0; r < R; ++r) {                                                                            \
          _mm_prefetch(reinterpret_cast<const char*>(wr + r * ldw + k + kPrefetchInt8), _MM_HINT_T0);            \
          wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + r * ldw + k));                        \
        }                                                                                                        \
        for (int m = 0; m < M; ++m) {                                                                            \
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * ldx + k));             \
          const __m256i xabs = _mm256_sign_epi8(xv, xv);                                                         \
          for (int r = 0; r < R; ++r) acc[r][m] = DOT_ADD(acc[r][m], xabs, _mm256_sign_epi8(wv[r], xv));         \
        }                                                                                                        \
      }                                                                                                          \
      for (int m = 0; m < M; ++m) {                                                                              \
        int32_t sums[R];                                                                                         \
        if (R == 2) { /* both rows' lanes in one reduction */                                                    \
          const __m256i h = _mm256_hadd_epi32(acc[0][m], acc[R - 1][m]);                                         \
          __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));                  \
          q = _mm_hadd_epi32(q, q);                                                                              \
          sums[0] = _mm_cvtsi128_si32(q);                                                                        \
          sums[R - 1] = _mm_extract_epi32(q, 1);                                                                 \
        } else {                                                                                                 \
          for (int r = 0; r < R; ++r) sums[r] = lane_sum_epi32(acc[r][m]);                                       \
        }                                                                                                        \
        for (int r = 0; r < R; ++r) {                                                                            \
          const int8_t* row = wr + r * ldw;                                                                      \
          int32_t s = sums[r];                                                                                   \
          for (int64_t k = K32; k < K; ++k) s += int32_t(xq[m * ldx + k]) * int32_t(row[k]);                     \
          const float v = static_cast<float>(s) * (x_scale[m] * row_scale(row, K));                              \
          out[m * ldo + n + r] = bias ? v + bias[n + r] : v;                                                     \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    if (R > 1 && n < n1) NAME<M, 1>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n, n1);                         \
  }

inline __m256i dot_add_avx2(__m256i acc, __m256i xabs, __m256i w_signed) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, w_signed), _mm256_set1_epi16(1)));
}
DTMT_INT8_ROWS(rows_block_int8, dot_add_avx2, )

#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__AVX512VNNI__)
// The avx512 copy (x86-64-v4, which has no VNNI) carries a VNNI loop too, for the CPUs that have it.
#define DTMT_INT8_VNNI 1
#define DTMT_VNNI_TARGET __attribute__((target("avx512vnni,avx512vl")))
DTMT_VNNI_TARGET inline __m256i dot_add_vnni(__m256i acc, __m256i xabs, __m256i w_signed) {
  return _mm256_dpbusd_epi32(acc, xabs, w_signed);
}
DTMT_INT8_ROWS(rows_block_int8_vnni, dot_add_vnni, DTMT_VNNI_TARGET)

// Whether this CPU has AVX512-VNNI (asked once).
inline bool int8_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}
#else
#define DTMT_INT8_VNNI 0
#endif

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
// The int8 walk in plain C++: int32 sums of int8 products (exact, as the vector copy's), per weight row (R unused).
template <int M, int R>
void rows_block_int8(const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K, int64_t ldw,
                     const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* DTMT_RESTRICT wr = w + n * ldw;
    __builtin_prefetch(wr + kPrefetchInt8);
    int32_t acc[M];
    for (int m = 0; m < M; ++m) {
      const int8_t* DTMT_RESTRICT xr = xq + m * ldx;
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int32_t(xr[k]) * int32_t(wr[k]);
      acc[m] = s;
    }
    const float scale = row_scale(wr, K);
    for (int m = 0; m < M; ++m) {
      const float v = static_cast<float>(acc[m]) * (x_scale[m] * scale);
      out[m * ldo + n] = bias ? v + bias[n] : v;
    }
  }
}
#endif

}  // namespace

// Rows of x as int8 with a scale each (small_gemm.h; quantize.py's quantize_activations): x_scale = max |x| / 127
// (1 for an all-zero row), xq = round_half_even(x / x_scale), a true division as the reference's. finite[m] = 0
// (row m not written) for a row holding NaN or an infinity. With AVX2 the first K - K % 8 values go 8 at a time
// (vcvtps2dq rounds to nearest even); the rest, or all of a row in the baseline copy, one at a time.
void quantize_activations_int8(int64_t M, const float* x, int64_t ldx, int64_t K, int8_t* xq, float* x_scale,
                               char* finite) {
#if DTMT_SMALL_ROWS_AVX2
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const int64_t K8 = K - K % 8;
#else
  const int64_t K8 = 0;
#endif
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float top = 0.0f;
    bool ok = true;
#if DTMT_SMALL_ROWS_AVX2
    __m256 peak = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xr + k), abs_mask);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));   // NaN or > FLT_MAX
      peak = _mm256_max_ps(peak, a);
    }
    __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
    p4 = _mm_max_ss(p4, _mm_movehdup_ps(p4));
    top = _mm_cvtss_f32(p4);
    ok = _mm256_movemask_ps(bad) == 0;
#endif
    for (int64_t k = K8; k < K; ++k) {
      const float a = std::fabs(xr[k]);
      ok = ok && a <= std::numeric_limits<float>::max();
      top = std::max(top, a);
    }
    finite[m] = ok;
    if (!ok) continue;
    const float scale = top > 0.0f ? top / 127.0f : 1.0f;
    x_scale[m] = scale;
    int8_t* qr = xq + m * K;
#if DTMT_SMALL_ROWS_AVX2
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t k = 0; k < K8; k += 8) {
      __m256i r = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k), sv));
      r = _mm256_min_epi32(_mm256_max_epi32(r, lo), hi);
      const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + k), _mm_packs_epi16(r16, r16));
    }
#endif
    for (int64_t k = K8; k < K; ++k)
      qr[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(xr[k] / scale))));
  }
}


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

void small_rows_int8(int M, const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K,
                     int64_t ldw, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
#define DTMT_INT8_CASES(NAME)                                                                                      \
  switch (M) {                                                                                                   \
    case 1: return NAME<1, 2>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 2: return NAME<2, 2>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 3: return NAME<3, 2>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 4: return NAME<4, 2>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 5: return NAME<5, 1>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 6: return NAME<6, 1>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 7: return NAME<7, 1>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 8: return NAME<8, 1>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
  }
#if DTMT_SMALL_ROWS_AVX2 && DTMT_INT8_VNNI
  if (int8_vnni()) DTMT_INT8_CASES(rows_block_int8_vnni)
  else DTMT_INT8_CASES(rows_block_int8)
#else
  DTMT_INT8_CASES(rows_block_int8)
#endif
#undef DTMT_INT8_CASES
}

}  // namespace DTMT_ISA
}  // namespace dtmt
