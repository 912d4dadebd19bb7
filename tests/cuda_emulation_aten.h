// Test-only stand-ins for the few c10 CUDA names the ATen drivers (csrc/transition_cuda.cu, csrc/attention_cuda.cu)
// use, so that they compile with a host C++ compiler under DTMT_CUDA_EMULATION (tests/cuda_emulation.h runs their
// kernels on host fibers; the tensors are host tensors there).
#pragma once

#include <ATen/ATen.h>

#include "cuda_emulation.h"

namespace c10 {
namespace cuda {
inline cudaStream_t getCurrentCUDAStream() { return nullptr; }
struct CUDAGuard {
  explicit CUDAGuard(const at::Device&) {}
};
}  // namespace cuda
}  // namespace c10
namespace dtmt_emu {
inline void cuda_check(cudaError_t err) {   // (the error named, as C10_CUDA_CHECK names a GPU's)
  TORCH_CHECK(err == cudaSuccess, "dtmt: emulated launch failed: ", cudaGetErrorString(err));
}
}  // namespace dtmt_emu
#define C10_CUDA_CHECK(err) ::dtmt_emu::cuda_check(err)
