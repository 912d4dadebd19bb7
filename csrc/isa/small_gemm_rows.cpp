// The small-row linear kernel (see small_gemm.h for why, small_gemm_cpu.cpp for the threads) over a range of
// output columns. One copy per instruction set (kernels.h).
//
// out[m, n] = bias[n] + sum_k x[m, k] W[n, k]. The K loop over a weight row loads each chunk of it once and
// multiplies it into all M rows of x (vector accumulators, reduced across lanes once per row). So every weight
// byte is read once per call, in address order, and x (at most 8 x K floats) is re-read from L1. Each output
// element is summed in a fixed order, so results do not depend on how the columns are split among threads.
//
// With AVX2 + FMA (the avx2 and avx512 copies, or a native build on such a CPU) chunks of 8 floats in intrinsics;
// the avx512 copy takes 2 to 8 rows of x in chunks of 16 floats, several weight rows at a time (rows_block_wide);
// otherwise (the baseline copy) plain loops over chunks of 4 floats that the compiler turns into SSE2 (or another
// target's) vectors, without FMA: the same order of reads, other rounding.
//
// small_rows_int8 is the same walk over int8 weight rows (small_gemm.h's int8 format) with int8 activations (each
// row of x quantized by the caller with its own scale): int32 sums of int8 products, exact and in any order the
// same, then multiplied by the two scales. AVX512-VNNI: 64 products an instruction (vpdpbusd, unsigned by signed
// bytes); AVX-512 without VNNI: 64 per instruction pair (vpmaddubsw + vpmaddwd on 64-byte vectors); AVX2: 32 per
// pair; baseline: plain int32 loops.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "intrinsics.h"
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

// An int8 loop's output: float(s) * (x_scale * w_scale), rounded, then + bias: two roundings, as the reference
// (quantize.py's linear_int8), in every loop and every copy. The empty asm makes the product a value the compiler
// cannot see into, so that it is not fused with the addition into one FMA (which GCC would do in some of the
// loops' instances and not in others).
inline float int8_output(int32_t s, float x_scale, float w_scale, const float* bias, int64_t n) {
  float v = static_cast<float>(s) * (x_scale * w_scale);
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(v));
#else
  volatile float rounded = v;
  v = rounded;
#endif
  return bias ? v + bias[n] : v;
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
// sequential stream, by design: docs/design/cpu_kernels.md, "Streaming the weights"), U chunks of 8
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
    // every row's lane sum first, then the tail and the bias (as rows_wide_group: acc stays in registers)
    float sums[M];
    for (int m = 0; m < M; ++m) {
      __m256 a = acc[m][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[m][u]);
      sums[m] = lane_sum(a);
    }
    for (int m = 0; m < M; ++m) {
      float s = sums[m];
      for (int64_t k = KU; k < K; ++k) s += x[m * ldx + k] * wr[k];
      out[m * ldo + n] = bias ? s + bias[n] : s;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The AVX-512 copy's walk for 2 <= M <= 8 rows of x (docs/design/cpu_kernels.md, "The AVX-512 walk for 2-8 rows"):
// chunks of 16 floats, R weight rows at a time (R = 4 for M <= 4, 2 above: M x R accumulators within the 32 vector
// registers), each x chunk loaded once for the R rows. So an iteration issues M + R loads for M x R FMAs, where
// rows_block's issues M + U loads for M x U FMAs of half the width; about 1.7x the rate on weights in L2 at M = 4,
// 1.2x on weights streamed from L3.
//
// An output element is its accumulator's 16 lanes summed by the fixed tree of sum4x16, then the tail k >= K16 in
// order, then the bias: the same arithmetic in every position of a group of R and for a leftover weight row
// (reduced with zeros beside it), so that results do not depend on how the columns are split among threads.
constexpr int64_t kPrefetchWide = 1024;   // floats ahead on each of the R weight rows

// The four sums of a0..a3's lanes, by one tree that treats each input alike (no lane of one input meets another's):
// 16 -> 8 lanes (i + (i + 8)), then the pairwise adds of two hadds, then the two 128-bit halves.
inline __m128 sum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
  const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
  const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
  const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// Output columns [n, n + R) for M rows of x: R weight rows at a time (R = 1 for the leftover ones). kTail: K is
// not a multiple of 16. Inlined into its caller's loop, every accumulator in a register: compiled as a function
// of its own with the tail's loop among the lane sums, GCC kept acc in memory, zeroed, stored and reloaded around
// every group: a float32 step's products took 1.14x the time on a Skylake-SP (docs/design/cpu_kernels.md, "Sums
// kept in registers").
template <int M, int R, bool kTail>
__attribute__((always_inline)) inline void rows_wide_group(const float* x, int64_t ldx, const float* wr, int64_t K,
                                                           const float* bias, float* out, int64_t ldo, int64_t n) {
  const int64_t K16 = kTail ? K - K % 16 : K;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + r * K + k + kPrefetchWide), _MM_HINT_T0);
      wv[r] = _mm512_loadu_ps(wr + r * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  // every row's lane sums first, then the tail and the bias (a loop of unknown trips among the sums put acc in memory)
  const __m512 z = _mm512_setzero_ps();
  alignas(16) float sums[M][4];
  for (int m = 0; m < M; ++m) {
    if constexpr (R == 4) {
      _mm_store_ps(sums[m], sum4x16(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    } else if constexpr (R == 2) {
      _mm_store_ps(sums[m], sum4x16(acc[m][0], acc[m][1], z, z));
    } else {
      _mm_store_ps(sums[m], sum4x16(acc[m][0], z, z, z));
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = sums[m][r];
      if constexpr (kTail)
        for (int64_t k = K16; k < K; ++k) s += x[m * ldx + k] * wr[r * K + k];
      out[m * ldo + n + r] = bias ? s + bias[n + r] : s;
    }
  }
}

template <int M>
void rows_block_wide(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                     int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int R = M <= 4 ? 4 : 2;
  int64_t n = n0;
  if (K % 16 == 0) {
    for (; n + R <= n1; n += R) rows_wide_group<M, R, false>(x, ldx, w + n * K, K, bias, out, ldo, n);
  } else {
    for (; n + R <= n1; n += R) rows_wide_group<M, R, true>(x, ldx, w + n * K, K, bias, out, ldo, n);
  }
  for (; n < n1; ++n) rows_wide_group<M, 1, true>(x, ldx, w + n * K, K, bias, out, ldo, n);
}
#define DTMT_SMALL_ROWS_WIDE 1
#endif

inline int32_t lane_sum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The int8 walk: chunks of 32 int8 weights against 32 int8 activations of each of the M rows, multiplied and
// summed exactly in int32. R weight rows at a time (R = 2 for M <= 4: each x chunk serves both, and their sums are
// reduced together). The multiply-add (dot_add_avx2(acc, wabs, xsigned)) adds to the int32 lanes of acc the
// products of |w| (unsigned bytes) and x carrying w's sign (vpsignb), four adjacent ones a lane: vpmaddubsw (pairs
// into int16: at most 2 * 128 * 127, no saturation) + vpmaddwd + vpaddd. The sign goes onto x, which the
// quantizer keeps within +-127, not onto w: any int8 weight is then exact, -128 too (|-128| is 128 as an unsigned
// byte; -(-128) as a signed one wraps to -128, and a crafted weight row of them came out with the opposite sign
// when the sign went onto w, found by a hostile-input probe, 2026-12-02). The avx512 copy
// takes rows_block_int8_vnni below where the CPU has AVX512-VNNI, else rows_block_int8_bw (the same arithmetic on
// 64-byte vectors; chosen at run time, see small_rows_int8); this loop is the avx2 copy's.
inline __m256i dot_add_avx2(__m256i acc, __m256i wabs, __m256i x_signed) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x_signed), _mm256_set1_epi16(1)));
}

template <int M, int R>
void rows_block_int8(const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K, int64_t ldw,
                     const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t K32 = K - K % 32;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const int8_t* wr = w + n * ldw;
    __m256i acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K32; k += 32) {
      __m256i wv[R], wabs[R];
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + r * ldw + k + kPrefetchInt8), _MM_HINT_T0);
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + r * ldw + k));
        wabs[r] = _mm256_abs_epi8(wv[r]);
      }
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * ldx + k));
        for (int r = 0; r < R; ++r) acc[r][m] = dot_add_avx2(acc[r][m], wabs[r], _mm256_sign_epi8(xv, wv[r]));
      }
    }
    for (int m = 0; m < M; ++m) {
      int32_t sums[R];
      if (R == 2) {   // both rows' lanes in one reduction
        const __m256i h = _mm256_hadd_epi32(acc[0][m], acc[R - 1][m]);
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        q = _mm_hadd_epi32(q, q);
        sums[0] = _mm_cvtsi128_si32(q);
        sums[R - 1] = _mm_extract_epi32(q, 1);
      } else {
        for (int r = 0; r < R; ++r) sums[r] = lane_sum_epi32(acc[r][m]);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* row = wr + r * ldw;
        int32_t s = sums[r];
        for (int64_t k = K32; k < K; ++k) s += int32_t(xq[m * ldx + k]) * int32_t(row[k]);
        out[m * ldo + n + r] = int8_output(s, x_scale[m], row_scale(row, K), bias, n + r);
      }
    }
  }
  if (R > 1 && n < n1) rows_block_int8<M, 1>(xq, ldx, x_scale, w, K, ldw, bias, out, ldo, n, n1);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__GNUC__)
// The avx512 copy (x86-64-v4, which has no VNNI) carries a VNNI loop too, for the CPUs that have it (a native build
// on such a CPU has VNNI throughout), and a 64-byte loop for those that have not (rows_block_int8_bw).
// DTMT_INT8_VNNI: this copy has both (the others have neither).
#define DTMT_INT8_VNNI 1
#if defined(__AVX512VNNI__)
#define DTMT_VNNI_TARGET
#else
#define DTMT_VNNI_TARGET __attribute__((target("avx512vnni")))
#endif

// The walk of the 64-byte int8 loops (rows_block_int8_vnni, rows_block_int8_bw) over R weight rows from wr (ldw
// apart): CHUNK(k) on wv[R], the rows' bytes k..k+63, for every whole vector, then on the K % 64 tail as a masked
// load (zeros past the row; `tail` its mask, 0 for none). A macro, as the loops' chunks: a lambda would not inherit
// the VNNI loop's target attribute.
#define DTMT_INT8_WALK64(CHUNK)                                                                                  \
  for (int64_t k = 0; k < K64; k += 64) {                                                                        \
    __m512i wv[R];                                                                                               \
    for (int r = 0; r < R; ++r) {                                                                                \
      _mm_prefetch(reinterpret_cast<const char*>(wr + r * ldw + k + kPrefetchInt8), _MM_HINT_T0);               \
      wv[r] = _mm512_loadu_si512(wr + r * ldw + k);                                                              \
    }                                                                                                            \
    CHUNK(k)                                                                                                     \
  }                                                                                                              \
  if (tail) {                                                                                                    \
    __m512i wv[R];                                                                                               \
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi8(tail, wr + r * ldw + K64);                      \
    CHUNK(K64)                                                                                                   \
  }

inline __m256i fold_halves(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// Four int32 vectors to their four lane sums [sum a, sum b, sum c, sum d] (wrapping adds).
inline __m128i lane_sums4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m256i ab = _mm256_hadd_epi32(fold_halves(a), fold_halves(b));   // per 128-bit lane: a01 a23 b01 b23
  const __m256i cd = _mm256_hadd_epi32(fold_halves(c), fold_halves(d));
  const __m256i abcd = _mm256_hadd_epi32(ab, cd);           // per 128-bit lane: a b c d
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// The int8 walk with AVX512-VNNI on 64-byte vectors: vpdpbusd multiplies unsigned bytes by signed ones, so each row
// of x goes in as xq + 128 (xu: padded_rows' buffer, rows of KP = K rounded up to whole vectors) and
// 128 * sum_k w[n, k] (the same vpdpbusd against bytes of 1) is taken off each sum: the int32 sums equal the
// signed products' exactly (modulo 2^32 on the way, exact at the end, since the true sum fits in int32), so the
// outputs are those of the other loops to the bit. R weight rows at a time (4 for M <= 4, else 2: within the 32
// vector registers); the K % 64 tail of a weight row is a masked load (zeros past the row).
template <int M, int R>
DTMT_VNNI_TARGET void rows_block_int8_vnni(const uint8_t* xu, int64_t KP, const float* x_scale, const int8_t* w,
                                           int64_t K, int64_t ldw, const float* bias, float* out, int64_t ldo,
                                           int64_t n0, int64_t n1) {
  const int64_t K64 = K - K % 64;
  const __mmask64 tail = K % 64 ? (~__mmask64{0}) >> (64 - K % 64) : 0;
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i zero = _mm512_setzero_si512();
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const int8_t* wr = w + n * ldw;
    __m512i acc[R][M], wsum[R];
    for (int r = 0; r < R; ++r) {
      wsum[r] = zero;
      for (int m = 0; m < M; ++m) acc[r][m] = zero;
    }
// (a macro, not a lambda: a lambda would not inherit the function's target attribute)
#define DTMT_VNNI_CHUNK(k)                                                                                        \
  for (int r = 0; r < R; ++r) wsum[r] = _mm512_dpbusd_epi32(wsum[r], ones, wv[r]);                              \
  for (int m = 0; m < M; ++m) {                                                                                  \
    const __m512i xv = _mm512_loadu_si512(xu + m * KP + (k));                                                    \
    for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv, wv[r]);                           \
  }
    DTMT_INT8_WALK64(DTMT_VNNI_CHUNK)
#undef DTMT_VNNI_CHUNK
    // the R rows' sums (missing rows as zero vectors), less 128 * sum_k w[n, k]
    __m512i v4[4] = {zero, zero, zero, zero};
    for (int r = 0; r < R; ++r) v4[r] = wsum[r];
    const __m128i offsets = _mm_slli_epi32(lane_sums4(v4[0], v4[1], v4[2], v4[3]), 7);
    alignas(16) float w_scale[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < R; ++r) w_scale[r] = row_scale(wr + r * ldw, K);
    const __m128 w_scales = _mm_load_ps(w_scale);
    __m128i row_sums[M];   // every sum first, then the outputs (as rows_block_int8_bw)
    for (int m = 0; m < M; ++m) {
      for (int r = 0; r < R; ++r) v4[r] = acc[r][m];
      row_sums[m] = _mm_sub_epi32(lane_sums4(v4[0], v4[1], v4[2], v4[3]), offsets);
    }
    for (int m = 0; m < M; ++m) {
      const __m128i sums = row_sums[m];
      if (R == 4) {   // int8_output's arithmetic on four lanes (the barrier likewise keeps the product rounded)
        __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(_mm_set1_ps(x_scale[m]), w_scales));
        asm("" : "+x"(v));
        if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + n));
        _mm_storeu_ps(out + m * ldo + n, v);
      } else {
        alignas(16) int32_t s[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(s), sums);
        for (int r = 0; r < R; ++r) out[m * ldo + n + r] = int8_output(s[r], x_scale[m], w_scale[r], bias, n + r);
      }
    }
  }
  if (R > 1 && n < n1) rows_block_int8_vnni<M, 1>(xu, KP, x_scale, w, K, ldw, bias, out, ldo, n, n1);
}

// The int8 walk on 64-byte vectors without VNNI (AVX512BW: Skylake-SP and the like): rows_block_int8's arithmetic,
// |w| (unsigned bytes) times x carrying w's sign (AVX-512 has no vpsignb: x negated under w's sign mask) with
// vpmaddubsw + vpmaddwd + vpaddd, twice the bytes an instruction; the same exact int32 sums, so the same outputs to
// the bit, for any int8 weight (rows_block_int8: why the sign goes onto x). The rows of x come from padded_rows'
// buffer (rows of KP = K rounded up to whole vectors, zeros past K), made once a call instead of once a block of
// weight rows; a weight row's K % 64 tail is a masked load.
template <int M, int R>
void rows_block_int8_bw(const int8_t* xs, int64_t KP, const float* x_scale, const int8_t* w, int64_t K,
                        int64_t ldw, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t K64 = K - K % 64;
  const __mmask64 tail = K % 64 ? (~__mmask64{0}) >> (64 - K % 64) : 0;
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const int8_t* wr = w + n * ldw;
    __m512i acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = zero;
#define DTMT_BW_CHUNK(k)                                                                                          \
  __m512i wabs[R];                                                                                               \
  __mmask64 wneg[R];                                                                                             \
  for (int r = 0; r < R; ++r) {                                                                                  \
    wabs[r] = _mm512_abs_epi8(wv[r]);                                                                            \
    wneg[r] = _mm512_movepi8_mask(wv[r]);                                                                        \
  }                                                                                                              \
  for (int m = 0; m < M; ++m) {                                                                                  \
    const __m512i xv = _mm512_loadu_si512(xs + m * KP + (k));                                                    \
    for (int r = 0; r < R; ++r)                                                                                  \
      acc[r][m] = _mm512_add_epi32(                                                                              \
          acc[r][m], _mm512_madd_epi16(_mm512_maddubs_epi16(wabs[r], _mm512_mask_sub_epi8(xv, wneg[r], zero, xv)), \
                                       ones));                                                                   \
  }
    DTMT_INT8_WALK64(DTMT_BW_CHUNK)
#undef DTMT_BW_CHUNK
    // every sum first, then the outputs (their loop among the sums put acc in memory: rows_wide_group's note)
    int32_t sums[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) sums[m][r] = _mm512_reduce_add_epi32(acc[r][m]);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        out[m * ldo + n + r] = int8_output(sums[m][r], x_scale[m], row_scale(wr + r * ldw, K), bias, n + r);
  }
  if (R > 1 && n < n1) rows_block_int8_bw<M, 1>(xs, KP, x_scale, w, K, ldw, bias, out, ldo, n, n1);
}

// The M rows of xq as the 64-byte int8 loops read them, each padded with zeros to KP = K rounded up to whole
// vectors, its bytes xor `flip`: 0x80 for rows_block_int8_vnni (xq + 128 read unsigned), 0 for rows_block_int8_bw
// (xq as it is). A buffer of this thread's, kept between calls; made once a call, not once a block of weight rows.
inline const uint8_t* padded_rows(int M, const int8_t* xq, int64_t ldx, int64_t K, int64_t KP, uint8_t flip) {
  thread_local std::vector<uint8_t> buf;
  buf.assign(static_cast<size_t>(M * KP), 0);
  uint8_t* dst = buf.data();   // (once: each use of a thread_local in the loop would look its address up again)
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) dst[m * KP + k] = static_cast<uint8_t>(xq[m * ldx + k]) ^ flip;
  return dst;
}

// Whether to take the VNNI loops (asked once): the CPU has AVX512-VNNI and DTMT_INT8_VNNI=0 is not set (with it the
// loop without VNNI runs, so that its tests and benchmarks reach it on a VNNI CPU too).
inline bool int8_vnni() {
  static const bool has = [] {
    const char* env = std::getenv("DTMT_INT8_VNNI");
    return __builtin_cpu_supports("avx512vnni") && !(env && std::strcmp(env, "0") == 0);
  }();
  return has;
}

// The int8 product for many rows of x (int8_panel below): x packed as tiles of kPanelRows rows, each tile K / 4
// (rounded up) groups of 64 bytes, group q holding rows 0..15's bytes 4q..4q+3 (xq + 128 read unsigned, as
// rows_block_int8_vnni's; zeros past K and past the last row). One vpdpbusd multiplies a group by 4 bytes of one
// weight row broadcast to all 16 lanes: the 16 lanes are 16 rows of x, so no sum across lanes is left at the end,
// and each broadcast serves MT tiles. The accumulators of MT tiles x NB weight rows stay in registers for the
// whole of K (2 x 12 + 3 of the 32). The int32 sums are those of the other loops exactly (the same correction,
// 128 * sum_k w[n, k]), and the output arithmetic is int8_output's, lane by lane.
constexpr int kPanelRows = kInt8PanelRows;

template <int MT, int NB>
DTMT_VNNI_TARGET void panel_block(const uint8_t* xp, int64_t tile_bytes, int64_t KQ, const int8_t* w, int64_t ldw,
                                  const int32_t* offset, const float* w_scale, const float* x_scale, int rows,
                                  const float* bias, float* out, int64_t ldo) {
  // (every loop over t and j unrolled, so that the accumulators are registers, not an array in memory)
  __m512i acc[MT][NB];
#pragma GCC unroll 32
  for (int t = 0; t < MT; ++t)
#pragma GCC unroll 32
    for (int j = 0; j < NB; ++j) acc[t][j] = _mm512_setzero_si512();
  for (int64_t q = 0; q < KQ; ++q) {
    __m512i xv[MT];
#pragma GCC unroll 32
    for (int t = 0; t < MT; ++t) xv[t] = _mm512_loadu_si512(xp + t * tile_bytes + q * 64);
#pragma GCC unroll 32
    for (int j = 0; j < NB; ++j) {
      int32_t four;
      std::memcpy(&four, w + j * ldw + 4 * q, sizeof four);   // bytes past K are the row's scale, times x's zeros
      const __m512i wb = _mm512_set1_epi32(four);
#pragma GCC unroll 32
      for (int t = 0; t < MT; ++t) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xv[t], wb);
    }
  }
  alignas(64) int32_t sums[MT][NB][kPanelRows];
#pragma GCC unroll 32
  for (int t = 0; t < MT; ++t)
#pragma GCC unroll 32
    for (int j = 0; j < NB; ++j) _mm512_store_si512(sums[t][j], acc[t][j]);
  // out row by row: row i's NB sums gathered from the columns (scattering the columns instead would store 16 rows
  // ldo apart, which at ldo = 1024 all fall in one set of the L1 cache)
  const __mmask16 cols = static_cast<__mmask16>((1u << NB) - 1u);
  const __m512i across = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kPanelRows));
  const __m512i offsets = _mm512_maskz_loadu_epi32(cols, offset);
  const __m512 w_scales = _mm512_maskz_loadu_ps(cols, w_scale);
  const __m512 biases = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
  for (int t = 0; t < MT; ++t) {
    const int valid = std::min(kPanelRows, rows - t * kPanelRows);
    for (int i = 0; i < valid; ++i) {
      const __m512i s = _mm512_sub_epi32(
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), cols, across, &sums[t][0][i], 4), offsets);
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                               _mm512_mul_ps(_mm512_set1_ps(x_scale[t * kPanelRows + i]), w_scales));
      asm("" : "+v"(v));   // int8_output's two roundings: no FMA with the bias
      if (bias) v = _mm512_add_ps(v, biases);
      _mm512_mask_storeu_ps(out + (t * kPanelRows + i) * ldo, cols, v);
    }
  }
}

// NB weight rows (from w, the first of them) against every tile of the panel.
template <int NB>
void panel_columns(const uint8_t* panel, int64_t M, int64_t K, const float* x_scale, const int8_t* w, int64_t ldw,
                   const float* bias, float* out, int64_t ldo) {
  const int64_t KQ = (K + 3) / 4, tile = KQ * 64, tiles = (M + kPanelRows - 1) / kPanelRows;
  int32_t offset[NB];
  float w_scale[NB];
  for (int j = 0; j < NB; ++j) {
    const int8_t* row = w + j * ldw;
    int32_t s = 0;
    for (int64_t k = 0; k < K; ++k) s += row[k];
    offset[j] = static_cast<int32_t>(static_cast<uint32_t>(s) << 7);   // 128 * s, wrapping as the sums do
    w_scale[j] = row_scale(row, K);
  }
  int64_t t = 0;
  for (; t + 2 <= tiles; t += 2)
    panel_block<2, NB>(panel + t * tile, tile, KQ, w, ldw, offset, w_scale, x_scale + t * kPanelRows,
                       static_cast<int>(std::min<int64_t>(M - t * kPanelRows, 2 * kPanelRows)), bias,
                       out + t * kPanelRows * ldo, ldo);
  if (t < tiles)
    panel_block<1, NB>(panel + t * tile, tile, KQ, w, ldw, offset, w_scale, x_scale + t * kPanelRows,
                       static_cast<int>(M - t * kPanelRows), bias, out + t * kPanelRows * ldo, ldo);
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
      out[m * ldo + n] = int8_output(acc[m], x_scale[m], scale, bias, n);
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
// one row: rows_block's single stream reads weights in L2 faster (docs/design/cpu_kernels.md, "The AVX-512 walk
// for 2-8 rows")
#if defined(DTMT_SMALL_ROWS_WIDE)
    case 2: return rows_block_wide<2>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 3: return rows_block_wide<3>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 4: return rows_block_wide<4>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 5: return rows_block_wide<5>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 6: return rows_block_wide<6>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 7: return rows_block_wide<7>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 8: return rows_block_wide<8>(x, ldx, w, K, bias, out, ldo, n0, n1);
#else
    case 2: return rows_block<2, unroll<2>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 3: return rows_block<3, unroll<3>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 4: return rows_block<4, unroll<4>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 5: return rows_block<5, unroll<5>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 6: return rows_block<6, unroll<6>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 7: return rows_block<7, unroll<7>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
    case 8: return rows_block<8, unroll<8>()>(x, ldx, w, K, bias, out, ldo, n0, n1);
#endif
  }
}

// One row of x times weight panels [p0, p1) (cpu_kernels.h; the layout: small_gemm.h). A panel is K rows of
// kPanelWidth floats, one row per k, read in address order; x[k] is broadcast and multiplied into one accumulator
// per output column, so an output is one multiply-add chain over k in order, with no sum across vector lanes and one
// load a multiply-add (a row-major walk over one row of x loads x as often as the weights and reduces each output
// across lanes: docs/design/cpu_kernels.md, "Row panels"). AVX-512: 8 accumulators of 16 columns; AVX2: a panel in
// two halves of 64 columns, 8 accumulators each (16 registers); baseline: plain loops (multiply then add, no FMA).
void row_panels(const float* x, const float* panels, int64_t K, const float* bias, float* out, int64_t N,
                int64_t p0, int64_t p1) {
  constexpr int64_t P = kPanelWidth;
  for (int64_t p = p0; p < p1; ++p) {
    const float* w = panels + p * K * P;
    const int64_t n0 = p * P, width = std::min(P, N - n0);
    alignas(64) float sums[P];
#if defined(__AVX512F__)
    constexpr int V = static_cast<int>(P / 16);
    __m512 acc[V];
    for (int j = 0; j < V; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const float* r = w + k * P;
      _mm_prefetch(reinterpret_cast<const char*>(r + 4 * P), _MM_HINT_T0);
      const __m512 xb = _mm512_set1_ps(x[k]);
      for (int j = 0; j < V; ++j) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(r + 16 * j), xb, acc[j]);
    }
    for (int j = 0; j < V; ++j) _mm512_store_ps(sums + 16 * j, acc[j]);
#elif DTMT_SMALL_ROWS_AVX2
    constexpr int64_t Hf = P / 2;
    constexpr int V = static_cast<int>(Hf / 8);
    for (int64_t half = 0; half < P; half += Hf) {
      __m256 acc[V];
      for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const float* r = w + k * P + half;
        _mm_prefetch(reinterpret_cast<const char*>(r + 4 * P), _MM_HINT_T0);
        const __m256 xb = _mm256_set1_ps(x[k]);
        for (int j = 0; j < V; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(r + 8 * j), xb, acc[j]);
      }
      for (int j = 0; j < V; ++j) _mm256_store_ps(sums + half + 8 * j, acc[j]);
    }
#else
    for (int64_t j = 0; j < P; ++j) sums[j] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float* DTMT_RESTRICT r = w + k * P;
      const float xk = x[k];
      for (int64_t j = 0; j < P; ++j) sums[j] += xk * r[j];
    }
#endif
    for (int64_t j = 0; j < width; ++j) out[n0 + j] = bias ? sums[j] + bias[n0 + j] : sums[j];
  }
}

void small_rows_int8(int M, const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K,
                     int64_t ldw, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
// NAME<M, R> for M = 1..8 on the arguments X, LDX (the rows of x), R = R4 weight rows at a time for M <= 4, else R8
#define DTMT_INT8_CASES(NAME, X, LDX, R4, R8)                                                                      \
  switch (M) {                                                                                                   \
    case 1: return NAME<1, R4>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 2: return NAME<2, R4>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 3: return NAME<3, R4>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 4: return NAME<4, R4>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 5: return NAME<5, R8>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 6: return NAME<6, R8>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 7: return NAME<7, R8>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
    case 8: return NAME<8, R8>(X, LDX, x_scale, w, K, ldw, bias, out, ldo, n0, n1);                              \
  }
#if DTMT_SMALL_ROWS_AVX2 && DTMT_INT8_VNNI
  {
    const int64_t KP = (K + 63) / 64 * 64;
    if (int8_vnni()) {
      const uint8_t* xu = padded_rows(M, xq, ldx, K, KP, 0x80u);
      DTMT_INT8_CASES(rows_block_int8_vnni, xu, KP, 4, 2)
    }
    // AVX512BW without VNNI
    const int8_t* xs = reinterpret_cast<const int8_t*>(padded_rows(M, xq, ldx, K, KP, 0));
    DTMT_INT8_CASES(rows_block_int8_bw, xs, KP, 4, 2)
  }
  DTMT_INT8_CASES(rows_block_int8, xq, ldx, 2, 1)   // (not reached: M is 1-8)
#else
  DTMT_INT8_CASES(rows_block_int8, xq, ldx, 2, 1)
#endif
#undef DTMT_INT8_CASES
}

#ifndef DTMT_INT8_VNNI
#define DTMT_INT8_VNNI 0
#endif

int64_t int8_panel_rows() {
#if DTMT_SMALL_ROWS_AVX2 && DTMT_INT8_VNNI
  return int8_vnni() ? 8 : 0;   // from 8 rows on it beats small_rows_int8 (bench_int8_kernel.py)
#else
  return 0;
#endif
}

void pack_int8_panel(int64_t M, const int8_t* xq, const char* finite, int64_t K, uint8_t* panel, int64_t t0,
                     int64_t t1) {
#if DTMT_SMALL_ROWS_AVX2 && DTMT_INT8_VNNI
  const int64_t KQ = (K + 3) / 4, tile = KQ * 64, K4 = K - K % 4;
  for (int64_t t = t0; t < t1; ++t) {
    uint8_t* dst = panel + t * tile;
    std::memset(dst, 0, static_cast<size_t>(tile));
    for (int i = 0; i < kPanelRows; ++i) {
      const int64_t m = t * kPanelRows + i;
      if (m >= M || !finite[m]) continue;   // zeros (a row with NaN or an infinity gets NaN later)
      const int8_t* row = xq + m * K;
      uint8_t* d = dst + 4 * i;
      for (int64_t k = 0; k < K4; k += 4) {
        uint32_t four;
        std::memcpy(&four, row + k, sizeof four);
        four ^= 0x80808080u;
        std::memcpy(d + k * 16, &four, sizeof four);
      }
      for (int64_t k = K4; k < K; ++k) d[K4 * 16 + k - K4] = static_cast<uint8_t>(row[k]) ^ 0x80u;
    }
  }
#else
  (void)M, (void)xq, (void)finite, (void)K, (void)panel, (void)t0, (void)t1;
#endif
}

void int8_panel(const uint8_t* panel, int64_t M, int64_t K, const float* x_scale, const int8_t* w, int64_t ldw,
                const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
#if DTMT_SMALL_ROWS_AVX2 && DTMT_INT8_VNNI
  int64_t n = n0;
  for (; n + kInt8PanelColumns <= n1; n += kInt8PanelColumns)
    panel_columns<kInt8PanelColumns>(panel, M, K, x_scale, w + n * ldw, ldw, bias ? bias + n : nullptr, out + n,
                                     ldo);
  for (; n + 4 <= n1; n += 4)
    panel_columns<4>(panel, M, K, x_scale, w + n * ldw, ldw, bias ? bias + n : nullptr, out + n, ldo);
  for (; n < n1; ++n)
    panel_columns<1>(panel, M, K, x_scale, w + n * ldw, ldw, bias ? bias + n : nullptr, out + n, ldo);
#else
  (void)panel, (void)M, (void)K, (void)x_scale, (void)w, (void)ldw, (void)bias, (void)out, (void)ldo, (void)n0,
      (void)n1;
#endif
}

}  // namespace DTMT_ISA
}  // namespace dtmt
