// Declaration of the fused label-smoothed cross-entropy op (see loss_cpu.cpp for the algorithm).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace dtmt {

// logits [N, V] (float or double), target [N] int64 with values in [0, V) or ignore_index ->
// {loss sum [], NLL sum [] (the logits' dtype), grad [N, V]: d(loss sum)/d(logits)}.
std::vector<at::Tensor> smoothed_cross_entropy_cpu(const at::Tensor& logits, const at::Tensor& target,
                                                   double smoothing, int64_t ignore_index);

}  // namespace dtmt
