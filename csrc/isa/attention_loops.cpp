// The loops of the additive-attention kernels (scores and context; the algorithm is described in
// attention_cpu.cpp) over a range of batch entries. One copy per instruction set (kernels.h).
#include "kernels.h"

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

// The rows of SourceProducts (decode_step.h) weighed by the attention weights, columns [n0, n1):
//   out[r, n - n0] = bias[n] + sum_{k < W} alpha[r, k] * P[block[r] * W + k, n]        rows r in [0, M)
// alpha [M, W] contiguous, P rows ldp apart, out rows ldo apart. Each row reads only its sentence's W rows of P.
// Rows of one sentence go MR at a time through a chunk of kWeighColumns columns, summed in k order, so that a row
// of P is loaded once for all of them (their sums in registers); a row's sums do not depend on its neighbours.
constexpr int64_t kWeighColumns = 32;

template <typename T, int MR>
void weigh_rows(const T* alpha, int64_t W, const T* p, int64_t ldp, const T* bias, T* out, int64_t ldo, int64_t n0,
                int64_t n1) {
  int64_t n = n0;
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
