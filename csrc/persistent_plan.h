// The persistent launches' envelope (issue 72 item 3; docs/design/persistent_recurrence.md, "The envelope"): the
// shared memory a block of the persistent forward and backward needs (persistent_cuda_kernels.cuh, block_mma.cuh),
// and whether a layer fits a device, from sizes alone. Plain arithmetic, compiled into the CUDA driver (which
// decides with it) and into the CPU extension (dtmt_kernels.persistent_plan: the same decision, stated in Python on
// any machine). Storage and accumulation types enter by their sizes: t_bytes (the stored matrix and state) and
// a_bytes (the accumulation type of the per-unit buffers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cell_math.h"

namespace dtmt {
namespace cuda {

// ---------------------------------------------------------------------------- block_mma's staging (block_mma.cuh)
constexpr int kMmaChunk = 64;                    // columns of K staged at a time (a multiple of 16)
constexpr int kMmaStageLd = kMmaChunk + 8;       // a staged row: 8 elements of padding (16 or 32 bytes)
DTMT_HD constexpr int round16(int v) { return (v + 15) / 16 * 16; }
DTMT_HD constexpr int round32(int v) { return (v + 31) / 32 * 32; }
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

// ---------------------------------------------------------------------------- block_dots' stage (FMA products)
// The FMA products read the vectors every output of a block shares (forward the state, backward the pre-activation
// gradients: B rows of K) from a stage in shared memory, filled by the whole block with many loads in flight,
// instead of each thread walking them in global memory, one L2 round trip after another
// (docs/design/persistent_recurrence.md, "The products' stage"). The stage takes the shared memory the matrices
// leave (`room`): whole rows, copied once, where they take at most kWholeStageBytes (small B: there a wait costs the
// copies' latency more than their bytes); else two buffers of up to half the room each, a multiple of 32 columns of
// every row and at most half a row (rounded up to 32), so that there are two chunks at least and each chunk after
// the first is copied into one buffer while the other's is summed; none where not even two of 32 columns fit (the
// products then read global memory). A staged row is `cols` values rounded up to 32 and at most 32 bytes more
// (stage_pitch: block_dots pads 16 or 32 bytes, so that the rows a warp reads together start 4 or 8 banks apart, as
// its lanes' columns need; the plan reserves 32): its pairs of values and its 16-byte copies stay aligned.
constexpr size_t kWholeStageBytes = 32 * 1024;
DTMT_HD constexpr int stage_pitch(int cols, size_t t_bytes, int pad_bytes = 32) {
  return round32(cols) + pad_bytes / static_cast<int>(t_bytes);
}
DTMT_HD int stage_columns(int B, int K, size_t t_bytes, size_t room) {
  if (B < 1 || K < 1) return 0;
  const size_t pad = static_cast<size_t>(stage_pitch(0, t_bytes)), whole = kWholeStageBytes / t_bytes / B,
               fits = room / t_bytes / B;   // values a row: whole rows' share, and the room's (with the pitch)
  if (static_cast<size_t>(K) <= whole && static_cast<size_t>(stage_pitch(K, t_bytes)) <= fits) return K;
  if (fits / 2 < pad + 32) return 0;
  const size_t cap = (fits / 2 - pad) / 32 * 32, half = static_cast<size_t>(round32((K + 1) / 2));
  const size_t cols = cap < half ? cap : half;
  return cols < static_cast<size_t>(K) ? static_cast<int>(cols) : K;
}
// The stage of `cols` columns for rows of K: one buffer of whole rows, or two of cols columns.
DTMT_HD size_t stage_bytes(int B, int K, int cols, size_t t_bytes) {
  return round_bytes(static_cast<size_t>(cols < K ? 2 : 1) * B * stage_pitch(cols, t_bytes) * t_bytes);
}
// The room a block's other buffers (`need` bytes) leave for the stage in `smem_optin` bytes, in whole 128 bytes.
DTMT_HD size_t stage_room(size_t smem_optin, size_t need) {
  return round_bytes(need) < smem_optin ? (smem_optin - round_bytes(need)) / 128 * 128 : 0;
}

// ------------------------------------------------------------------------------------ the kernels' shared memory
// The sub-cells' matrices a block holds: sub-cell k (0 the base cell, k >= 1 T-GRU k) has `subcell_rows` gate rows a
// unit. Forward, the block's rows of it: [rows][slice][matrix_pitch(H)]; backward, its columns:
// [slice][matrix_pitch(rows * H)]. A row of K values takes K rounded up to 32, and 8 more: consecutive rows start 8
// banks apart (4-byte values), so that up to 4 consecutive rows read at the same columns by L <= 4 lanes of 2
// consecutive columns each (block_dots' rounds) hit distinct banks (rows H + 1 long met 2- to 4-way conflicts;
// docs/design/persistent_recurrence.md, "Tiles of the FMA products"), and rows start 16-byte aligned. The first
// `resident` sub-cells stay in shared memory, one after another; the others (sub-cells resident..D) in the block's
// part of a spill buffer in global memory, read through L2 at each use (docs/design/persistent_recurrence.md, "Past
// shared memory: the L2").
// resident < 0: all D + 1.
DTMT_HD constexpr int subcell_rows(int kind, int k) { return k == 0 ? cell_hidden_rows(kind) : 3; }
DTMT_HD constexpr int resident_subcells(int D, int resident) { return resident < 0 || resident > D ? D + 1 : resident; }
DTMT_HD constexpr int matrix_pitch(int K) { return round32(K) + 8; }
DTMT_HD constexpr size_t forward_subcell_elems(int kind, int k, int H, int slice) {
  return static_cast<size_t>(subcell_rows(kind, k)) * slice * matrix_pitch(H);
}
DTMT_HD constexpr size_t backward_subcell_elems(int kind, int k, int H, int slice) {
  return static_cast<size_t>(slice) * matrix_pitch(subcell_rows(kind, k) * H);
}
// Elements of sub-cells [first, last) of one block, forward or backward.
DTMT_HD size_t subcell_elems(bool backward, int kind, int first, int last, int H, int slice) {
  size_t n = 0;
  for (int k = first; k < last; ++k)
    n += backward ? backward_subcell_elems(kind, k, H, slice) : forward_subcell_elems(kind, k, H, slice);
  return n;
}
// Bytes of the resident sub-cells' matrices in shared memory (a multiple of 16), and elements of the spilled ones a
// block (its part of the spill buffer; the buffer is grid x that).
DTMT_HD size_t resident_matrix_bytes(bool backward, int kind, int D, int H, int slice, size_t t_bytes, int resident) {
  return (subcell_elems(backward, kind, 0, resident_subcells(D, resident), H, slice) * t_bytes + 15) / 16 * 16;
}
DTMT_HD size_t spill_elems(bool backward, int kind, int D, int H, int slice, int resident) {
  return subcell_elems(backward, kind, resident_subcells(D, resident), D + 1, H, slice);
}

// Forward, a block of `slice` units: the resident matrices, then the pre-activations [B][4][slice] and the row
// statistics [B][3][2] (accumulation type) ...
DTMT_HD size_t forward_block_bytes(int kind, int D, int B, int H, int slice, size_t t_bytes, size_t a_bytes,
                                   int resident) {
  return resident_matrix_bytes(false, kind, D, H, slice, t_bytes, resident) +
         (static_cast<size_t>(B) * 4 * slice + static_cast<size_t>(B) * 3 * 2) * a_bytes;
}
// The stage read once a cluster (persistent_cuda_kernels.cuh's StageShare: blocks of a thread-block cluster copy
// their part of each chunk into every block's stage): two mbarriers and their phases' counts, after the stage.
constexpr size_t kStageShareBytes = 128;
DTMT_HD size_t stage_share_bytes(int multicast, int stage_cols) {
  return multicast > 1 && stage_cols > 0 ? kStageShareBytes : 0;
}

// ... then, at the next multiple of 128 bytes, the products' buffers: with `mma` block_mma's for products of the
// largest sub-cell's rows, else block_dots' stage of the state (B rows of `stage_cols` columns; none with 0), and
// where clusters of `multicast` blocks share it, its mbarriers.
DTMT_HD size_t persistent_forward_bytes(int kind, int D, int B, int H, int slice, size_t t_bytes, size_t a_bytes,
                                        bool mma = false, int threads = 0, int resident = -1, int stage_cols = 0,
                                        int multicast = 1) {
  const size_t bytes = forward_block_bytes(kind, D, B, H, slice, t_bytes, a_bytes, resident);
  const int widest = cell_hidden_rows(kind) > 3 || D == 0 ? cell_hidden_rows(kind) : 3;
  if (mma) return round_bytes(bytes) + mma_buffer_bytes(widest * slice, B, threads, t_bytes);
  return stage_cols > 0 ? round_bytes(bytes) + stage_bytes(B, H, stage_cols, t_bytes) +
                              stage_share_bytes(multicast, stage_cols)
                        : bytes;
}

// Backward: the resident matrices' columns, then 10 per-unit buffers [B][slice] (n and d three each, carry, cg,
// inner, gin) and the row statistics and sums [B][3][2] each ...
DTMT_HD size_t backward_block_bytes(int kind, int D, int B, int H, int slice, size_t t_bytes, size_t a_bytes,
                                    int resident) {
  return resident_matrix_bytes(true, kind, D, H, slice, t_bytes, resident) +
         (static_cast<size_t>(B) * 10 * slice + B * 12) * a_bytes;
}
// The longest gradient row a backward's U-path reads (a column's length: the base cell's n_h x H, a T-GRU's 3H).
DTMT_HD int backward_u_path_length(int kind, int D, int H) {
  return (cell_hidden_rows(kind) > 3 || D == 0 ? cell_hidden_rows(kind) : 3) * H;
}
// ... then, at the next multiple of 128 bytes, with `mma` block_mma's buffers for products of `slice` columns, else
// block_dots' stage of the gradients (B rows of `stage_cols` columns; none with 0).
DTMT_HD size_t persistent_backward_bytes(int kind, int D, int B, int H, int slice, size_t t_bytes, size_t a_bytes,
                                         bool mma = false, int threads = 0, int resident = -1, int stage_cols = 0,
                                         int multicast = 1) {
  const size_t bytes = backward_block_bytes(kind, D, B, H, slice, t_bytes, a_bytes, resident);
  if (mma) return round_bytes(bytes) + mma_buffer_bytes(slice, B, threads, t_bytes);
  return stage_cols > 0 ? round_bytes(bytes) + stage_bytes(B, backward_u_path_length(kind, D, H), stage_cols, t_bytes) +
                              stage_share_bytes(multicast, stage_cols)
                        : bytes;
}

// The FMA products' stage of a block's forward (or backward) in `smem_optin` bytes: the columns of each batch row
// (stage_columns) in the room the block's other buffers leave (stage_room). The plan's rule, and the driver's where a
// launch is asked for without a plan.
DTMT_HD int persistent_stage_columns(bool backward, int kind, int D, int B, int H, int slice, size_t t_bytes,
                                     size_t a_bytes, int resident, size_t smem_optin) {
  const size_t need = backward ? backward_block_bytes(kind, D, B, H, slice, t_bytes, a_bytes, resident)
                               : forward_block_bytes(kind, D, B, H, slice, t_bytes, a_bytes, resident);
  return stage_columns(B, backward ? backward_u_path_length(kind, D, H) : H, t_bytes, stage_room(smem_optin, need));
}

// ------------------------------------------------------------------------------------------- clusters of batch rows
// B batch rows shared out among at most `most` clusters (below 1: one): ceil(B / most) rows each, and as many clusters
// as leave none empty (groups x rows <= B + rows - 1); B 0 is one cluster of none. The plan's groups, the driver's
// (transition_cuda.cu's row_groups) and the launch's fewer, larger ones where the device holds fewer (regroup_rows).
struct RowSplit {
  int64_t groups, rows;
};
DTMT_HD RowSplit split_rows(int64_t B, int64_t most) {
  if (B < 1) return {1, 0};
  const int64_t clusters = most < 1 ? 1 : most < B ? most : B;
  const int64_t rows = (B + clusters - 1) / clusters;
  return {(B + rows - 1) / rows, rows};
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

// The largest sizes the plan takes: its sums stay within int (4 x H, 32-rounded), it runs in microseconds (a loop
// over the sub-cells a resident count), and no device holds more on chip. A layer past them gets no plan and runs
// per step; dtmt_kernels.persistent_plan refuses such sizes with their bound.
constexpr int kPlanMaxDepth = 64;
constexpr int kPlanMaxHidden = 1 << 20;
constexpr int kPlanMaxRows = 1 << 24;

// The most blocks one thread-block cluster may hold (Hopper, compute capability 9.0: 16 with the non-portable
// attribute, 8 portable); the cluster form of the persistent launches is clusters of at most this many blocks.
constexpr int kClusterMaxBlocks = 16;

// The spill buffers may take at most 1 / kSpillL2Share of the device's L2: the rest holds what passes through each
// step (the states, the products written, the layer-norm partials). A first choice, to be measured.
constexpr int kSpillL2Share = 2;

// Whether a layer fits the persistent launches on a device: one block per SM (at most one per hidden unit), each
// holding its share of every recurrent matrix plus its buffers in the shared memory a block may opt into; where the
// matrices do not all fit, the top sub-cells' (T-GRU D first) are read from L2 (a spill buffer in global memory),
// as many as needed and as the L2 budget allows (l2_bytes / kSpillL2Share in all; l2_bytes 0: none).
// (Co-residency also depends on registers: a launch the device still refuses falls back, see transition_cuda.cu.)
// The cluster form (cluster_blocks > 0; docs/design/persistent_recurrence.md, "One cluster" and "Clusters of batch
// rows"): thread-block clusters of at most cluster_blocks blocks (one per unit at most) instead of one block per SM,
// each cluster the whole layer for its own batch rows, its barrier the cluster's; as many clusters as the SMs hold and
// the batch's rows allow (`groups`, each ceil(B / groups) rows); the same kernels, the same arithmetic for the shared
// memory of a block of its slice and its rows.
struct PersistentPlan {
  int grid = 0, slice = 0;
  bool cluster = false;                              // thread-block clusters of `grid` blocks (else a grid of them)
  int groups = 1;                                    // the cluster form's clusters, each its own batch rows
  int multicast = 1;                                 // the grid form in clusters of this many blocks sharing the stage
  int forward_resident = 0, backward_resident = 0;   // sub-cells (of D + 1) whose matrices stay in shared memory
  size_t forward_bytes = 0, backward_bytes = 0;      // shared memory a block
  size_t forward_spill = 0, backward_spill = 0;      // bytes of the spill buffers (every block's), read through L2
  int forward_stage = 0, backward_stage = 0;         // FMA products: block_dots' stage, columns of each batch row
  bool fits = false;
};

// The stage read once a cluster (multicast > 1, the grid form with FMA products; docs/design/persistent_recurrence.md,
// "The stage read once a cluster"): the grid in thread-block clusters of `multicast` blocks, so its blocks a multiple
// of it (the most such grid up to the SMs whose slices leave no block empty), and the stage's mbarriers in each
// block's shared memory; where no such grid exists, or the products are on tensor cores, multicast is 1.
inline PersistentPlan persistent_plan(int kind, int D, int B, int H, size_t t_bytes, size_t a_bytes,
                                      int multiprocessors, size_t smem_optin, bool mma, int threads,
                                      size_t l2_bytes = 0, int cluster_blocks = 0, int multicast = 1) {
  PersistentPlan plan;
  plan.cluster = cluster_blocks > 0;
  const int most = !plan.cluster ? multiprocessors : cluster_blocks < kClusterMaxBlocks ? cluster_blocks
                                                                                       : kClusterMaxBlocks;
  const int blocks = most < H ? most : H;
  if (blocks < 1 || B < 1 || D < 0 || !base_cell(kind) || D > kPlanMaxDepth || H > kPlanMaxHidden ||
      B > kPlanMaxRows)
    return plan;   // (an unknown kind, or sizes past the plan's: no plan)
  plan.slice = (H + blocks - 1) / blocks;
  plan.grid = (H + plan.slice - 1) / plan.slice;
  int rows = B;   // a block's batch rows: the cluster form's clusters share the batch out
  if (plan.cluster) {
    const RowSplit split = split_rows(B, multiprocessors / plan.grid);
    rows = static_cast<int>(split.rows);
    plan.groups = static_cast<int>(split.groups);
  }
  if (!plan.cluster && !mma && multicast > 1 && multicast <= kClusterMaxBlocks) {
    for (int g = blocks / multicast * multicast; g >= multicast; g -= multicast) {
      const int slice = (H + g - 1) / g;
      if ((H + slice - 1) / slice == g) {   // (every block of the g owns units)
        plan.slice = slice;
        plan.grid = g;
        plan.multicast = multicast;
        break;
      }
    }
  }
  const size_t share = plan.multicast > 1 ? kStageShareBytes : 0;   // (the room the stage leaves its mbarriers)
  const size_t budget = l2_bytes / kSpillL2Share;
  plan.fits = true;
  for (int pass = 0; pass < 2; ++pass) {
    const bool backward = pass == 1;
    auto bytes = [&](int resident) {
      return backward
                 ? persistent_backward_bytes(kind, D, rows, H, plan.slice, t_bytes, a_bytes, mma, threads, resident)
                 : persistent_forward_bytes(kind, D, rows, H, plan.slice, t_bytes, a_bytes, mma, threads, resident);
    };
    auto spill = [&](int resident) {
      return static_cast<size_t>(plan.grid) * spill_elems(backward, kind, D, H, plan.slice, resident) * t_bytes;
    };
    int resident = D + 1;
    while (resident > 0 && bytes(resident) > smem_optin && spill(resident - 1) <= budget) --resident;
    const size_t need = bytes(resident);
    (backward ? plan.backward_resident : plan.forward_resident) = resident;
    (backward ? plan.backward_spill : plan.forward_spill) = spill(resident);
    plan.fits = plan.fits && need <= smem_optin;
    // FMA products: block_dots' stage in the shared memory the matrices leave (none where they leave too little)
    const int stage = mma || smem_optin < share
                          ? 0
                          : persistent_stage_columns(backward, kind, D, rows, H, plan.slice, t_bytes, a_bytes,
                                                     resident, smem_optin - share);
    (backward ? plan.backward_stage : plan.forward_stage) = stage;
    (backward ? plan.backward_bytes : plan.forward_bytes) =
        backward ? persistent_backward_bytes(kind, D, rows, H, plan.slice, t_bytes, a_bytes, mma, threads, resident,
                                             stage, plan.multicast)
                 : persistent_forward_bytes(kind, D, rows, H, plan.slice, t_bytes, a_bytes, mma, threads, resident,
                                            stage, plan.multicast);
  }
  return plan;
}

}  // namespace cuda
}  // namespace dtmt
