// The phase clock of the persistent launches, marked in persistent_cuda_kernels.cuh and block_mma.cuh.
#pragma once

#if defined(DTMT_CUDA_EMULATION)
#include "cuda_emulation.h"
#else
#include <cuda_runtime.h>
#endif

namespace dtmt {
namespace cuda {

// Where a persistent launch's time goes, for benchmarks/phase_probe.cu only: built with DTMT_PERSISTENT_PHASES, each
// block's thread 0 adds the SM clock since the last mark to the phase a mark names (after a block barrier, so that
// the phase is the whole block's), and the block's totals go to dtmt_phase_cycles[block] at the end. Otherwise
// every mark is empty: the extension's kernels read no clock (tests/test_cuda_sources.py checks their PTX). Every
// thread of the block passes every mark (each is a block barrier in the probe). The barrier's phase is the wait of
// persistent_barrier (the slowest block's lag included): the work before a barrier is marked before it.
// Stage: block_dots' copies of the vectors into shared memory and their waits (stage_issue, stage_wait: with the
// chunks overlapped, what a chunk's copy takes beyond the sums before it), the rest of the FMA products being
// products; on tensor cores, block_mma's copies of both operands' chunks into its stages with the block barriers
// around them, its MMAs and the join of K's slices being products.
enum PersistentPhase : int {
  kPhaseSetup, kPhaseProducts, kPhaseStage, kPhaseElements, kPhaseNorm, kPhaseBarrier, kPhaseCount
};
constexpr int kPhaseMaxBlocks = 1024;
#if defined(DTMT_PERSISTENT_PHASES) && !defined(DTMT_CUDA_EMULATION)
__device__ long long dtmt_phase_cycles[kPhaseMaxBlocks][kPhaseCount];
struct PhaseClock {
  long long last, total[kPhaseCount];
};
__shared__ PhaseClock dtmt_phase_clock;
__device__ __forceinline__ void phase_begin() {
  if (threadIdx.x == 0) {
    for (int i = 0; i < kPhaseCount; ++i) dtmt_phase_clock.total[i] = 0;
    dtmt_phase_clock.last = clock64();
  }
}
__device__ __forceinline__ void phase_mark(int phase) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const long long now = clock64();
    dtmt_phase_clock.total[phase] += now - dtmt_phase_clock.last;
    dtmt_phase_clock.last = now;
  }
}
__device__ __forceinline__ void phase_end() {
  if (threadIdx.x == 0 && blockIdx.x < kPhaseMaxBlocks)
    for (int i = 0; i < kPhaseCount; ++i) dtmt_phase_cycles[blockIdx.x][i] = dtmt_phase_clock.total[i];
}
#else
__device__ __forceinline__ void phase_begin() {}
__device__ __forceinline__ void phase_mark(int) {}
__device__ __forceinline__ void phase_end() {}
#endif

}  // namespace cuda
}  // namespace dtmt
