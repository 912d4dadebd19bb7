// The row loops of a decoding step and its search (engine/decode_step_cpu.cpp, engine/beam_search_cpu.cpp) besides the products:
// the output's log-softmax over the vocabulary, the attention's masked softmax over the source positions, the
// readout's layer norms and tanh, the previous token's products from TokenProducts' tables, and the search's best
// candidates. One copy per instruction set (kernels.h).
#include <algorithm>
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

template <typename T> bool within_bound(const T* x, int64_t n, T bound) {
  T m = 0;   // the largest |x| (one vector max a chunk), then NaN apart
  DTMT_SIMD_MAX(m)
  for (int64_t i = 0; i < n; ++i) {
    const T a = std::fabs(x[i]);
    m = a > m ? a : m;
  }
  if (!(m <= bound)) return false;
  int nan = 0;
  DTMT_SIMD_MAX(nan)
  for (int64_t i = 0; i < n; ++i) {
    const int is_nan = x[i] != x[i];
    nan = is_nan > nan ? is_nan : nan;
  }
  return nan == 0;
}

template <typename T>
void readout_rows(T* const* parts, const T* ln_w, const T* ln_b, T eps, int64_t R, T* out, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    T* DTMT_RESTRICT o = out + r * R;
    for (int64_t j = 0; j < R; ++j) o[j] = T(0);
    for (int k = 0; k < 3; ++k) {
      T* DTMT_RESTRICT x = parts[k] + r * R;
      if (ln_w != nullptr) {
        layer_norm_row_normalise(static_cast<int>(R), x, eps);
        const T* DTMT_RESTRICT w = ln_w + k * R;
        const T* DTMT_RESTRICT b = ln_b + k * R;
        DTMT_SIMD
        for (int64_t j = 0; j < R; ++j) o[j] += x[j] * w[j] + b[j];
      } else {
        DTMT_SIMD
        for (int64_t j = 0; j < R; ++j) o[j] += x[j];
      }
    }
    DTMT_SIMD
    for (int64_t j = 0; j < R; ++j) o[j] = dt_tanh(o[j]);
  }
}

template <typename T>
void token_rows(const T* tokens, const T* positions, const T* bias, int64_t N, int64_t N_q, const int64_t* prev,
                int64_t n, T* cell, T* readout) {
  const int64_t R = N - N_q;
  for (int64_t i = 0; i < n; ++i) {
    const T* DTMT_RESTRICT row = tokens + prev[i] * N;
    T* DTMT_RESTRICT c = cell + i * N_q;
    T* DTMT_RESTRICT y = readout + i * R;
    if (positions != nullptr) {
      const T* DTMT_RESTRICT pos = positions;
      DTMT_SIMD
      for (int64_t j = 0; j < N_q; ++j) c[j] = (row[j] + pos[j]) + bias[j];
      DTMT_SIMD
      for (int64_t j = 0; j < R; ++j) y[j] = (row[N_q + j] + pos[N_q + j]) + bias[N_q + j];
    } else {
      DTMT_SIMD
      for (int64_t j = 0; j < N_q; ++j) c[j] = row[j] + bias[j];
      DTMT_SIMD
      for (int64_t j = 0; j < R; ++j) y[j] = row[N_q + j] + bias[N_q + j];
    }
  }
}

// The K best candidates of one sentence (engine/beam_search_cpu.cpp), as at::topk(scores[o] + lp[o, w] over (o, w)
// flattened, K) gives them (values descending; index o * V + w), without forming the candidates: one pass keeps the
// K + 1 best seen so far (a candidate enters only when it beats the last of them, tested kTopBlock at a time).
// Returns false where the result could differ from at::topk's (ties at or above the K-th place, NaN, fewer than
// K + 1 finite candidates), the caller then asking at::topk itself.
constexpr int64_t kTopBlock = 16;

bool top_candidates(const float* scores, const float* lp, int64_t beam, int64_t V, int64_t K, float* top_scores,
                    int64_t* top_idx) {
  const int64_t keep = std::min(K + 1, beam * V);
  if (K < 1 || K > kMaxTopCandidates || keep < 1) return false;   // (outside the buffers: at::topk's)
  float best[kMaxTopCandidates + 1];
  int64_t where[kMaxTopCandidates + 1];
  for (int64_t p = 0; p < keep; ++p) {
    best[p] = -std::numeric_limits<float>::infinity();
    where[p] = -1;
  }
  float last = best[keep - 1];
  bool nan = false;
  const auto offer = [&](float v, int64_t j) {
    if (v != v) {
      nan = true;
      return;
    }
    if (!(v > last)) return;
    int64_t p = keep - 1;
    for (; p > 0 && best[p - 1] < v; --p) {
      best[p] = best[p - 1];
      where[p] = where[p - 1];
    }
    best[p] = v;
    where[p] = j;
    last = best[keep - 1];
  };
  for (int64_t o = 0; o < beam; ++o) {
    const float base = scores[o];
    const float* DTMT_RESTRICT row = lp + o * V;
    int64_t w = 0;
    for (; w + kTopBlock <= V; w += kTopBlock) {
      int hit = 0;   // any candidate of the block above the last kept one, or NaN
      DTMT_SIMD_MAX(hit)
      for (int64_t l = 0; l < kTopBlock; ++l) {
        const int h = !(base + row[w + l] <= last);
        hit = h > hit ? h : hit;
      }
      if (hit)
        for (int64_t l = 0; l < kTopBlock; ++l) offer(base + row[w + l], o * V + w + l);
    }
    for (; w < V; ++w) offer(base + row[w], o * V + w);
  }
  if (nan || where[keep - 1] < 0) return false;
  for (int64_t p = 1; p < keep; ++p)
    if (!(best[p - 1] > best[p])) return false;
  for (int64_t p = 0; p < K; ++p) {
    top_scores[p] = best[p];
    top_idx[p] = where[p];
  }
  return true;
}

#define DTMT_INSTANTIATE(T)                                                                                        \
  template void log_softmax_rows<T>(const T*, T*, int64_t, int64_t, int64_t);                                      \
  template void masked_softmax_rows<T>(const T*, const bool*, T*, int64_t, int64_t, int64_t, int64_t, int64_t);    \
  template bool within_bound<T>(const T*, int64_t, T);                                                             \
  template void readout_rows<T>(T* const*, const T*, const T*, T, int64_t, T*, int64_t, int64_t);                  \
  template void token_rows<T>(const T*, const T*, const T*, int64_t, int64_t, const int64_t*, int64_t, T*, T*);
DTMT_INSTANTIATE(float)
DTMT_INSTANTIATE(double)
#undef DTMT_INSTANTIATE

}  // namespace DTMT_ISA
}  // namespace dtmt
