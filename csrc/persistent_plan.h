// The persistent launches' envelope (issue 72 item 3; docs/design/persistent_recurrence.md, "The envelope"): the
// shared memory a block of the persistent forward and backward needs (persistent_cuda_kernels.cuh, block_mma.cuh),
// and whether a layer fits a device, from sizes alone. Plain arithmetic, compiled into the CUDA driver (which
// decides with it) and into the CPU extension (dtmt_kernels.persistent_plan: the same decision, stated in Python on
// any machine). Storage and accumulation types enter by their sizes: t_bytes (the stored matrix and state) and
// a_bytes (the accumulation type of the per-unit buffers).
#pragma once

#include <cstddef>

#include "cell_math.h"

namespace dtmt {
namespace cuda {

// ---------------------------------------------------------------------------- block_mma's staging (block_mma.cuh)
constexpr int kMmaChunk = 64;                    // columns of K staged at a time (a multiple of 16)
constexpr int kMmaStageLd = kMmaChunk + 8;       // a staged row: 8 elements of padding (16 or 32 bytes)
DTMT_HD constexpr int round16(int v) { return (v + 15) / 16 * 16; }
DTMT_HD constexpr size_t round_bytes(size_t v) { return (v + 127) / 128 * 128; }

// Batch rows a pass of block_mma stages: at most one 16-row tile per warp, plus one (a pass's tiles may straddle two).
DTMT_HD int mma_stage_rows(int B, int warps) {
  const int cap = 16 * (warps + 1);
  return round16(B) < cap ? round16(B) : cap;
}

// Bytes of the buffers block_mma uses for products of up to M rows and B batch rows by `threads` threads: the float
// result, then the two stages of t_bytes elements (each part a multiple of 128 bytes, so every tile is 32-byte
// aligned on a 128-byte aligned base).
DTMT_HD size_t mma_buffer_bytes(int M, int B, int threads, size_t t_bytes) {
  const size_t c = round_bytes(static_cast<size_t>(round16(B)) * round16(M) * sizeof(float));
  const size_t sa = round_bytes(static_cast<size_t>(round16(M)) * kMmaStageLd * t_bytes);
  const size_t sb = round_bytes(static_cast<size_t>(mma_stage_rows(B, threads / 32)) * kMmaStageLd * t_bytes);
  return c + sa + sb;
}

// ------------------------------------------------------------------------------------ the kernels' shared memory
// Forward, a block of `slice` units: the matrix rows (each H + 1 long: consecutive rows start in different banks),
// then the pre-activations [B][4][slice] and the row statistics [B][3][2] (accumulation type); with `mma`, at the
// next multiple of 128 bytes, block_mma's buffers for products of the largest sub-cell's rows.
DTMT_HD size_t persistent_forward_bytes(int kind, int D, int B, int H, int slice, size_t t_bytes, size_t a_bytes,
                                        bool mma = false, int threads = 0) {
  const size_t rows = static_cast<size_t>(cell_hidden_rows(kind) + 3 * D) * slice;
  const size_t matrix = (rows * (H + 1) * t_bytes + 15) / 16 * 16;
  const size_t bytes = matrix + (static_cast<size_t>(B) * 4 * slice + static_cast<size_t>(B) * 3 * 2) * a_bytes;
  if (!mma) return bytes;
  const int widest = cell_hidden_rows(kind) > 3 || D == 0 ? cell_hidden_rows(kind) : 3;
  return round_bytes(bytes) + mma_buffer_bytes(widest * slice, B, threads, t_bytes);
}

// Backward: the matrix columns, then 10 per-unit buffers [B][slice] (n and d three each, carry, cg, inner, gin) and
// the row statistics and sums [B][3][2] each; with `mma`, at the next multiple of 128 bytes, block_mma's buffers for
// products of `slice` columns.
DTMT_HD size_t persistent_backward_bytes(int kind, int D, int B, int H, int slice, size_t t_bytes, size_t a_bytes,
                                         bool mma = false, int threads = 0) {
  const size_t matrix = static_cast<size_t>(slice) * (cell_hidden_rows(kind) * H + 1) +
                        static_cast<size_t>(D) * slice * (3 * H + 1);
  const size_t bytes = (matrix * t_bytes + 15) / 16 * 16 + (static_cast<size_t>(B) * 10 * slice + B * 12) * a_bytes;
  return mma ? round_bytes(bytes) + mma_buffer_bytes(slice, B, threads, t_bytes) : bytes;
}

// ------------------------------------------------------------------------------------------- tensor cores or FMA
// Whether the persistent products run on tensor cores (block_mma.cuh), for storage of t_bytes a value: 16-bit always
// (f16 / bf16 MMA, float accumulation: the FMA products' math), float where TF32 is allowed in matmuls, double
// never; and only on devices of compute capability 8.0 and up. The driver (persistent_mma) and
// dtmt_kernels.persistent_plan both decide with it.
inline bool persistent_tensor_cores(size_t t_bytes, bool tf32_allowed, int capability_major) {
  if (capability_major < 8 || t_bytes == 8) return false;
  return t_bytes == 2 || tf32_allowed;
}

// ---------------------------------------------------------------------------------------------- the envelope
// Threads a block of the persistent launches (8 warps): a first choice, to be measured.
constexpr int kPersistentThreads = 256;

// Whether a layer fits the persistent launches on a device: one block per SM (at most one per hidden unit), each
// holding its share of every recurrent matrix plus its buffers in the shared memory a block may opt into.
// (Co-residency also depends on registers: a launch the device still refuses falls back, see transition_cuda.cu.)
struct PersistentPlan {
  int grid = 0, slice = 0;
  size_t forward_bytes = 0, backward_bytes = 0;
  bool fits = false;
};

inline PersistentPlan persistent_plan(int kind, int D, int B, int H, size_t t_bytes, size_t a_bytes,
                                      int multiprocessors, size_t smem_optin, bool mma, int threads) {
  PersistentPlan plan;
  const int blocks = multiprocessors < H ? multiprocessors : H;
  if (blocks < 1 || B < 1 || !base_cell(kind)) return plan;   // (an unknown kind: no plan)
  plan.slice = (H + blocks - 1) / blocks;
  plan.grid = (H + plan.slice - 1) / plan.slice;
  plan.forward_bytes = persistent_forward_bytes(kind, D, B, H, plan.slice, t_bytes, a_bytes, mma, threads);
  plan.backward_bytes = persistent_backward_bytes(kind, D, B, H, plan.slice, t_bytes, a_bytes, mma, threads);
  plan.fits = plan.forward_bytes <= smem_optin && plan.backward_bytes <= smem_optin;
  return plan;
}

}  // namespace cuda
}  // namespace dtmt
