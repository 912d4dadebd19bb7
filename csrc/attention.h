// Declarations of the fused additive-attention ops: scores and context (see attention_cpu.cpp for the algorithm).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>
#include <vector>

namespace dtmt {

// The shapes the ops take, whatever the device (each implementation checks its device, dtype and layout itself).
// group: rows of q (of alpha) per row of the keys (of the values); the backward ops take 1.
inline void check_scores_shapes(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& v, int64_t group = 1) {
  TORCH_CHECK(group >= 1, "dtmt._C: additive scores: group must be >= 1, got ", group);
  TORCH_CHECK(keys.dim() == 4 && q.dim() == 3 && v.dim() == 2, "dtmt._C: additive scores take keys [B,S,NH,D], "
              "q [B,NH,D], v [NH,D]");
  TORCH_CHECK(q.size(0) == keys.size(0) * group && q.size(1) == keys.size(2) && q.size(2) == keys.size(3) &&
                  v.size(0) == keys.size(2) && v.size(1) == keys.size(3),
              "dtmt._C: additive scores take keys [B,S,NH,D], q [B,NH,D] and v [NH,D] of one NH and D; got keys ",
              keys.sizes(), ", q ", q.sizes(), " and v ", v.sizes());
}
inline void check_context_shapes(const at::Tensor& alpha, const at::Tensor& values, int64_t group = 1) {
  TORCH_CHECK(group >= 1, "dtmt._C: attention context: group must be >= 1, got ", group);
  TORCH_CHECK(alpha.dim() == 3 && values.dim() == 3 && alpha.size(0) == values.size(0) * group &&
                  alpha.size(2) == values.size(1) && alpha.size(1) > 0 && values.size(2) % alpha.size(1) == 0,
              "dtmt._C: attention context takes alpha [B,NH,S] and values [B,S,C] with C divisible by NH");
}

// The backward ops' incoming gradients: [B,NH,S] of the keys' dtype (scores), [B,C] of the values' (context).
inline void check_scores_grad(const at::Tensor& grad, const at::Tensor& keys) {
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({keys.size(0), keys.size(2), keys.size(1)}) && grad.is_contiguous() &&
                  grad.scalar_type() == keys.scalar_type(),
              "dtmt._C: additive scores backward: grad must be a contiguous [B,NH,S] tensor of the keys' dtype");
}
inline void check_context_grad(const at::Tensor& grad, const at::Tensor& values) {
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({values.size(0), values.size(2)}) && grad.is_contiguous() &&
                  grad.scalar_type() == values.scalar_type(),
              "dtmt._C: attention context backward: grad must be a contiguous [B,C] tensor of the values' dtype");
}

// The context backward's results, unfilled: dalpha like alpha, and with values_grad dvalues laid out like the
// values where their last dimension is dense (else contiguous), without it an empty tensor.
inline std::pair<at::Tensor, at::Tensor> context_backward_outputs(const at::Tensor& alpha, const at::Tensor& values,
                                                                  bool values_grad) {
  at::Tensor dvalues = at::empty({0}, values.options());
  if (values_grad) {
    dvalues = at::empty_like(values);
    if (values.size(2) > 1 && dvalues.stride(2) != 1) dvalues = at::empty(values.sizes(), values.options());
  }
  return {at::empty_like(alpha), dvalues};
}

// scores[b, h, s] = sum_d v[h, d] * tanh(keys[b, s, h, d] + q[b, h, d]).
// keys [B, S, NH, D], q [B, NH, D], v [NH, D] (contiguous, one dtype) -> scores [B, NH, S].
// group > 1: q [B * group, NH, D], row b of q against keys row b / group (a beam's rows share their sentence's
// keys) -> scores [B * group, NH, S].
at::Tensor additive_scores_forward_cpu(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& v,
                                       int64_t group = 1);

// grad [B, NH, S] -> {dkeys [B, S, NH, D], dq [B, NH, D], dv [NH, D]}; tanh is recomputed, nothing is saved.
std::vector<at::Tensor> additive_scores_backward_cpu(const at::Tensor& grad, const at::Tensor& keys,
                                                     const at::Tensor& q, const at::Tensor& v);

// context[b, h*Dc + d] = sum_s alpha[b, h, s] * values[b, s, h*Dc + d], Dc = C / NH.
// alpha [B, NH, S] contiguous, values [B, S, C] with a contiguous last dimension -> context [B, C].
// group > 1: alpha [B * group, NH, S], row b weighting values row b / group -> context [B * group, C].
at::Tensor attention_context_forward_cpu(const at::Tensor& alpha, const at::Tensor& values, int64_t group = 1);

// grad [B, C] -> {dalpha [B, NH, S], dvalues [B, S, C] (laid out like values)}.
// values_grad false: only dalpha is formed, and the second tensor returned is empty
std::vector<at::Tensor> attention_context_backward_cpu(const at::Tensor& grad, const at::Tensor& alpha,
                                                       const at::Tensor& values, bool values_grad = true);

// The same four ops on CUDA tensors (attention_cuda.cu, built with the CUDA sources; float and double; one device):
// the same shapes, results and layouts, no group.
at::Tensor additive_scores_forward_cuda(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& v);
std::vector<at::Tensor> additive_scores_backward_cuda(const at::Tensor& grad, const at::Tensor& keys,
                                                      const at::Tensor& q, const at::Tensor& v);
at::Tensor attention_context_forward_cuda(const at::Tensor& alpha, const at::Tensor& values);
std::vector<at::Tensor> attention_context_backward_cuda(const at::Tensor& grad, const at::Tensor& alpha,
                                                        const at::Tensor& values, bool values_grad = true);

}  // namespace dtmt
