// C++ CPU kernel of the additive-attention scores (Bahdanau; DTMT's multi-head form, SPEC §4):
//
//   scores[b, h, s] = sum_d v[h, d] * tanh(keys[b, s, h, d] + q[b, h, d])
//
// keys [B, S, NH, D] (computed once per batch), q [B, NH, D] (one decoder step), v [NH, D].
// Eager PyTorch runs this as four passes over a [B, S, NH*D] tensor per decoder step (add, tanh, multiply,
// sum) and keeps the tanh output for backward. Here the forward is one pass that keeps nothing; the backward
// recomputes tanh from keys and q:
//   dkeys[b, s, h, d] = g[b, h, s] * v[h, d] * (1 - t^2)      t = tanh(keys + q)
//   dq[b, h, d]       = sum_s dkeys[b, s, h, d]
//   dv[h, d]          = sum_b sum_s g[b, h, s] * t
// Work is split over the batch rows; dv is summed per row first and then over rows in a fixed order, so the
// results do not depend on the number of threads.
#include "attention.h"

#include <ATen/Parallel.h>

#include "cell_math.h"

namespace dtmt {
namespace {

using at::Tensor;

int64_t batch_grain(int64_t S, int64_t A) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(S * A, 1)); }

template <typename T>
void scores_forward(const T* keys, const T* q, const T* v, T* out, int64_t B, int64_t S, int64_t NH, int64_t D) {
  at::parallel_for(0, B, batch_grain(S, NH * D), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t h = 0; h < NH; ++h) {
          const T* DTMT_RESTRICT k = keys + ((b * S + s) * NH + h) * D;
          const T* DTMT_RESTRICT qq = q + (b * NH + h) * D;
          const T* DTMT_RESTRICT vv = v + h * D;
          T acc = 0;
          DTMT_SIMD_SUM(acc)
          for (int64_t d = 0; d < D; ++d) acc += vv[d] * dt_tanh(k[d] + qq[d]);
          out[(b * NH + h) * S + s] = acc;
        }
      }
    }
  });
}

template <typename T>
void scores_backward(const T* grad, const T* keys, const T* q, const T* v, T* dkeys, T* dq, T* dv_rows, int64_t B,
                     int64_t S, int64_t NH, int64_t D) {
  const int64_t A = NH * D;
  at::parallel_for(0, B, batch_grain(S, A), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      T* DTMT_RESTRICT dqb = dq + b * A;
      T* DTMT_RESTRICT dvb = dv_rows + b * A;
      std::fill(dqb, dqb + A, T(0));
      std::fill(dvb, dvb + A, T(0));
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
  });
}

void check_shapes(const Tensor& keys, const Tensor& q, const Tensor& v) {
  TORCH_CHECK(keys.dim() == 4 && q.dim() == 3 && v.dim() == 2, "dtmt._C: additive scores take keys [B,S,NH,D], "
              "q [B,NH,D], v [NH,D]");
  TORCH_CHECK(q.size(0) == keys.size(0) && q.size(1) == keys.size(2) && q.size(2) == keys.size(3) &&
                  v.size(0) == keys.size(2) && v.size(1) == keys.size(3),
              "dtmt._C: additive scores: keys, q and v sizes do not match");
  for (const Tensor* t : {&keys, &q, &v})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == keys.scalar_type(),
                "dtmt._C: additive scores take contiguous CPU tensors of one dtype");
}

}  // namespace

Tensor additive_scores_forward_cpu(const Tensor& keys, const Tensor& q, const Tensor& v) {
  check_shapes(keys, q, v);
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  Tensor out = at::empty({B, NH, S}, keys.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "additive_scores_forward_cpu", [&] {
    scores_forward<scalar_t>(keys.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                             out.data_ptr<scalar_t>(), B, S, NH, D);
  });
  return out;
}

std::vector<Tensor> additive_scores_backward_cpu(const Tensor& grad, const Tensor& keys, const Tensor& q,
                                                 const Tensor& v) {
  check_shapes(keys, q, v);
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({B, NH, S}) && grad.is_contiguous() &&
                  grad.scalar_type() == keys.scalar_type(),
              "dtmt._C: additive scores backward: grad must be a contiguous [B,NH,S] tensor of the keys' dtype");
  Tensor dkeys = at::empty_like(keys);
  Tensor dq = at::empty_like(q);
  Tensor dv_rows = at::empty({B, NH, D}, keys.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "additive_scores_backward_cpu", [&] {
    scores_backward<scalar_t>(grad.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), dkeys.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(),
                              dv_rows.data_ptr<scalar_t>(), B, S, NH, D);
  });
  return {dkeys, dq, dv_rows.sum(0)};
}

}  // namespace dtmt
