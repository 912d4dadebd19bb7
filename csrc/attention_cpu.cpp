// C++ CPU kernels of additive attention (Bahdanau; DTMT's multi-head form, SPEC §4): the scores, and the
// context that weights the annotations with the attention weights.
//
// Scores:
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
//
// Context (head h reads its own C/NH columns of the values; a single head reads all of them):
//   context[b, h*Dc + d] = sum_s alpha[b, h, s] * values[b, s, h*Dc + d]            Dc = C / NH
//   dvalues[b, s, h*Dc + d] = alpha[b, h, s] * dcontext[b, h*Dc + d]
//   dalpha[b, h, s]         = sum_d values[b, s, h*Dc + d] * dcontext[b, h*Dc + d]
// Eager PyTorch computes this with batched GEMMs whose inner dimension is NH (1 to 16), which run far below
// the machine's rate, and the head split costs either a copy or NH times the work. Here both directions are
// one pass over the values. The values may be a strided view (the encoder output is [S, B, C] transposed);
// only the last dimension must be contiguous, and dvalues is laid out like the values. Each batch row is
// owned by one thread.
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

template <typename T>
void context_forward(const T* alpha, const T* values, T* out, int64_t B, int64_t S, int64_t NH, int64_t Dc,
                     int64_t vsb, int64_t vss) {
  const int64_t C = NH * Dc;
  at::parallel_for(0, B, batch_grain(S, C), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      T* DTMT_RESTRICT o = out + b * C;
      std::fill(o, o + C, T(0));
      for (int64_t s = 0; s < S; ++s) {
        const T* DTMT_RESTRICT row = values + b * vsb + s * vss;
        for (int64_t h = 0; h < NH; ++h) {
          const T a = alpha[(b * NH + h) * S + s];
          T* DTMT_RESTRICT oh = o + h * Dc;
          const T* DTMT_RESTRICT vh = row + h * Dc;
#pragma omp simd
          for (int64_t d = 0; d < Dc; ++d) oh[d] += a * vh[d];
        }
      }
    }
  });
}

template <typename T>
void context_backward(const T* grad, const T* alpha, const T* values, T* dalpha, T* dvalues, int64_t B, int64_t S,
                      int64_t NH, int64_t Dc, int64_t vsb, int64_t vss, int64_t dsb, int64_t dss) {
  const int64_t C = NH * Dc;
  at::parallel_for(0, B, batch_grain(S, C), [&](int64_t b0, int64_t b1) {
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
  });
}

void check_context(const Tensor& alpha, const Tensor& values) {
  TORCH_CHECK(alpha.dim() == 3 && values.dim() == 3 && alpha.size(0) == values.size(0) &&
                  alpha.size(2) == values.size(1) && alpha.size(1) > 0 && values.size(2) % alpha.size(1) == 0,
              "dtmt._C: attention context takes alpha [B,NH,S] and values [B,S,C] with C divisible by NH");
  TORCH_CHECK(alpha.device().is_cpu() && values.device().is_cpu() && alpha.scalar_type() == values.scalar_type() &&
                  alpha.is_contiguous() && (values.size(2) <= 1 || values.stride(2) == 1),
              "dtmt._C: attention context takes CPU tensors of one dtype, alpha contiguous and the values' last "
              "dimension contiguous");
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

Tensor attention_context_forward_cpu(const Tensor& alpha, const Tensor& values) {
  check_context(alpha, values);
  const int64_t B = values.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  Tensor out = at::empty({B, C}, values.options());
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_context_forward_cpu", [&] {
    context_forward<scalar_t>(alpha.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              B, S, NH, C / NH, values.stride(0), values.stride(1));
  });
  return out;
}

std::vector<Tensor> attention_context_backward_cpu(const Tensor& grad, const Tensor& alpha, const Tensor& values) {
  check_context(alpha, values);
  const int64_t B = values.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({B, C}) && grad.is_contiguous() &&
                  grad.scalar_type() == values.scalar_type(),
              "dtmt._C: attention context backward: grad must be a contiguous [B,C] tensor of the values' dtype");
  Tensor dalpha = at::empty_like(alpha);
  Tensor dvalues = at::empty_like(values);  // same strides as the values when they are dense
  if (C > 1 && dvalues.stride(2) != 1) dvalues = at::empty({B, S, C}, values.options());
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_context_backward_cpu", [&] {
    context_backward<scalar_t>(grad.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                               dalpha.data_ptr<scalar_t>(), dvalues.data_ptr<scalar_t>(), B, S, NH, C / NH,
                               values.stride(0), values.stride(1), dvalues.stride(0), dvalues.stride(1));
  });
  return {dalpha, dvalues};
}

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
