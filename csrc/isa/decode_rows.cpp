// The row loops of a decoding step's distributions (decode_step_cpu.cpp): the output's log-softmax over the
// vocabulary and the attention's masked softmax over the source positions. One copy per instruction set (kernels.h).
#include <cmath>
#include <limits>

#include "kernels.h"

namespace dtmt {
namespace DTMT_ISA {

template <typename T> void log_softmax_rows(const T* x, T* out, int64_t V, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* DTMT_RESTRICT z = x + r * V;
    T* DTMT_RESTRICT o = out + r * V;
    T m = -std::numeric_limits<T>::infinity();
    DTMT_SIMD_MAX(m)
    for (int64_t j = 0; j < V; ++j) m = z[j] > m ? z[j] : m;
    T se = 0;
    DTMT_SIMD_SUM(se)
    for (int64_t j = 0; j < V; ++j) se += dt_exp(z[j] - m);
    const T log_se = std::log(se);
    DTMT_SIMD
    for (int64_t j = 0; j < V; ++j) o[j] = (z[j] - m) - log_se;
  }
}

template <typename T>
void masked_softmax_rows(const T* scores, const bool* mask, T* alpha, int64_t NH, int64_t S, int64_t group,
                         int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const bool* DTMT_RESTRICT m = mask + (b / group) * S;
    for (int64_t h = 0; h < NH; ++h) {
      const T* DTMT_RESTRICT sc = scores + (b * NH + h) * S;
      T* DTMT_RESTRICT a = alpha + (b * NH + h) * S;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t s = 0; s < S; ++s)
        if (m[s] && sc[s] > mx) mx = sc[s];
      T sum = 0;
      DTMT_SIMD_SUM(sum)
      for (int64_t s = 0; s < S; ++s) {
        a[s] = m[s] ? dt_exp(sc[s] - mx) : T(0);
        sum += a[s];
      }
      const T inv = T(1) / sum;  // no real position: 0 * inf = NaN, as torch's softmax over all -inf gives
      DTMT_SIMD
      for (int64_t s = 0; s < S; ++s) a[s] *= inv;
    }
  }
}

#define DTMT_INSTANTIATE(T)                                                                                        \
  template void log_softmax_rows<T>(const T*, T*, int64_t, int64_t, int64_t);                                      \
  template void masked_softmax_rows<T>(const T*, const bool*, T*, int64_t, int64_t, int64_t, int64_t, int64_t);
DTMT_INSTANTIATE(float)
DTMT_INSTANTIATE(double)
#undef DTMT_INSTANTIATE

}  // namespace DTMT_ISA
}  // namespace dtmt
