// The loops of the additive-attention kernels (scores and context; the algorithm is described in
// attention_cpu.cpp) over a range of batch entries. One copy per instruction set (kernels.h).
#include "kernels.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include "intrinsics.h"
#endif

namespace dtmt {
namespace DTMT_ISA {

template <typename T>
void scores_forward(const T* keys, const T* q, const T* v, T* out, int64_t S, int64_t NH, int64_t D, int64_t group,
                    int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t kb = b / group;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t h = 0; h < NH; ++h) {
        const T* DTMT_RESTRICT k = keys + ((kb * S + s) * NH + h) * D;
        const T* DTMT_RESTRICT qq = q + (b * NH + h) * D;
        const T* DTMT_RESTRICT vv = v + h * D;
        T acc = 0;
        DTMT_SIMD_SUM(acc)
        for (int64_t d = 0; d < D; ++d) acc += vv[d] * dt_tanh(k[d] + qq[d]);
        out[(b * NH + h) * S + s] = acc;
      }
    }
  }
}

// scores_forward from exponentials (engine/decode_step.h, key_exps_cpu): tanh(k + q) = 1 - 2 / (exp(2k) exp(2q) + 1), so
//   scores[b, h, s] = sum_d v[h, d] - 2 sum_d v[h, d] / (ek[kb, h, d, s] * eq[b, h, d] + 1)        kb = b / group
// with ek = exp(2 keys) laid out [., NH, D, Sp] (positions last, Sp a multiple of 16 >= S) and eq = exp(2 q) formed
// here from q [B, NH, D]: no exp per position and feature, and the positions run along the vector lanes (no
// horizontal sums).
// Each score is summed over d in order, up to kScoreLanes positions at a time; the AVX-512 copy forms 1 / x from the
// 14-bit reciprocal and one Newton step (relative error ~2^-28) instead of dividing.
constexpr int64_t kScoreLanes = 64;

// acc[j] = sum_d v[d] / (e[d * Sp + j] * q[d] + 1) for j < n (n a multiple of 16, at most kScoreLanes)
template <typename T>
void exp_score_sums(const T* e, int64_t Sp, const T* q, const T* v, int64_t D, int64_t n, T* acc) {
  for (int64_t j = 0; j < n; ++j) acc[j] = T(0);
  for (int64_t d = 0; d < D; ++d) {
    const T* DTMT_RESTRICT ed = e + d * Sp;
    const T qd = q[d], vd = v[d];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) acc[j] += vd / (ed[j] * qd + T(1));
  }
}

#if defined(__AVX512F__)
template <int NV>
void exp_score_sums_avx512(const float* e, int64_t Sp, const float* q, const float* v, int64_t D, float* acc) {
  __m512 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t d = 0; d < D; ++d) {
    const float* ed = e + d * Sp;
    const __m512 qd = _mm512_set1_ps(q[d]), vd = _mm512_set1_ps(v[d]);
    for (int i = 0; i < NV; ++i) {
      const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(ed + 16 * i), qd, one);
      __m512 r = _mm512_rcp14_ps(x);
      r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(x, r, one), r);   // one Newton step
      a[i] = _mm512_fmadd_ps(vd, r, a[i]);
    }
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

template <>
void exp_score_sums<float>(const float* e, int64_t Sp, const float* q, const float* v, int64_t D, int64_t n,
                           float* acc) {
  switch (n / 16) {
    case 1: return exp_score_sums_avx512<1>(e, Sp, q, v, D, acc);
    case 2: return exp_score_sums_avx512<2>(e, Sp, q, v, D, acc);
    case 3: return exp_score_sums_avx512<3>(e, Sp, q, v, D, acc);
    default: return exp_score_sums_avx512<4>(e, Sp, q, v, D, acc);
  }
}
#endif

template <typename T>
void scores_from_exps(const T* ek, const T* q, const T* v, T* out, int64_t S, int64_t Sp, int64_t NH, int64_t D,
                      int64_t group, int64_t b0, int64_t b1) {
  static_assert(kScoreLanes % 16 == 0, "position blocks of whole 16-lane vectors");
  std::vector<T> eq(static_cast<size_t>(D));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t kb = b / group;
    for (int64_t h = 0; h < NH; ++h) {
      const T* vh = v + h * D;
      const T* qh = q + (b * NH + h) * D;
      T vsum = 0;
      for (int64_t d = 0; d < D; ++d) vsum += vh[d];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) eq[d] = dt_exp(T(2) * qh[d]);
      T* o = out + (b * NH + h) * S;
      for (int64_t s0 = 0; s0 < S; s0 += kScoreLanes) {
        T acc[kScoreLanes];
        exp_score_sums<T>(ek + (kb * NH + h) * D * Sp + s0, Sp, eq.data(), vh, D,
                          std::min<int64_t>(kScoreLanes, Sp - s0), acc);
        const int64_t m = std::min<int64_t>(kScoreLanes, S - s0);
        for (int64_t j = 0; j < m; ++j) o[s0 + j] = vsum - T(2) * acc[j];
      }
    }
  }
}

template <typename T>
void scores_backward(const T* grad, const T* keys, const T* q, const T* v, T* dkeys, T* dq, T* dv_rows, int64_t S,
                     int64_t NH, int64_t D, int64_t b0, int64_t b1) {
  const int64_t A = NH * D;
  for (int64_t b = b0; b < b1; ++b) {
    T* DTMT_RESTRICT dqb = dq + b * A;
    T* DTMT_RESTRICT dvb = dv_rows + b * A;
    for (int64_t i = 0; i < A; ++i) dqb[i] = dvb[i] = T(0);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t h = 0; h < NH; ++h) {
        const T g = grad[(b * NH + h) * S + s];
        const int64_t row = ((b * S + s) * NH + h) * D;
        const T* DTMT_RESTRICT k = keys + row;
        const T* DTMT_RESTRICT qq = q + (b * NH + h) * D;
        const T* DTMT_RESTRICT vv = v + h * D;
        T* DTMT_RESTRICT dk = dkeys + row;
        T* DTMT_RESTRICT dqh = dqb + h * D;
        T* DTMT_RESTRICT dvh = dvb + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const T t = dt_tanh(k[d] + qq[d]);
          const T dpre = g * vv[d] * (T(1) - t * t);
          dk[d] = dpre;
          dqh[d] += dpre;
          dvh[d] += g * t;
        }
      }
    }
  }
}

// The rows of SourceProducts (engine/decode_step.h) weighed by the attention weights, columns [n0, n1):
//   out[r, n - n0] = bias[n] + sum_{k < W} alpha[r, k] * P[block[r] * W + k, n]        rows r in [0, M)
// alpha [M, W] contiguous, P rows ldp apart, out rows ldo apart. Each row reads only its sentence's W rows of P.
// Rows of one sentence go MR at a time through a chunk of columns (kWeighColumns; 96 in the AVX-512 copy, whose 32
// registers hold 4 x 6 vectors of sums: fewer, longer reads of each row of P), summed in k order, so that a row of P
// is loaded once for all of them (their sums in registers); a column's sum is alpha's products added in k order from
// 0, then the bias, in every chunk and copy alike, so it does not depend on its neighbours or the split of columns.
constexpr int64_t kWeighColumns = 32;

#if defined(__AVX512F__)
// Columns [n, n + 96 * blocks): sums in registers, 6 vectors of 16 for each of the MR rows.
template <int MR>
int64_t weigh_rows_avx512(const float* alpha, int64_t W, const float* p, int64_t ldp, const float* bias,
                          float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int NV = 6;
  int64_t n = n0;
  for (; n + 16 * NV <= n1; n += 16 * NV) {
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < W; ++k) {
      const float* pk = p + k * ldp + n;
      __m512 pv[NV];
      for (int v = 0; v < NV; ++v) pv[v] = _mm512_loadu_ps(pk + 16 * v);
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r * W + k]);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, pv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v)
        _mm512_storeu_ps(out + r * ldo + (n - n0) + 16 * v,
                         _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + n + 16 * v)));
  }
  return n;
}
#endif

template <typename T, int MR>
void weigh_rows(const T* alpha, int64_t W, const T* p, int64_t ldp, const T* bias, T* out, int64_t ldo, int64_t n0,
                int64_t n1) {
  int64_t n = n0;
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value) n = weigh_rows_avx512<MR>(alpha, W, p, ldp, bias, out, ldo, n0, n1);
#endif
  for (; n + kWeighColumns <= n1; n += kWeighColumns) {
    T acc[MR][kWeighColumns];
    for (int r = 0; r < MR; ++r)
      for (int64_t j = 0; j < kWeighColumns; ++j) acc[r][j] = T(0);
    for (int64_t k = 0; k < W; ++k) {
      const T* DTMT_RESTRICT pk = p + k * ldp + n;
      for (int r = 0; r < MR; ++r) {
        const T ak = alpha[r * W + k];
#pragma omp simd
        for (int64_t j = 0; j < kWeighColumns; ++j) acc[r][j] += ak * pk[j];
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int64_t j = 0; j < kWeighColumns; ++j) out[r * ldo + (n - n0) + j] = acc[r][j] + bias[n + j];
  }
  for (; n < n1; ++n)   // the last columns one at a time, in the same order
    for (int r = 0; r < MR; ++r) {
      T acc = 0;
      for (int64_t k = 0; k < W; ++k) acc += alpha[r * W + k] * p[k * ldp + n];
      out[r * ldo + (n - n0)] = acc + bias[n];
    }
}

template <typename T>
void weigh_products(const T* alpha, int64_t M, int64_t W, const int64_t* block, const T* P, int64_t ldp,
                    const T* bias, T* out, int64_t ldo, int64_t n0, int64_t n1) {
  int64_t r = 0;
  while (r < M) {
    int64_t same = 1;   // rows from r on of the same sentence, up to 4
    while (same < 4 && r + same < M && block[r + same] == block[r]) ++same;
    const T* a = alpha + r * W;
    const T* p = P + block[r] * W * ldp;
    T* o = out + r * ldo;
    if (same == 4) weigh_rows<T, 4>(a, W, p, ldp, bias, o, ldo, n0, n1);
    else if (same == 3) weigh_rows<T, 3>(a, W, p, ldp, bias, o, ldo, n0, n1);
    else if (same == 2) weigh_rows<T, 2>(a, W, p, ldp, bias, o, ldo, n0, n1);
    else weigh_rows<T, 1>(a, W, p, ldp, bias, o, ldo, n0, n1);
    r += same;
  }
}

template <typename T>
void context_forward(const T* alpha, const T* values, T* out, int64_t S, int64_t NH, int64_t Dc, int64_t vsb,
                     int64_t vss, int64_t group, int64_t b0, int64_t b1) {
  const int64_t C = NH * Dc;
  for (int64_t b = b0; b < b1; ++b) {
    T* DTMT_RESTRICT o = out + b * C;
    for (int64_t i = 0; i < C; ++i) o[i] = T(0);
    for (int64_t s = 0; s < S; ++s) {
      const T* DTMT_RESTRICT row = values + (b / group) * vsb + s * vss;
      for (int64_t h = 0; h < NH; ++h) {
        const T a = alpha[(b * NH + h) * S + s];
        T* DTMT_RESTRICT oh = o + h * Dc;
        const T* DTMT_RESTRICT vh = row + h * Dc;
#pragma omp simd
        for (int64_t d = 0; d < Dc; ++d) oh[d] += a * vh[d];
      }
    }
  }
}

template <typename T>
void context_backward(const T* grad, const T* alpha, const T* values, T* dalpha, T* dvalues, int64_t S, int64_t NH,
                      int64_t Dc, int64_t vsb, int64_t vss, int64_t dsb, int64_t dss, int64_t b0, int64_t b1) {
  const int64_t C = NH * Dc;
  if (dvalues == nullptr) {  // only the weights' gradient (the values' is formed elsewhere, e.g. once per sequence)
    for (int64_t b = b0; b < b1; ++b) {
      const T* DTMT_RESTRICT g = grad + b * C;
      for (int64_t s = 0; s < S; ++s) {
        const T* DTMT_RESTRICT row = values + b * vsb + s * vss;
        for (int64_t h = 0; h < NH; ++h) {
          const T* DTMT_RESTRICT gh = g + h * Dc;
          const T* DTMT_RESTRICT vh = row + h * Dc;
          T acc = 0;
          DTMT_SIMD_SUM(acc)
          for (int64_t d = 0; d < Dc; ++d) acc += vh[d] * gh[d];
          dalpha[(b * NH + h) * S + s] = acc;
        }
      }
    }
    return;
  }
  for (int64_t b = b0; b < b1; ++b) {
    const T* DTMT_RESTRICT g = grad + b * C;
    for (int64_t s = 0; s < S; ++s) {
      const T* DTMT_RESTRICT row = values + b * vsb + s * vss;
      T* DTMT_RESTRICT drow = dvalues + b * dsb + s * dss;
      for (int64_t h = 0; h < NH; ++h) {
        const int64_t i = (b * NH + h) * S + s;
        const T a = alpha[i];
        const T* DTMT_RESTRICT gh = g + h * Dc;
        const T* DTMT_RESTRICT vh = row + h * Dc;
        T* DTMT_RESTRICT dh = drow + h * Dc;
        T acc = 0;
        DTMT_SIMD_SUM(acc)
        for (int64_t d = 0; d < Dc; ++d) {
          acc += vh[d] * gh[d];
          dh[d] = a * gh[d];
        }
        dalpha[i] = acc;
      }
    }
  }
}

#define DTMT_INSTANTIATE(T)                                                                                        \
  template void scores_forward<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                  int64_t);                                                                        \
  template void scores_from_exps<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                    int64_t, int64_t);                                                           \
  template void scores_backward<T>(const T*, const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, int64_t,  \
                                   int64_t, int64_t);                                                              \
  template void weigh_products<T>(const T*, int64_t, int64_t, const int64_t*, const T*, int64_t, const T*, T*,    \
                                   int64_t, int64_t, int64_t);                                                      \
  template void context_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                   int64_t, int64_t);                                                              \
  template void context_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t, int64_t,      \
                                    int64_t, int64_t, int64_t, int64_t, int64_t);
DTMT_INSTANTIATE(float)
DTMT_INSTANTIATE(double)
#undef DTMT_INSTANTIATE

}  // namespace DTMT_ISA
}  // namespace dtmt
