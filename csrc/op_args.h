// The ops' argument conventions (csrc/registration.cpp, csrc/engine/registration.cpp): inputs need not be
// contiguous, an absent optional tensor is an empty one for the kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace dtmt::args {

inline at::Tensor dense(const at::Tensor& t) { return t.contiguous(); }

// An optional tensor made contiguous, or an empty tensor with `like`'s options where it is absent.
inline at::Tensor dense(const std::optional<at::Tensor>& t, const at::Tensor& like) {
  return t.has_value() && t->defined() ? t->contiguous() : at::empty({0}, like.options());
}

inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() && t->numel() > 0; }

// A Tensor[] argument with each tensor contiguous (a no-op for those that are).
inline std::vector<at::Tensor> dense(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(t.defined() ? t.contiguous() : t);
  return out;
}

// A tensor whose last dimension is dense (stride 1), copied only where it is not.
inline at::Tensor last_dim_dense(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace dtmt::args
