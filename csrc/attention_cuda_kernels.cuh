// CUDA kernels of one decoder step's additive attention (contract §4; the CPU kernels: attention_cpu.cpp), over raw
// pointers: the scores v·tanh(q + k) and the context Σ_s α_s values_s, forward and backward.
//
//   scores[b, h, s]  = Σ_d v[h, d] tanh(keys[b, s, h, d] + q[b, h, d])        keys [B, S, NH, D], q [B, NH, D]
//   dkeys[b, s, h, d] = g[b, h, s] v[h, d] (1 - t²),  t = tanh(keys + q)       (tanh recomputed, nothing saved)
//   dq[b, h, d]       = Σ_s dkeys[b, s, h, d]
//   dv_rows[b, h, d]  = Σ_s g[b, h, s] t                                        (dv: the rows summed by the driver)
//   context[b, c]     = Σ_s alpha[b, h, s] values[b, s, c]                      h = c / (C / NH)
//   dalpha[b, h, s]   = Σ_{c of head h} values[b, s, c] dcontext[b, c]
//   dvalues[b, s, c]  = alpha[b, h, s] dcontext[b, c]
//
// Reference PyTorch runs the scores as four passes over a [B, S, NH·D] tensor a step (add, tanh, multiply, sum) and
// keeps the tanh for backward; here the forward reads the keys once and keeps nothing, the backward reads them once
// more and writes their gradient. The reductions are in a fixed order (a warp's lanes then a fixed shuffle tree, or
// one thread's loop over s), so results are the same from run to run.
//
// Launch shapes, all blocks of kAttentionThreads threads or fewer, one grid dimension:
//   scores forward, context backward: a warp per (b, s, h), numbered (b·S + s)·NH + h, so that consecutive warps
//     read consecutive keys (values); its lanes walk d;
//   scores backward: a block per (b, h), its threads over d, each looping over s (dq, dv_rows in registers);
//   context forward: a block per (b, chunk of kAttentionThreads columns), a thread per column looping over s.
// Every thread of a block reaches each warp shuffle (the emulation's shuffles are block barriers).
//
// Self-contained but for transition_cuda_kernels.cuh (its launch macro, warp_sum and the emulation switch) and
// cell_math.h's dt_tanh (the one tanh of the CPU and CUDA kernels), so it compiles standalone with nvcc -c.
// Types: float and double (the accumulation type is the storage type; 16-bit attention runs float32 under autocast,
// as on the CPU: dtmt_kernels/ops/_autocast.py).
#pragma once

#include <cstdint>

#include "transition_cuda_kernels.cuh"

namespace dtmt {
namespace cuda {

constexpr int kAttentionThreads = 256;
constexpr int kAttentionWarps = kAttentionThreads / 32;

template <typename A> struct ScoresArgs {
  const A* keys;  // [B, S, NH, D]
  const A* q;     // [B, NH, D]
  const A* v;     // [NH, D]
  A* out;         // [B, NH, S]
  int B, S, NH, D;
};

template <typename A> struct ScoresBackwardArgs {
  const A* grad;  // [B, NH, S]
  const A* keys;
  const A* q;
  const A* v;
  A* dkeys;    // [B, S, NH, D]
  A* dq;       // [B, NH, D]
  A* dv_rows;  // [B, NH, D]
  int B, S, NH, D;
};

template <typename A> struct ContextArgs {
  const A* alpha;   // [B, NH, S]
  const A* values;  // [B, S, C], element (b, s, c) at b·sb + s·ss + c
  A* out;           // [B, C]
  int B, S, NH, C;
  int64_t sb, ss;
};

template <typename A> struct ContextBackwardArgs {
  const A* grad;  // [B, C]
  const A* alpha;
  const A* values;
  A* dalpha;   // [B, NH, S]
  A* dvalues;  // [B, S, C] at b·dsb + s·dss + c, or null (no values' gradient)
  int B, S, NH, C;
  int64_t sb, ss, dsb, dss;
};

// The warp of this thread among the grid's, and its lane.
__device__ __forceinline__ int64_t grid_warp() {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

template <typename A> __global__ void scores_forward_kernel(ScoresArgs<A> p) {
  const int lane = threadIdx.x & 31;
  const int64_t w = grid_warp();
  const bool live = w < static_cast<int64_t>(p.B) * p.S * p.NH;
  const int64_t h = live ? w % p.NH : 0, bs = live ? w / p.NH : 0;
  A acc = A(0);
  if (live) {
    const int64_t b = bs / p.S;
    const A* k = p.keys + w * p.D;
    const A* q = p.q + (b * p.NH + h) * p.D;
    const A* v = p.v + h * p.D;
    for (int d = lane; d < p.D; d += 32) acc += v[d] * dt_tanh(k[d] + q[d]);
  }
  acc = warp_sum(acc);
  if (live && lane == 0) {
    const int64_t b = bs / p.S, s = bs % p.S;
    p.out[(b * p.NH + h) * p.S + s] = acc;
  }
}

template <typename A> __global__ void scores_backward_kernel(ScoresBackwardArgs<A> p) {
  const int64_t bh = blockIdx.x, b = bh / p.NH, h = bh % p.NH;
  const A* g = p.grad + bh * p.S;
  for (int d = threadIdx.x; d < p.D; d += blockDim.x) {
    const A qd = p.q[bh * p.D + d], vd = p.v[h * p.D + d];
    A dq = A(0), dv = A(0);
    for (int s = 0; s < p.S; ++s) {
      const int64_t i = ((b * p.S + s) * p.NH + h) * p.D + d;
      const A t = dt_tanh(p.keys[i] + qd);
      const A gs = g[s];
      const A dk = gs * vd * (A(1) - t * t);
      p.dkeys[i] = dk;
      dq += dk;
      dv += gs * t;
    }
    p.dq[bh * p.D + d] = dq;
    p.dv_rows[bh * p.D + d] = dv;
  }
}

template <typename A> __global__ void context_forward_kernel(ContextArgs<A> p) {
  const int chunks = (p.C + blockDim.x - 1) / blockDim.x;
  const int64_t b = blockIdx.x / chunks;
  const int c = (blockIdx.x % chunks) * blockDim.x + threadIdx.x;
  if (c >= p.C) return;
  const A* a = p.alpha + (b * p.NH + c / (p.C / p.NH)) * p.S;
  const A* v = p.values + b * p.sb + c;
  A acc = A(0);
  for (int s = 0; s < p.S; ++s) acc += a[s] * v[s * p.ss];
  p.out[b * p.C + c] = acc;
}

template <typename A> __global__ void context_backward_kernel(ContextBackwardArgs<A> p) {
  const int lane = threadIdx.x & 31;
  const int64_t w = grid_warp();
  const bool live = w < static_cast<int64_t>(p.B) * p.S * p.NH;
  const int Dc = p.C / p.NH;
  const int64_t h = live ? w % p.NH : 0, bs = live ? w / p.NH : 0;
  const int64_t b = bs / p.S, s = bs % p.S;
  A acc = A(0);
  if (live) {
    const A* g = p.grad + b * p.C + h * Dc;
    const A* v = p.values + b * p.sb + s * p.ss + h * Dc;
    const A a = p.alpha[(b * p.NH + h) * p.S + s];
    A* dv = p.dvalues != nullptr ? p.dvalues + b * p.dsb + s * p.dss + h * Dc : nullptr;
    for (int d = lane; d < Dc; d += 32) {
      const A gd = g[d];
      acc += v[d] * gd;
      if (dv != nullptr) dv[d] = a * gd;
    }
  }
  acc = warp_sum(acc);
  if (live && lane == 0) p.dalpha[(b * p.NH + h) * p.S + s] = acc;
}

// ---------------------------------------------------------------------------------------------- launch
// Threads of a block that loops over n values of a row: n rounded up to a warp, at most kAttentionThreads.
inline int attention_threads(int n) {
  const int t = ((n + 31) / 32) * 32;
  return t < 32 ? 32 : (t > kAttentionThreads ? kAttentionThreads : t);
}
// Blocks of kAttentionWarps warps for one warp an output (the driver keeps the count within an int).
inline int warp_blocks(int64_t warps) { return static_cast<int>((warps + kAttentionWarps - 1) / kAttentionWarps); }

// A launch of `grid` blocks (none for an empty grid: nothing to compute), then the launch's error.
template <typename Kernel, typename Args>
cudaError_t launch_blocks(Kernel* kernel, int grid, int threads, const Args& p, cudaStream_t stream) {
  if (grid == 0) return cudaSuccess;
  DTMT_LAUNCH(kernel, grid, threads, 0, stream, p);
  return cudaGetLastError();
}

template <typename A> cudaError_t launch_scores_forward(const ScoresArgs<A>& p, cudaStream_t stream) {
  return launch_blocks(&scores_forward_kernel<A>, warp_blocks(static_cast<int64_t>(p.B) * p.S * p.NH),
                       kAttentionThreads, p, stream);
}

template <typename A> cudaError_t launch_scores_backward(const ScoresBackwardArgs<A>& p, cudaStream_t stream) {
  return launch_blocks(&scores_backward_kernel<A>, p.B * p.NH, attention_threads(p.D), p, stream);
}

template <typename A> cudaError_t launch_context_forward(const ContextArgs<A>& p, cudaStream_t stream) {
  const int threads = attention_threads(p.C);
  return launch_blocks(&context_forward_kernel<A>, p.B * ((p.C + threads - 1) / threads), threads, p, stream);
}

template <typename A> cudaError_t launch_context_backward(const ContextBackwardArgs<A>& p, cudaStream_t stream) {
  return launch_blocks(&context_backward_kernel<A>, warp_blocks(static_cast<int64_t>(p.B) * p.S * p.NH),
                       kAttentionThreads, p, stream);
}

}  // namespace cuda
}  // namespace dtmt
