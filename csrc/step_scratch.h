// The tensors of a search's decoding steps, kept from one step to the next (engine/decode_step.h, StepBuffers): each step
// takes its tensors in the same order, and a slot's tensor is reused while its shape and dtype stay those asked for
// (they change when a sentence of the batch finishes), instead of ~20 small tensors allocated and freed every step
// (why: docs/design/cpu_kernels.md, "Step scratch buffers"). A tensor taken from it lives until the same slot is
// taken again, in the next step: what a search carries from one step to the next (its state) must not come from here.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace dtmt {

class StepScratch {
 public:
  // The next slot's tensor, of `shape` and the options' dtype (values undefined).
  at::Tensor take(at::IntArrayRef shape, const at::TensorOptions& opts) {
    const at::ScalarType dtype = opts.dtype().toScalarType();
    if (next_ == slots_.size()) slots_.emplace_back();
    at::Tensor& t = slots_[next_++];
    if (!t.defined() || t.sizes() != shape || t.scalar_type() != dtype) t = at::empty(shape, opts);
    return t;
  }
  // A new step: its first tensor is the first slot's.
  void rewind() { next_ = 0; }

 private:
  std::vector<at::Tensor> slots_;
  size_t next_ = 0;
};

// The next tensor of `scratch`, or a new one (at::empty) where there is none.
inline at::Tensor step_tensor(StepScratch* scratch, at::IntArrayRef shape, const at::TensorOptions& opts) {
  return scratch != nullptr ? scratch->take(shape, opts) : at::empty(shape, opts);
}

}  // namespace dtmt
