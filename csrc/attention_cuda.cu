// The additive-attention ops on CUDA tensors (built only when torch has CUDA: setup.py adds csrc/*.cu and defines
// DTMT_WITH_CUDA, and registration.cpp registers these as the CUDA kernels of dtmt::additive_scores,
// additive_scores_backward, attention_context and attention_context_backward). The kernels and their algorithm are in
// attention_cuda_kernels.cuh; here the tensors are checked, allocated, and the kernels launched on torch's current
// stream. Nothing synchronises with the host, so a step runs inside a captured CUDA graph.
#include <ATen/ATen.h>
#if !defined(DTMT_CUDA_EMULATION)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#else
#include "cuda_emulation_aten.h"   // tests only: host tensors, kernels on host fibers
#endif

#include <climits>
#include <vector>

#include "attention.h"
#include "attention_cuda_kernels.cuh"

namespace dtmt {
namespace {

using at::Tensor;

// Whether t is where the kernels read: a CUDA tensor on `device` (a host tensor in the emulation).
bool on_device(const Tensor& t, const at::Device& device) {
#if defined(DTMT_CUDA_EMULATION)
  return t.device().is_cpu() && device.is_cpu();
#else
  return t.is_cuda() && t.device() == device;
#endif
}

// Tensors of one device and one dtype, float or double; `what` names the op in the message.
void check_attention_tensors(std::initializer_list<const Tensor*> ts, const char* what) {
  const Tensor& first = **ts.begin();
  for (const Tensor* t : ts) {
    TORCH_CHECK(on_device(*t, first.device()) && t->scalar_type() == first.scalar_type(),
                "dtmt._C: ", what, " on CUDA takes tensors of one device and one dtype");
  }
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble,
              "dtmt._C: ", what, " on CUDA takes float32 or float64 tensors (16-bit ones run in float32 under "
              "autocast)");
}

// The kernels index within a row with int, and step over a row a block at a time: sizes past INT_MAX less a block,
// and grid counts past INT_MAX, are refused rather than wrapped.
void check_int_sizes(std::initializer_list<int64_t> sizes, const char* what) {
  for (int64_t n : sizes) {
    TORCH_CHECK(n <= INT_MAX - cuda::kAttentionThreads,
                "dtmt._C: ", what, " on CUDA: a size or block count is over 2^31 - 257");
  }
}

void check_scores(const Tensor& keys, const Tensor& q, const Tensor& v, const char* what) {
  check_scores_shapes(keys, q, v);
  check_attention_tensors({&keys, &q, &v}, what);
  TORCH_CHECK(keys.is_contiguous() && q.is_contiguous() && v.is_contiguous(),
              "dtmt._C: ", what, " on CUDA takes contiguous tensors");
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  check_int_sizes({B, S, NH, D, B * NH, (B * S * NH + cuda::kAttentionWarps - 1) / cuda::kAttentionWarps}, what);
}

void check_context(const Tensor& alpha, const Tensor& values, const char* what) {
  check_context_shapes(alpha, values);
  check_attention_tensors({&alpha, &values}, what);
  TORCH_CHECK(alpha.is_contiguous() && (values.size(2) <= 1 || values.stride(2) == 1),
              "dtmt._C: ", what, " on CUDA takes alpha contiguous and the values' last dimension contiguous");
  const int64_t B = values.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  const int64_t chunks = (C + cuda::kAttentionThreads - 1) / cuda::kAttentionThreads;
  check_int_sizes({B, S, C, NH, B * chunks, (B * S * NH + cuda::kAttentionWarps - 1) / cuda::kAttentionWarps},
                  what);
}

}  // namespace

Tensor additive_scores_forward_cuda(const Tensor& keys, const Tensor& q, const Tensor& v) {
  check_scores(keys, q, v, "additive scores");
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  Tensor out = at::empty({B, NH, S}, keys.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "additive_scores_forward_cuda", [&] {
    const cuda::ScoresArgs<scalar_t> p{keys.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                       out.data_ptr<scalar_t>(), static_cast<int>(B), static_cast<int>(S),
                                       static_cast<int>(NH), static_cast<int>(D)};
    C10_CUDA_CHECK(cuda::launch_scores_forward(p, c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

std::vector<Tensor> additive_scores_backward_cuda(const Tensor& grad, const Tensor& keys, const Tensor& q,
                                                  const Tensor& v) {
  check_scores(keys, q, v, "additive scores backward");
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  check_attention_tensors({&keys, &grad}, "additive scores backward");
  check_scores_grad(grad, keys);
  const c10::cuda::CUDAGuard guard(keys.device());
  Tensor dkeys = at::empty_like(keys);
  Tensor dq = at::empty_like(q);
  Tensor dv_rows = at::empty({B, NH, D}, keys.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "additive_scores_backward_cuda", [&] {
    const cuda::ScoresBackwardArgs<scalar_t> p{
        grad.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        dkeys.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dv_rows.data_ptr<scalar_t>(), static_cast<int>(B),
        static_cast<int>(S), static_cast<int>(NH), static_cast<int>(D)};
    C10_CUDA_CHECK(cuda::launch_scores_backward(p, c10::cuda::getCurrentCUDAStream()));
  });
  return {dkeys, dq, dv_rows.sum(0)};   // (a sum over the rows in a fixed order, as the CPU op's)
}

Tensor attention_context_forward_cuda(const Tensor& alpha, const Tensor& values) {
  check_context(alpha, values, "attention context");
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t B = values.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  Tensor out = at::empty({B, C}, values.options());
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_context_forward_cuda", [&] {
    const cuda::ContextArgs<scalar_t> p{alpha.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                                        out.data_ptr<scalar_t>(), static_cast<int>(B), static_cast<int>(S),
                                        static_cast<int>(NH), static_cast<int>(C), values.stride(0), values.stride(1)};
    C10_CUDA_CHECK(cuda::launch_context_forward(p, c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

std::vector<Tensor> attention_context_backward_cuda(const Tensor& grad, const Tensor& alpha, const Tensor& values,
                                                    bool values_grad) {
  check_context(alpha, values, "attention context backward");
  const int64_t B = values.size(0), S = values.size(1), C = values.size(2), NH = alpha.size(1);
  check_attention_tensors({&values, &grad}, "attention context backward");
  check_context_grad(grad, values);
  const c10::cuda::CUDAGuard guard(values.device());
  Tensor dalpha, dvalues;
  std::tie(dalpha, dvalues) = context_backward_outputs(alpha, values, values_grad);
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_context_backward_cuda", [&] {
    const cuda::ContextBackwardArgs<scalar_t> p{
        grad.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
        dalpha.data_ptr<scalar_t>(), values_grad ? dvalues.data_ptr<scalar_t>() : nullptr, static_cast<int>(B),
        static_cast<int>(S), static_cast<int>(NH), static_cast<int>(C), values.stride(0), values.stride(1),
        values_grad ? dvalues.stride(0) : 0, values_grad ? dvalues.stride(1) : 0};
    C10_CUDA_CHECK(cuda::launch_context_backward(p, c10::cuda::getCurrentCUDAStream()));
  });
  return {dalpha, dvalues};
}

}  // namespace dtmt
