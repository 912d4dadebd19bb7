// The row loop of the label-smoothed cross-entropy (the algorithm is described in loss_cpu.cpp). One copy per
// instruction set (kernels.h).
#include <cmath>
#include <limits>

#include "kernels.h"

namespace dtmt {
namespace DTMT_ISA {

template <typename T>
void smoothed_ce_rows(const T* logits, const int64_t* target, int64_t V, int64_t ignore, T smoothing, T* grad,
                      double* loss, double* nll, int64_t r0, int64_t r1) {
  const T uniform = smoothing / T(V);
  for (int64_t r = r0; r < r1; ++r) {
    const T* DTMT_RESTRICT z = logits + r * V;
    T* DTMT_RESTRICT g = grad + r * V;
    const int64_t y = target[r];
    if (y == ignore) {
      for (int64_t j = 0; j < V; ++j) g[j] = T(0);
      loss[r] = nll[r] = 0.0;
      continue;
    }
    T m = -std::numeric_limits<T>::infinity();
    DTMT_SIMD_MAX(m)
    for (int64_t j = 0; j < V; ++j) m = z[j] > m ? z[j] : m;
    T se = 0, sz = 0;
    DTMT_SIMD_SUM(se, sz)
    for (int64_t j = 0; j < V; ++j) {
      se += dt_exp(z[j] - m);
      sz += z[j];
    }
    const T log_z = m + std::log(se);   // log sum_j exp(z_j)
    const T inv = T(1) / se;
    const T row_nll = log_z - z[y];     // -log p(y)
    const T row_smooth = log_z - sz / T(V);   // -mean_j log p(j)
    nll[r] = double(row_nll);
    // without smoothing the NLL alone: a -inf logit (a masked token) makes row_smooth inf, and 0 * inf was NaN
    loss[r] = smoothing == T(0) ? double(row_nll) : double((T(1) - smoothing) * row_nll + smoothing * row_smooth);
    DTMT_SIMD   // g and z do not overlap (GCC would otherwise check that at run time, per row)
    for (int64_t j = 0; j < V; ++j) g[j] = dt_exp(z[j] - m) * inv - uniform;
    g[y] -= T(1) - smoothing;
  }
}

template void smoothed_ce_rows<float>(const float*, const int64_t*, int64_t, int64_t, float, float*, double*, double*,
                                      int64_t, int64_t);
template void smoothed_ce_rows<double>(const double*, const int64_t*, int64_t, int64_t, double, double*, double*,
                                       double*, int64_t, int64_t);

}  // namespace DTMT_ISA
}  // namespace dtmt
