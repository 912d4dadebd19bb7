// Declarations of the fused additive-attention ops: scores and context (see attention_cpu.cpp for the algorithm).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace dtmt {

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

}  // namespace dtmt
