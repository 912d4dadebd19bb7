// Test-only host emulation of the few CUDA features csrc/transition_cuda_kernels.cuh uses, so its kernels
// (and the ATen driver csrc/transition_cuda.cu) can be compiled by a host C++ compiler and checked against
// the reference on a machine without a GPU (tests/test_cuda_sources.py::test_cuda_kernels_emulated).
//
// A launch runs the grid's blocks one after another; each block's blockDim.x threads are host threads that
// share the block's dynamic shared memory. __syncthreads is a barrier of the block's threads and
// __shfl_xor_sync exchanges through a per-block buffer between two barriers (every use in the kernels is
// reached by all threads of the block, as CUDA requires for full-mask shuffles and barriers). Not a general
// CUDA emulator: one dimension, no atomics, no streams.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)  // the one shared array below is alignas(16) itself

typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
typedef void* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
template <typename F> inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int) { return cudaSuccess; }

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx, blockDim;

namespace dtmt_emu {

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const long gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  long gen_ = 0;
};

struct Block {
  Barrier* barrier = nullptr;
  std::vector<double>* exchange = nullptr;
};
inline thread_local Block block;

}  // namespace dtmt_emu

inline void __syncthreads() { dtmt_emu::block.barrier->wait(); }

template <typename T> inline T __shfl_xor_sync(unsigned, T v, int offset) {
  auto& ex = *dtmt_emu::block.exchange;
  const unsigned i = threadIdx.x;
  ex[i] = static_cast<double>(v);
  __syncthreads();
  const T r = static_cast<T>(ex[(i & ~31u) | ((i & 31u) ^ static_cast<unsigned>(offset))]);
  __syncthreads();
  return r;
}

// `extern __shared__ __align__(16) unsigned char smem_raw[]` inside the kernels (namespace dtmt::cuda) names
// this array.
namespace dtmt {
namespace cuda {
alignas(16) inline unsigned char smem_raw[1 << 20];
}  // namespace cuda
}  // namespace dtmt

namespace dtmt_emu {

template <typename Kernel, typename Arg>
inline void launch(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg) {
  if (smem > sizeof(dtmt::cuda::smem_raw)) throw std::runtime_error("emulated launch: too much shared memory");
  for (int b = 0; b < grid; ++b) {
    Barrier barrier(threads);
    std::vector<double> exchange(threads);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        threadIdx.x = t;
        blockIdx.x = b;
        blockDim.x = threads;
        block.barrier = &barrier;
        block.exchange = &exchange;
        kernel(arg);
      });
    }
    for (auto& th : pool) th.join();
  }
}

}  // namespace dtmt_emu
