// C++ CPU kernels of additive attention (Bahdanau; DTMT's multi-head form, contract §4): the scores, and the
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
// Eager PyTorch computes this with batched GEMMs whose inner dimension is NH, and the head split costs either a
// copy or NH times the work; here both directions are one pass over the values. The values may be a strided view (the encoder output is [S, B, C] transposed);
// only the last dimension must be contiguous, and dvalues is laid out like the values. Each batch row is
// owned by one thread.
//
// The loops are in csrc/isa/attention_loops.cpp (the copy for this CPU's instruction set, cpu_dispatch.h); this
// file checks the tensors, allocates and splits the batch among threads.
#include "attention.h"

#include <ATen/Parallel.h>

#include "cpu_dispatch.h"

namespace dtmt {
namespace {

using at::Tensor;

int64_t batch_grain(int64_t S, int64_t A) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(S * A, 1)); }

// (AT_DISPATCH's "not implemented for 'Half'" named a kernel, not the argument)
void check_float_dtypes(const char* op, const char* first_name, const Tensor& first, const char* second_name,
                        const Tensor& second) {
  TORCH_CHECK(first.scalar_type() == second.scalar_type(), "dtmt._C: ", op, ": ", second_name, " is ",
              second.scalar_type(), " but ", first_name, " is ", first.scalar_type(), "; give them one dtype");
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble, "dtmt._C: ", op,
              ": float32 or float64 tensors expected, got ", first.scalar_type());
}

void check_context(const Tensor& alpha, const Tensor& values, int64_t group = 1) {
  check_context_shapes(alpha, values, group);
  check_float_dtypes("attention context", "alpha", alpha, "values", values);
  TORCH_CHECK(alpha.device().is_cpu() && values.device().is_cpu() && alpha.is_contiguous() &&
                  (values.size(2) <= 1 || values.stride(2) == 1),
              "dtmt._C: attention context takes CPU tensors, alpha contiguous and the values' last dimension "
              "contiguous");
}

void check_shapes(const Tensor& keys, const Tensor& q, const Tensor& v, int64_t group = 1) {
  check_scores_shapes(keys, q, v, group);
  check_float_dtypes("additive scores", "keys", keys, "q", q);
  check_float_dtypes("additive scores", "keys", keys, "v", v);
  for (const Tensor* t : {&keys, &q, &v})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "dtmt._C: additive scores take contiguous CPU tensors");
}

}  // namespace

Tensor attention_context_forward_cpu(const Tensor& alpha, const Tensor& values, int64_t group) {
  check_context(alpha, values, group);
  const int64_t B = alpha.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  Tensor out = at::empty({B, C}, values.options());
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_context_forward_cpu", [&] {
    const auto loop = typed_cpu_kernels<scalar_t>().context_forward;
    const scalar_t* a = alpha.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, batch_grain(S, C), [&](int64_t b0, int64_t b1) {
      loop(a, v, o, S, NH, C / NH, values.stride(0), values.stride(1), group, b0, b1);
    });
  });
  return out;
}

std::vector<Tensor> attention_context_backward_cpu(const Tensor& grad, const Tensor& alpha, const Tensor& values,
                                                   bool values_grad) {
  check_context(alpha, values);
  const int64_t B = values.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  check_context_grad(grad, values);
  Tensor dalpha, dvalues;
  std::tie(dalpha, dvalues) = context_backward_outputs(alpha, values, values_grad);
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_context_backward_cpu", [&] {
    const auto loop = typed_cpu_kernels<scalar_t>().context_backward;
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* a = alpha.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    scalar_t* da = dalpha.data_ptr<scalar_t>();
    scalar_t* dv = values_grad ? dvalues.data_ptr<scalar_t>() : nullptr;
    const int64_t dsb = values_grad ? dvalues.stride(0) : 0, dss = values_grad ? dvalues.stride(1) : 0;
    at::parallel_for(0, B, batch_grain(S, C), [&](int64_t b0, int64_t b1) {
      loop(g, a, v, da, dv, S, NH, C / NH, values.stride(0), values.stride(1), dsb, dss, b0, b1);
    });
  });
  return {dalpha, dvalues};
}

Tensor additive_scores_forward_cpu(const Tensor& keys, const Tensor& q, const Tensor& v, int64_t group) {
  check_shapes(keys, q, v, group);
  const int64_t B = q.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  Tensor out = at::empty({B, NH, S}, keys.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "additive_scores_forward_cpu", [&] {
    const auto loop = typed_cpu_kernels<scalar_t>().scores_forward;
    const scalar_t* k = keys.data_ptr<scalar_t>();
    const scalar_t* qq = q.data_ptr<scalar_t>();
    const scalar_t* vv = v.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, batch_grain(S, NH * D), [&](int64_t b0, int64_t b1) {
      loop(k, qq, vv, o, S, NH, D, group, b0, b1);
    });
  });
  return out;
}

std::vector<Tensor> additive_scores_backward_cpu(const Tensor& grad, const Tensor& keys, const Tensor& q,
                                                 const Tensor& v) {
  check_shapes(keys, q, v);
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  check_scores_grad(grad, keys);
  Tensor dkeys = at::empty_like(keys);
  Tensor dq = at::empty_like(q);
  Tensor dv_rows = at::empty({B, NH, D}, keys.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "additive_scores_backward_cpu", [&] {
    const auto loop = typed_cpu_kernels<scalar_t>().scores_backward;
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* k = keys.data_ptr<scalar_t>();
    const scalar_t* qq = q.data_ptr<scalar_t>();
    const scalar_t* vv = v.data_ptr<scalar_t>();
    scalar_t* dk = dkeys.data_ptr<scalar_t>();
    scalar_t* dqq = dq.data_ptr<scalar_t>();
    scalar_t* dv = dv_rows.data_ptr<scalar_t>();
    at::parallel_for(0, B, batch_grain(S, NH * D), [&](int64_t b0, int64_t b1) {
      loop(g, k, qq, vv, dk, dqq, dv, S, NH, D, b0, b1);
    });
  });
  return {dkeys, dq, dv_rows.sum(0)};
}

}  // namespace dtmt
