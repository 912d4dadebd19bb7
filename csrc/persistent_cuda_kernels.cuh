// The persistent forward kernel of one deep transition layer and direction (issue 72, item 2; design note
// docs/design/persistent_recurrence.md): one cooperative launch loops over all T steps and all D + 1 sub-cells,
// instead of a GEMM and a fused kernel per sub-cell and step (transition_cuda_kernels.cuh).
//
// Block b of the G blocks owns the hidden units [b*S, min(H, (b+1)*S)), S = ceil(H / G): its rows of every
// sub-cell's recurrent matrix (base U: NH gates x S rows; each T-GRU: 3 x S) are copied into shared memory once and
// stay there for the whole sequence (where they do not all fit, the top sub-cells' go to the block's part of a spill
// buffer in global memory instead, read through L2: persistent_plan.h's `resident`). A sub-cell of a step is:
//   1. products: hp[b, q*H + j] = U[q*H + j, :] . h[b, :] for the block's rows, every batch row, h read whole from
//      global memory (the state the previous sub-cell wrote: a grid barrier lies between);
//   2. gate pre-activations a = hp + b_hh (+ x W_ih + b_ih) for the block's units; with layer norm, each block's
//      (mean, M2) over its units per row and gate go to global memory, a grid barrier, and the G of them are joined
//      in a fixed order (Chan's formula: deterministic, the same in every block): by every block, or at larger B
//      shared out over the blocks, another grid barrier, and read by all (join_pairs);
//   3. the cell's elementwise update (cell_math.h, as the step kernels), candidate dropout, and at the last
//      sub-cell the length mask: the new state of the block's units to global memory; a grid barrier.
// So (D + 1) x (1 + layer norm) grid barriers a step (one more a layer norm where its join is shared out). The cluster form (args.cluster) is the same kernel launched as
// one thread-block cluster of at most 16 blocks on Hopper, each barrier the cluster's instead of the grid's. The
// outputs and saved tensors are exactly those of the per-step forward (transition_cuda.cu's forward_impl: out, h_n,
// hs, hs_lp, hp, hpt), so its backward runs on them unchanged. Products, rounded to T as the per-step GEMM's output
// is: on tensor cores where the args say `mma` (block_mma.cuh: TF32 for float storage where torch allows it, f16 /
// bf16 for 16-bit storage), else FMA in the accumulation type A over the GEMM dtype T (the stored state and matrix;
// block_dots).
//
// Compiles with nvcc (host and device) and, with DTMT_CUDA_EMULATION, with a host compiler on the fibers of
// tests/cuda_emulation.h (launch_cooperative: blocks of a grid, each with its own shared memory).
#pragma once

#include "block_mma.cuh"
#include "persistent_phases.cuh"
#include "persistent_plan.h"
#include "transition_cuda_kernels.cuh"

#include <cstdint>
#include <type_traits>

#if defined(DTMT_CUDA_EMULATION)
#define DTMT_DYNAMIC_SMEM(name) unsigned char* name = ::dtmt_emu::dynamic_smem()
#else
#include <cooperative_groups.h>
#include <cuda_pipeline.h>
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include <cuda/ptx>
#endif

#include <mutex>
#define DTMT_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
// Copies from global into shared memory without registers, all of a thread's in flight at once (cp.async: compute
// capability 8.0 and up; tests/cuda_emulation.h makes each at its wait)
#if defined(DTMT_CUDA_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define DTMT_ASYNC_COPY 1
#endif
// Bulk copies multicast to the blocks of a cluster, counted by mbarriers (cp.async.bulk ... multicast::cluster: code
// for sm_90a, where PTX has it; tests/cuda_emulation.h emulates them): the stage read once a cluster (StageShare)
#if defined(DTMT_CUDA_EMULATION) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DTMT_STAGE_MULTICAST 1
#endif

namespace dtmt {
namespace cuda {

// The barrier between dependent phases of a persistent launch, which also orders the global memory written before it
// before what is read after it, in every block: the grid's (a cooperative launch, one block per SM), or in the
// cluster form the cluster's (the launch is one thread-block cluster: barrier.cluster.arrive.release /
// wait.acquire, compute capability 9.0 and up; the driver launches that form on such devices only). Its wait is the
// barrier phase of the phase clock.
__device__ __forceinline__ void persistent_barrier(bool cluster) {
#if defined(DTMT_CUDA_EMULATION)
  if (cluster) {
    ::dtmt_emu::cluster_sync();
  } else {
    ::dtmt_emu::grid_sync();
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster) {
    ::cooperative_groups::this_cluster().sync();
  } else {
    ::cooperative_groups::this_grid().sync();
  }
#else
  if (cluster) __trap();   // code compiled below sm_90 has no cluster barrier: launch_persistent refuses such a launch
  ::cooperative_groups::this_grid().sync();
#endif
  phase_mark(kPhaseBarrier);
}


// The units this block owns: H units in slices of S, the block of rank b in its group (below) the slice from
// j0 = b * S, of n units (S, or fewer for the last block).
struct BlockUnits {
  int j0, n;
};
__device__ __forceinline__ BlockUnits block_units(int H, int S, int rank) {
  const int j0 = rank * S;
  return {j0, j0 + S <= H ? S : H - j0};
}

// The blocks that share a layer's units and its barrier: the whole grid, or in the cluster form one thread-block
// cluster of `blocks` consecutive blocks, each cluster its own rows of the batch (select_rows;
// docs/design/persistent_recurrence.md, "Clusters of batch rows"). rank: this block's place among them.
struct BlockGroup {
  int rank, blocks;
};
__device__ __forceinline__ BlockGroup block_group(int blocks) {
  return {static_cast<int>(blockIdx.x) % blocks, blocks};
}

template <typename T, typename A> struct PersistentForwardArgs {
  const T* xp;      // [T, B, NIN*H] input pre-activations x W_ih^T + b_ih
  const T* w_hh;    // [NH*H, H] base recurrent matrix
  const T* b_hh;    // [NH*H]
  const T* ln_w;    // [NG*H] base layer-norm gains, or nullptr
  const T* ln_b;    // [NG*H]
  const T* t_w;     // [D, 3H, H] T-GRU recurrent matrices
  const T* t_b;     // [D, 3H]
  const T* t_ln_w;  // [D, 2H], or nullptr
  const T* t_ln_b;  // [D, 2H]
  const T* drop;    // [D+1, B, H] candidate-dropout multipliers, or nullptr
  const T* mask;    // [T, B] 1 valid / 0 padded, or nullptr (all valid)
  A* hs;            // [D+1, T, B, H] each sub-cell's input state; hs[0][first step] = h0, written by the caller
  T* hs_lp;         // the same in T (the products' input), or nullptr where T is A
  T* hp;            // [T, B, NH*H] base recurrent products (no bias)
  T* hpt;           // [D, T, B, 3H] T-GRU recurrent products
  T* out;           // [T, B, H]
  A* h_last;        // [B, H] the state after the last step
  A* partials;      // [groups][G + 1, B, 3, 2] layer-norm partial statistics (G = blocks), the last the joined ones
  T* spill;         // [grid, spill_elems] the rows of sub-cells resident..D (persistent_plan.h), or nullptr (none)
  int steps, B, H, D, slice;
  int ldb;          // the batch rows of the tensors above (their row stride; 0: B); B: the rows of one group
                    // (select_rows)
  int blocks;       // the blocks that share the units (a group): a cluster's in the cluster form (0: the grid)
  int resident;     // sub-cells whose rows stay in shared memory (< 0: all D + 1)
  bool reverse;
  bool mma;         // products on tensor cores (block_mma.cuh; T has an MMA and the device compiled it)
  int stage_cols;   // else (FMA) block_dots' stage of the state: columns of each batch row at a time, 0 none (the
                    // plan's, in the shared memory the matrices leave; the buffers of block_mma or the stage,
                    // persistent_forward_bytes)
  bool cluster;     // the launch is thread-block clusters, each a group: its barrier is the cluster's
                    // (persistent_barrier)
  int multicast;    // else: the grid in thread-block clusters of this many blocks that read the stage once
                    // (StageShare; 1 or 0: none)
  A eps;
};

// The batch rows of this block's group: in the cluster form with several clusters, cluster g takes rows
// [g B, min(ldb, (g + 1) B)) (B, the launch's rows a group; docs/design/persistent_recurrence.md, "Clusters of batch
// rows"), else the one group all of them; rows 0 where the last clusters have none left.
struct RowGroup {
  int index, first, rows;
};
__device__ __forceinline__ RowGroup row_group(int B, int ldb, int blocks) {
  const int g = static_cast<int>(blockIdx.x) / blocks, first = g * B;
  return {g, first, first < ldb ? (ldb - first < B ? ldb - first : B) : 0};
}
// p moved by `rows` rows of `width` values (nullptr stays nullptr)
template <typename P> __device__ __forceinline__ void shift_rows(P*& p, size_t rows, size_t width) {
  if (p != nullptr) p += rows * width;
}
// The mask's row of step t ([B], rows ldb apart from one step to the next), or nullptr (every row valid).
template <typename T> __device__ __forceinline__ const T* step_mask(const T* mask, int t, int ldb) {
  return mask != nullptr ? mask + static_cast<size_t>(t) * ldb : nullptr;
}

// This block's group of batch rows (row_group) in a launch's arguments p (forward or backward): p.blocks and p.ldb
// given their defaults (the grid; B), p.partials moved to the group's own `sets` sets of them ([G + 1, B, 3, 2] a
// set), p.B its rows. What both select_rows share.
template <typename Args> __device__ __forceinline__ RowGroup enter_row_group(Args& p, int sets) {
  if (p.blocks <= 0) p.blocks = static_cast<int>(gridDim.x);
  if (p.ldb <= 0) p.ldb = p.B;
  const RowGroup g = row_group(p.B, p.ldb, p.blocks);
  p.partials += static_cast<size_t>(g.index) * sets * (p.blocks + 1) * p.B * 3 * 2;
  p.B = g.rows;
  return g;
}

// The forward's arguments for this block's group of batch rows (enter_row_group): the row-indexed tensors from its
// first row (their rows still ldb apart), the partials its own, B its rows. Returns false where it has none.
template <int KIND, typename T, typename A>
__device__ __forceinline__ bool select_rows(PersistentForwardArgs<T, A>& p) {
  constexpr int NIN = Rows<KIND>::in, NH = Rows<KIND>::hid;
  const RowGroup g = enter_row_group(p, 1);
  const size_t r = static_cast<size_t>(g.first), H = static_cast<size_t>(p.H);
  shift_rows(p.xp, r, NIN * H);
  shift_rows(p.drop, r, H);
  shift_rows(p.mask, r, 1);
  shift_rows(p.hs, r, H);
  shift_rows(p.hs_lp, r, H);
  shift_rows(p.hp, r, NH * H);
  shift_rows(p.hpt, r, 3 * H);
  shift_rows(p.out, r, H);
  shift_rows(p.h_last, r, H);
  return g.rows > 0;
}

// Where sub-cell k's matrix lies for this block (persistent_plan.h's layout; forward: its rows [rows][S][P(H)],
// backward: its columns [S][P(rows * H)], P = matrix_pitch): the first r (resident) sub-cells one after another in
// shared memory (`smem`), the others in this block's part of the spill buffer (global memory, read through L2 at
// each use; the part of its rank in its group: the clusters of batch rows share one buffer, each cluster's block of
// rank b writing the same values into part b before its first read, and reading them through L2 at every step).
// Two functions rather than one that chooses: a product whose rows come from the first keeps the compiler's
// knowledge that they are in shared memory (shared loads in its inner loop, not generic ones).
template <typename T>
__device__ __forceinline__ T* resident_matrix(bool backward, int kind, int H, int S, int k, T* smem) {
  return smem + subcell_elems(backward, kind, 0, k, H, S);
}
template <typename T>
__device__ __forceinline__ T* spilled_matrix(bool backward, int kind, int D, int H, int S, int r, int k, T* spill,
                                             int rank) {
  return spill + static_cast<size_t>(rank) * spill_elems(backward, kind, D, H, S, r) +
         subcell_elems(backward, kind, r, k, H, S);
}

// What join_blocks joins: a (count, mean, M2) of values (Chan's formula joins two, `a` the values before `b`'s),
// or two sums (joined by adding); each with its warp shuffle.
template <typename A> struct Moments {
  using Value = A;
  A count, mean, m2;
};
template <typename A> __device__ __forceinline__ Moments<A> join(const Moments<A>& a, const Moments<A>& b) {
  if (b.count == A(0)) return a;
  if (a.count == A(0)) return b;
  const A total = a.count + b.count, delta = b.mean - a.mean;
  return {total, a.mean + delta * b.count / total, a.m2 + b.m2 + delta * delta * a.count * b.count / total};
}
template <typename A> __device__ __forceinline__ Moments<A> shfl_xor(const Moments<A>& v, int off) {
  return {__shfl_xor_sync(0xffffffffu, v.count, off), __shfl_xor_sync(0xffffffffu, v.mean, off),
          __shfl_xor_sync(0xffffffffu, v.m2, off)};
}
template <typename A> struct Sums {
  using Value = A;
  A s1, s2;
};
template <typename A> __device__ __forceinline__ Sums<A> join(const Sums<A>& a, const Sums<A>& b) {
  return {a.s1 + b.s1, a.s2 + b.s2};
}
template <typename A> __device__ __forceinline__ Sums<A> shfl_xor(const Sums<A>& v, int off) {
  return {__shfl_xor_sync(0xffffffffu, v.s1, off), __shfl_xor_sync(0xffffffffu, v.s2, off)};
}

// Every block's partials of every (batch row, group) pair joined across the G blocks, the same bits in every block:
// a warp a pair, lane l joining blocks l, l + 32, ... in order (part(blk, pair) gives one), then the lanes in a fixed
// tree (at each level the lower lane's first, so the two lanes of a join compute the same bits), and store(pair,
// all) by lane 0. Before, one thread joined all G in turn: a chain of G loads from L2, each waiting on the last,
// with at most B x 3 threads of a block busy (docs/design/persistent_recurrence.md, "The layer-norm join"). Every
// thread takes the same passes (the shuffles need whole warps).
// The pairs joined are first, first + step, ... below `pairs` (0, 1: all of them; a spread join: this block's share).
constexpr int kJoinLoads = 5;   // a lane's loads in flight at once (up to 160 blocks in one round: an H100 has 132 SMs)
template <typename V, typename Part, typename Store>
__device__ __forceinline__ void join_blocks(int pairs, int first_pair, int step, int G, Part part, Store store) {
  const int warps = static_cast<int>(blockDim.x) / 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int mine = first_pair < pairs ? (pairs - first_pair + step - 1) / step : 0;
  const int passes = (mine + warps - 1) / warps;
  for (int pass = 0; pass < passes; ++pass) {
    const int i = pass * warps + warp, pair = first_pair + i * step;
    V acc{};
    if (i < mine)
      for (int first = lane; first < G; first += 32 * kJoinLoads) {   // (the loads first, then the joins in order)
        V parts[kJoinLoads];
#pragma unroll
        for (int u = 0; u < kJoinLoads; ++u)
          if (first + 32 * u < G) parts[u] = part(first + 32 * u, pair);
#pragma unroll
        for (int u = 0; u < kJoinLoads; ++u)
          if (first + 32 * u < G) acc = join(acc, parts[u]);
      }
    for (int off = 1; off < 32; off <<= 1) {
      const V other = shfl_xor(acc, off);
      acc = lane & off ? join(other, acc) : join(acc, other);
    }
    if (i < mine && lane == 0) store(pair, acc);
  }
}

// Whether the blocks share the join of `pairs` pairs out (spread_join) instead of each joining all of them: where
// each would take kSpreadJoinPasses passes or more. A spread join costs one more barrier; the whole join, a block's
// passes over all pairs: at B = 64 the deep transition's statistics took 190 of a step's 345 µs on an H200, each
// block joining 192 pairs of 132 partials (docs/design/persistent_recurrence.md, "The layer-norm join").
constexpr int kSpreadJoinPasses = 4;
__device__ __forceinline__ bool spread_join_pays(int pairs) {
  const int warps = static_cast<int>(blockDim.x) / 32;
  return (pairs + warps - 1) / warps >= kSpreadJoinPasses;
}

// The pairs' joins, the same bits in every block, into `local` (local(pair, all): this block's shared memory):
// spread, the block of rank b joins pairs b, b + G, ... (G: the group's blocks) and writes them to `joined`
// (global memory, `width` values a pair: put(pair, all, out) writes them, get(pair, in) reads them into local), a
// barrier, and every block reads all of them; else every block joins every pair itself. The barrier is `cluster`'s
// (persistent_barrier).
template <typename V, typename Part, typename Put, typename Get, typename Local>
__device__ __forceinline__ void join_pairs(int pairs, Part part, typename V::Value* joined, int width, Put put,
                                          Get get, Local local, BlockGroup group, bool cluster) {
  if (spread_join_pays(pairs)) {
    join_blocks<V>(pairs, group.rank, group.blocks, group.blocks, part,
                   [&](int pair, const V& all) { put(pair, all, joined + static_cast<size_t>(pair) * width); });
    phase_mark(kPhaseNorm);
    persistent_barrier(cluster);
    for (int pair = threadIdx.x; pair < pairs; pair += blockDim.x) get(pair, joined + static_cast<size_t>(pair) * width);
  } else {
    join_blocks<V>(pairs, 0, 1, group.blocks, part, local);
  }
}

// The (mean, 1/std) of every batch row's gate groups over all H units, in every block alike: this block's (mean, M2)
// over its n units go to `partials` [G + 1, B, 3, 2] (G: the group's blocks), a barrier, then the G of them are
// joined (join_pairs:
// Chan's formula in a fixed order, deterministic; spread over the blocks through the last slot of `partials` where
// that pays). v: [B][slots][S] pre-activations; stats: [B][3][2]. Ends with a block barrier (stats read by other
// threads). `cluster`: the launch's barrier (persistent_barrier).
template <typename A>
__device__ void gate_statistics(const A* v, int slots, int NG, int B, int H, int S, int n, A eps, A* partials,
                                A* stats, BlockGroup group, bool cluster) {
  for (int e = threadIdx.x; e < B * NG; e += blockDim.x) {
    const int b = e / NG, g = e % NG;
    const A* row = v + (b * slots + g) * S;
    A mean = A(0);
    for (int jj = 0; jj < n; ++jj) mean += row[jj];
    mean /= A(n);
    A m2 = A(0);
    for (int jj = 0; jj < n; ++jj) m2 += (row[jj] - mean) * (row[jj] - mean);
    A* out = partials + ((static_cast<size_t>(group.rank) * B + b) * 3 + g) * 2;
    out[0] = mean;
    out[1] = m2;
  }
  phase_mark(kPhaseNorm);
  persistent_barrier(cluster);
  // pair e: batch row e / NG, group e % NG
  join_pairs<Moments<A>>(
      B * NG,
      [&](int blk, int e) {
        const A* in = partials + ((static_cast<size_t>(blk) * B + e / NG) * 3 + e % NG) * 2;
        return Moments<A>{A(blk * S + S <= H ? S : H - blk * S), in[0], in[1]};
      },
      partials + static_cast<size_t>(group.blocks) * B * 3 * 2, 2,
      [&](int, const Moments<A>& all, A* out) {
        out[0] = all.mean;
        out[1] = dt_rsqrt(all.m2 / A(H) + eps);
      },
      [&](int e, const A* in) {
        stats[((e / NG) * 3 + e % NG) * 2] = in[0];
        stats[((e / NG) * 3 + e % NG) * 2 + 1] = in[1];
      },
      [&](int e, const Moments<A>& all) {
        stats[((e / NG) * 3 + e % NG) * 2] = all.mean;
        stats[((e / NG) * 3 + e % NG) * 2 + 1] = dt_rsqrt(all.m2 / A(H) + eps);
      },
      group, cluster);
  phase_mark(kPhaseNorm);
  __syncthreads();
}

// Where sub-cell k of step t reads and writes, for this block's units: what persistent_subcell's phases share.
template <typename T, typename A> struct SubcellSpan {
  int j0, n;          // this block's first unit and its number of units (the last block's may be fewer)
  size_t BH, TBH;     // ldb * H, steps * ldb * H (a step's rows, a sub-cell's steps)
  const A* hin;       // [B, H] the sub-cell's input state
  const T* hin_lp;    // the same in T (16-bit storage), or nullptr
  const T* xp;        // [B, NIN*H] the step's input products (base cells), or nullptr
  T* hp;              // [B, NH*H] (base) or [B, 3H] (T-GRU) the recurrent products, written
  const T* bh;
  const T* lnw;       // the sub-cell's layer-norm gain and offset, or nullptr
  const T* lnb;
};

template <int K, typename T, typename A>
__device__ __forceinline__ SubcellSpan<T, A> subcell_span(const PersistentForwardArgs<T, A>& p, int t, int k) {
  constexpr int NIN = Rows<K>::in, NH = Rows<K>::hid;
  SubcellSpan<T, A> sp;
  const int H = p.H, ldb = p.ldb, S = p.slice;
  const BlockUnits units = block_units(H, S, block_group(p.blocks).rank);
  sp.j0 = units.j0;
  sp.n = units.n;
  sp.BH = static_cast<size_t>(ldb) * H;
  sp.TBH = static_cast<size_t>(p.steps) * sp.BH;
  sp.hin = p.hs + k * sp.TBH + t * sp.BH;
  sp.hin_lp = p.hs_lp ? p.hs_lp + k * sp.TBH + t * sp.BH : nullptr;
  sp.xp = NIN ? p.xp + static_cast<size_t>(t) * ldb * NIN * H : nullptr;
  sp.hp = k == 0 ? p.hp + static_cast<size_t>(t) * ldb * NH * H
                 : p.hpt + (static_cast<size_t>(k - 1) * p.steps + t) * ldb * 3 * H;
  sp.bh = k == 0 ? p.b_hh : p.t_b + static_cast<size_t>(k - 1) * 3 * H;
  sp.lnw = k == 0 ? p.ln_w : (p.t_ln_w ? p.t_ln_w + static_cast<size_t>(k - 1) * 2 * H : nullptr);
  sp.lnb = k == 0 ? p.ln_b : (p.t_ln_b ? p.t_ln_b + static_cast<size_t>(k - 1) * 2 * H : nullptr);
  return sp;
}

// The stage's row of vector r of V (block_dots, tiles of tc vectors): vectors r = c (mod tc) together, in order, so
// that vector c of consecutive tiles lies in consecutive rows; the V rows in [0, V) (slot c' < c holds V / tc
// vectors, one more where c' < V % tc).
__device__ __forceinline__ int stage_row(int r, int V, int tc) {
  const int c = r % tc, q = V / tc, rem = V % tc;
  return c * q + (c < rem ? c : rem) + r / tc;
}

// Rows [0, B) x columns [c0, c0 + cn) of the vectors v (row b at v + b * ldv) into stage [B][pitch] (row b at
// stage_row(b, B, tc)), by the whole block, consecutive threads on consecutive columns (coalesced). 16 bytes a copy
// where the rows, the columns and the stage allow it: asynchronous (cp.async, every copy of the block in flight at
// once, no registers; stage_wait waits for them) where the device has it, else through
// registers, up to kStageLoads loads a thread in flight; else one value a load, the same way. The caller puts block
// barriers around it.
constexpr int kStageLoads = 8;
struct alignas(16) Bytes16 {
  unsigned int w[4];
};
template <typename V, typename T>
__device__ __forceinline__ void stage_copy(const T* v, size_t ldv, int rows, int c0, int per_row, int pitch, int tc,
                                           T* stage) {
  constexpr int kPer = static_cast<int>(sizeof(V) / sizeof(T));   // values a load
  const int total = rows * per_row, threads = static_cast<int>(blockDim.x);
  for (int base = static_cast<int>(threadIdx.x); base < total; base += threads * kStageLoads) {
    V r[kStageLoads];
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int e = base + u * threads;
      if (e < total)
        r[u] = *reinterpret_cast<const V*>(v + (e / per_row) * ldv + c0 + (e % per_row) * kPer);
    }
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int e = base + u * threads;
      if (e < total)
        *reinterpret_cast<V*>(stage + stage_row(e / per_row, rows, tc) * pitch + (e % per_row) * kPer) = r[u];
    }
  }
}
#if defined(DTMT_ASYNC_COPY)
template <typename T>
__device__ __forceinline__ void stage_copy_async(const T* v, size_t ldv, int rows, int c0, int per_row, int pitch,
                                                 int tc, T* stage) {
  constexpr int kPer = static_cast<int>(sizeof(Bytes16) / sizeof(T));   // values a copy
  const int total = rows * per_row;
  for (int e = static_cast<int>(threadIdx.x); e < total; e += static_cast<int>(blockDim.x))
    __pipeline_memcpy_async(stage + stage_row(e / per_row, rows, tc) * pitch + (e % per_row) * kPer,
                            v + (e / per_row) * ldv + c0 + (e % per_row) * kPer, sizeof(Bytes16));
}
#endif
// stage_issue starts the copies (asynchronous ones are still in flight when it returns: one commit group a call,
// also where the copies went through registers, so that stage_wait counts calls); stage_wait(pending) returns once
// this thread's copies of all but the last `pending` calls are made.
template <typename T>
__device__ __forceinline__ void stage_issue(const T* v, size_t ldv, int rows, int c0, int cn, int pitch, int tc,
                                            T* stage) {
  constexpr size_t kWide = sizeof(Bytes16) / sizeof(T);
  if (ldv % kWide == 0 && c0 % kWide == 0 && cn % kWide == 0 && pitch % kWide == 0 &&
      reinterpret_cast<size_t>(v) % sizeof(Bytes16) == 0) {
#if defined(DTMT_ASYNC_COPY)
    stage_copy_async(v, ldv, rows, c0, cn / static_cast<int>(kWide), pitch, tc, stage);
#else
    stage_copy<Bytes16>(v, ldv, rows, c0, cn / static_cast<int>(kWide), pitch, tc, stage);
#endif
  } else {
    stage_copy<T>(v, ldv, rows, c0, cn, pitch, tc, stage);
  }
#if defined(DTMT_ASYNC_COPY)
  __pipeline_commit();
#endif
}
__device__ __forceinline__ void stage_wait(int pending) {
#if defined(DTMT_ASYNC_COPY)
  __pipeline_wait_prior(static_cast<size_t>(pending));
#else
  (void)pending;
#endif
}

// ------------------------------------------------------------------------------ the stage shared by a cluster
// Every block of the grid reads every vector the products share (the state forward, the gradients backward): at
// B = 64, H = 512 in fp32 that is 17 MB of L2 reads a forward sub-cell and 52 MB a GRU's backward one
// (docs/design/persistent_recurrence.md, "The stage read once a cluster"). Launched in thread-block clusters of
// `blocks` (a cooperative launch with a cluster dimension), block r of a cluster copies the vectors r, r + blocks,
// ... of a chunk with one bulk copy each, multicast to every block of the cluster at the same offset of its stage,
// so that the L2 serves each chunk once a cluster. Each block's mbarrier of the buffer counts the bytes (all V rows,
// from every block of the cluster) and its threads wait on it; a cluster barrier, not a block barrier, precedes a
// buffer's refill, since the blocks of the cluster write into each other's buffers. The sums are those of the
// block's own copies, bit for bit; the blocks of a cluster stage the same chunks, so the products' shape (lanes,
// chunk, passes) comes from `rows`, the most rows a block has (the plan's slice), not the block's own.
struct StageShare {
  int blocks = 1;                         // blocks of a cluster sharing the stage's copies (1: each its own)
  int rows = 0;                           // the products' rows the shape is taken from (every block's the same)
  uint64_t* bars = nullptr;               // [2] an mbarrier a buffer, then [2] unsigned: their phases completed
};

__device__ __forceinline__ int stage_cluster_rank() {
#if defined(DTMT_CUDA_EMULATION)
  return ::dtmt_emu::cluster_rank();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return static_cast<int>(::cooperative_groups::this_cluster().block_rank());
#else
  return 0;
#endif
}
// The barrier of the blocks of this block's cluster (barrier.cluster.arrive.release / wait.acquire).
__device__ __forceinline__ void stage_cluster_sync() {
#if defined(DTMT_CUDA_EMULATION)
  ::dtmt_emu::cluster_sync();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cooperative_groups::this_cluster().sync();
#else
  __trap();   // (no clusters below sm_90: the driver launches no clusters there)
#endif
}
#if defined(DTMT_STAGE_MULTICAST)
// The stage's two mbarriers, one arrival a phase (the block's own expect_tx), and their counts, by thread 0; the
// caller then makes the initialization visible to the cluster (stage_cluster_sync) before any block copies.
__device__ __forceinline__ void stage_share_init(const StageShare& share) {
  if (threadIdx.x != 0) return;
  unsigned* const done = reinterpret_cast<unsigned*>(share.bars + 2);
#if defined(DTMT_CUDA_EMULATION)
  ::dtmt_emu::mbar_init(share.bars, 1);
  ::dtmt_emu::mbar_init(share.bars + 1, 1);
#else
  ::cuda::ptx::mbarrier_init(share.bars, 1);
  ::cuda::ptx::mbarrier_init(share.bars + 1, 1);
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
#endif
  done[0] = done[1] = 0;
}
// This block's part of the copies of columns [c0, c0 + cn) of the V vectors into `buf` (rows stage_row(r) x pitch),
// counted by mbarrier `bar`, which thread 0 tells to expect every block's part (V rows of cn values).
template <typename T>
__device__ __forceinline__ void stage_issue_shared(const StageShare& share, int which, const T* v, size_t ldv, int V,
                                                   int c0, int cn, int pitch, int tc, T* buf) {
  uint64_t* const bar = share.bars + which;
  const unsigned bytes = static_cast<unsigned>(cn * sizeof(T));
  const unsigned short mask = static_cast<unsigned short>((1u << share.blocks) - 1u);
  if (threadIdx.x == 0) {
#if defined(DTMT_CUDA_EMULATION)
    ::dtmt_emu::mbar_arrive_expect_tx(bar, static_cast<unsigned>(V) * bytes);
#else
    ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                           ::cuda::ptx::space_shared, bar,
                                           static_cast<unsigned>(V) * bytes);
#endif
  }
  const int step = share.blocks * static_cast<int>(blockDim.x),
            first = stage_cluster_rank() + share.blocks * static_cast<int>(threadIdx.x);
#if !defined(DTMT_CUDA_EMULATION)
  // (the vectors were written by other blocks' stores, the generic proxy; the bulk copies read them through the async
  // proxy)
  if (first < V) ::cuda::ptx::fence_proxy_async();
#endif
  for (int r = first; r < V; r += step) {
    T* const dst = buf + static_cast<size_t>(stage_row(r, V, tc)) * pitch;
    const T* const src = v + static_cast<size_t>(r) * ldv + c0;
#if defined(DTMT_CUDA_EMULATION)
    ::dtmt_emu::bulk_copy_multicast(dst, src, bytes, bar, mask);
#else
    ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst, src, bytes, bar, mask);
#endif
  }
}
// Waits for the next phase of mbarrier `which` (the copies of every block of the cluster into this block's buffer);
// `done` counts the phases this block has waited for.
__device__ __forceinline__ void stage_wait_shared(const StageShare& share, int which, unsigned& done) {
  uint64_t* const bar = share.bars + which;
#if defined(DTMT_CUDA_EMULATION)
  ::dtmt_emu::mbar_wait_parity(bar, done & 1u);
#else
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, done & 1u)) {
  }
#endif
  ++done;
}
#endif

// A launch's StageShare: with `multicast` blocks a cluster, where the FMA products have a stage (`cols` columns of
// rows of K, after `products_buf`), its mbarriers after the stage (persistent_plan.h's kStageShareBytes); else none
// (also in code without the bulk copies, where the launch's clusters only group its blocks). `rows` for block_dots
// is the caller's (the most rows of a sub-cell a block has).
template <typename T>
__device__ __forceinline__ StageShare stage_share(int multicast, bool mma, int cols, unsigned char* products_buf,
                                                  int B, int K) {
  StageShare share;
#if defined(DTMT_STAGE_MULTICAST)
  if (multicast > 1 && !mma && cols > 0) {
    share.blocks = multicast;
    share.bars = reinterpret_cast<uint64_t*>(products_buf + stage_bytes(B, K, cols, sizeof(T)));
  }
#else
  (void)multicast, (void)mma, (void)cols, (void)products_buf, (void)B, (void)K;
#endif
  return share;
}
// At a persistent kernel's start, after its setup: the stage's mbarriers initialized and the cluster told (a block
// must not copy into another whose mbarrier is not yet set); at its end, the cluster's barrier, so that no block ends
// while copies it issued may still write into the others.
__device__ __forceinline__ void stage_share_begin(const StageShare& share) {
#if defined(DTMT_STAGE_MULTICAST)
  if (share.blocks > 1) {
    stage_share_init(share);
    stage_cluster_sync();
  }
#else
  (void)share;
#endif
}
__device__ __forceinline__ void stage_share_end(const StageShare& share) {
  if (share.blocks > 1) stage_cluster_sync();
}

// Values 0 and 1 of p (aligned to two values: an even offset in a matrix row or a staged row) in one load: 8 bytes
// for float, 4 for bf16, 16 for double.
template <typename A, typename T> __device__ __forceinline__ void ld_pair(const T* p, A& a, A& b) {
  struct alignas(2 * sizeof(T)) Pair {
    T v[2];
  };
  const Pair q = *reinterpret_cast<const Pair*>(p);
  a = ld<A>(q.v, 0);
  b = ld<A>(q.v, 1);
}

// The FMA products of the persistent launches: M x V dot products of length K, output (m, r) the sum over i of
// ld(a(m), i) * ld(v + r * ldv, i) (a(m): a matrix row in shared memory or L2; v: V vectors every matrix row meets, the
// state or the gradients, in global memory), given by store(m, r, sum) (0 where !live(r): a row whose sentence has
// ended costs nothing). A thread sums a tile of kTileRows = 4 matrix rows by tc vectors (4 where V > 2, else V), its
// values loaded once for the tile: 8 shared-memory loads for 16 multiply-adds, where one output a thread took two a
// multiply-add, and the products are load-bound (an SM issues one warp-wide load a cycle, four warp-wide FMAs;
// docs/design/persistent_recurrence.md, "Tiles of the FMA products"). Tile (tm, tv) takes matrix rows tm + r tiles_m
// (r < 4) and vectors tc tv + c (c < tc: neighbouring batch rows, so that a tile whose rows have all ended is
// skipped); past M or V they repeat the last one, whose sums nobody stores. One compiled form of the loop for every
// B: tc is a value (slots c >= tc sum vector 0 again, never stored). With `stage`
// (shared memory of stage_bytes), the vectors are read from it: whole rows once, or `cols` columns of every row at a
// time in two buffers, chunk c + 1 copied into one while chunk c is summed from the other (stage_issue / stage_wait:
// the whole block, many copies in flight, coalesced), vector c of every tile together (stage_row); without, each
// thread reads them from global memory as it sums, one L2 round trip after another
// (docs/design/persistent_recurrence.md, "The products' stage"). A tile is summed by `lanes` consecutive threads,
// each over pairs of columns lanes pairs apart, combined by shuffles (a fixed tree: deterministic); lanes is the
// largest power of two up to 32 that leaves no thread two tiles a pass. A thread's sum runs over its i in increasing
// order whatever the stage's chunks (a multiple of a round of 2 lanes columns, or all K): the same sums, bit for bit,
// with the stage and without. Tiles are numbered matrix rows first, so that the threads of a warp read, for each of a
// tile's rows, consecutive matrix rows (matrix_pitch apart: 8 banks for 4-byte values, 4 rows of up to 4 lanes
// without a conflict) and, for each of its vectors, a few consecutive stage rows (a pitch apart, 4 or 8 banks, the
// same). With more lanes a tile (B <= 8), a warp's lanes read 2 lanes consecutive values of one or two rows, which
// is as many accesses as their bytes need (ld_pair). Ordered the other way, a warp's load
// touched 32 rows' lines: 32 L1 wavefronts a load, 240 µs a step of a GRU at B = 64 on an H200
// (docs/design/persistent_recurrence.md, "The products' order"). Every thread of the block takes the same passes (the
// shuffles need whole warps; the emulation's, the whole block); blockDim.x a multiple of 32. A pass takes a tile a
// thread, each staging the chunks again. Where the plan's stage has fewer columns than a round (32 at 32 lanes a
// tile: rare, a tight block at small B), the products read global memory.
constexpr int kTileRows = 4, kTileVectors = 4, kDotUnroll = 2;
template <typename A, int TR = kTileRows, int TC = kTileVectors, typename T, typename Live, typename RowOf,
          typename Store>
__device__ __forceinline__ void block_dots(int M, int V, int K, Live live, RowOf a, const T* v, size_t ldv, T* stage,
                                           int cols, const StageShare& share, Store store) {
  const int tc = TC == 1 ? 1 : V > 2 ? TC : V;   // vectors a tile
  // the shape (tiles, lanes, chunks, passes) from the rows of every block of a cluster sharing the stage; the rows
  // past M repeat the last one (M >= 1), their sums never stored
  const int shape_m = share.blocks > 1 && share.rows > M ? share.rows : M;
  const int tiles_m = (shape_m + TR - 1) / TR, tiles = tiles_m * ((V + tc - 1) / tc);
  int lanes = 1;
  while (lanes < 32 && tiles * lanes * 2 <= static_cast<int>(blockDim.x)) lanes *= 2;
  const int groups = static_cast<int>(blockDim.x) / lanes, lane = static_cast<int>(threadIdx.x) % lanes;
  // a chunk: all K, or a multiple of the lanes' rounds (kDotUnroll x lanes columns: every thread's columns the same
  // whatever the chunks, in the same order: the same sums)
  int chunk = stage == nullptr || cols >= K ? K : cols / (kDotUnroll * lanes) * (kDotUnroll * lanes);
  if (chunk == 0) {   // (fewer columns than a round: the direct reads)
    stage = nullptr;
    chunk = K;
  }
  // a staged row: chunk values rounded up to 32 (even: its pairs aligned), and 16 bytes, or 32 where a round's
  // columns of a warp's lanes take more than 16 bytes a row (consecutive rows then start 4 or 8 banks apart: distinct
  // banks for the few rows a warp reads together, up to 4 lanes a tile; the plan reserves stage_pitch's 32)
  const int pad_bytes = kDotUnroll * lanes * static_cast<int>(sizeof(T)) <= 16 ? 16 : 32;
  const int passes = (tiles + groups - 1) / groups, pitch = stage_pitch(chunk, sizeof(T), pad_bytes);
  const bool whole = stage != nullptr && chunk == K;   // staged once for every pass
  // in chunks: two buffers of `chunk` columns (persistent_plan.h's stage_bytes)
  T* const twin = stage != nullptr && !whole ? stage + static_cast<size_t>(V) * pitch : nullptr;
  // the stage read once a cluster (StageShare: bulk copies of whole 16-byte rows of the chunks, the same in every
  // block of the cluster), else each block's copies (stage_issue)
  constexpr size_t kWide = sizeof(Bytes16) / sizeof(T);
#if defined(DTMT_STAGE_MULTICAST)
  const bool shared = share.blocks > 1 && stage != nullptr && ldv % kWide == 0 && K % kWide == 0 &&
                      chunk % kWide == 0 && reinterpret_cast<size_t>(v) % sizeof(Bytes16) == 0;
  // the phases of the two buffers' mbarriers this block has waited for: kept in shared memory between calls, read
  // at the call's first barrier (thread 0 writes them at the end, past a block barrier every thread meets after its
  // read)
  unsigned done0 = 0, done1 = 0;   // (two values, not an array indexed at run time: registers, not local memory)
  {
    const unsigned* counts = shared ? reinterpret_cast<const unsigned*>(share.bars + 2) : nullptr;
    done0 = shared ? counts[0] : 0;
    done1 = shared ? counts[1] : 0;
  }
  // Before a buffer takes new copies, its readers in every block of the cluster are done: a cluster barrier (block
  // barriers where each block copies its own). Not before the call's first copy: the vectors a call reads are written
  // by other blocks, so a grid barrier lies between every call and the one before it, in all blocks. Every thread
  // fences its part of the block's generic shared-memory accesses before it (the buffer may have been filled by
  // a call whose rows could not be bulk-copied, its own cp.async copies, before the bulk copies' async proxy writes
  // into it).
  auto barrier_before_refill = [&](bool first) {
    if (shared && !first) {
#if !defined(DTMT_CUDA_EMULATION)
      ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);
#endif
      stage_cluster_sync();
    } else {
      __syncthreads();
    }
  };
  auto issue = [&](int c0, int cn, T* buf) {
    if (shared) {
      stage_issue_shared(share, buf == stage ? 0 : 1, v, ldv, V, c0, cn, pitch, tc, buf);
    } else {
      stage_issue(v, ldv, V, c0, cn, pitch, tc, buf);
    }
  };
  auto wait = [&](T* buf, int pending) {
    if (shared && buf == stage) {
      stage_wait_shared(share, 0, done0);
    } else if (shared) {
      stage_wait_shared(share, 1, done1);
    } else {
      stage_wait(pending);
    }
  };
#else
  (void)share;
  (void)kWide;
  auto barrier_before_refill = [](bool) { __syncthreads(); };
  auto issue = [&](int c0, int cn, T* buf) { stage_issue(v, ldv, V, c0, cn, pitch, tc, buf); };
  auto wait = [](T*, int pending) { stage_wait(pending); };
#endif
  // (the barriers before a refill are the stage's time in the phase clock: a cluster's wait for its slowest block)
  if (whole) {
    phase_mark(kPhaseProducts);
    barrier_before_refill(true);   // (the stage's last readers are done)
    issue(0, K, stage);
    wait(stage, 0);
    __syncthreads();
    phase_mark(kPhaseStage);
  }
  auto matrix_row = [&](int tm, int r) { return tm + r * tiles_m < M ? tm + r * tiles_m : M - 1; };
  auto vector = [&](int tv, int c) { return tc * tv + c < V ? tc * tv + c : V - 1; };
  // a tile's sums over this thread's columns i of [c0, c0 + cn): acc[r][c] += a(row r)[i] * vec(c)[i]; the vectors'
  // pairs in one load where `paired` (the stage's rows: an even pitch), else one value a load (global memory's rows
  // may be of odd length)
  auto sum_tile = [&](A(&acc)[TR][TC], int tm, auto vec, int c0, int cn, auto paired) {
    const T* rows[TR];
#pragma unroll
    for (int r = 0; r < TR; ++r) rows[r] = a(matrix_row(tm, r)) + c0;
    decltype(vec(0)) vecs[TC];
#pragma unroll
    for (int c = 0; c < TC; ++c) vecs[c] = vec(c < tc ? c : 0);
    // a round: a pair of consecutive columns of each lane (lane l's i = 2 k lanes + 2 l + u, u < 2), each pair one
    // load (ld_pair: the lanes of a warp read 2 lanes consecutive values of a row, no bank conflict at any L), every
    // load of the round issued before its multiply-adds (one load latency a round), through pointers that step a
    // round at a time; each sum runs over the thread's columns in increasing order. The vectors of slots c >= tc are
    // vector 0's (loaded, summed, never stored: no predicate in the loop; at B <= 2 a round loads 2 to 3 more
    // vectors than it needs)
    constexpr int U = kDotUnroll;
    static_assert(U == 2, "a round is a pair of columns a lane (ld_pair)");
    const int step = U * lanes;
    int i = lane * U;
    const T* pr[TR];
#pragma unroll
    for (int r = 0; r < TR; ++r) pr[r] = rows[r] + i;
    decltype(vec(0)) pv[TC];
#pragma unroll
    for (int c = 0; c < TC; ++c) pv[c] = vecs[c] + i;
    for (; i + U <= cn; i += step) {
      A x[U][TC], w[U][TR];
#pragma unroll
      for (int c = 0; c < TC; ++c) {
        if constexpr (decltype(paired)::value) {
          ld_pair(pv[c], x[0][c], x[1][c]);
        } else {
          x[0][c] = ld<A>(pv[c], 0);
          x[1][c] = ld<A>(pv[c], 1);
        }
      }
#pragma unroll
      for (int r = 0; r < TR; ++r) ld_pair(pr[r], w[0][r], w[1][r]);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < TR; ++r)
#pragma unroll
          for (int c = 0; c < TC; ++c) acc[r][c] += w[u][r] * x[u][c];
#pragma unroll
      for (int r = 0; r < TR; ++r) pr[r] += step;
#pragma unroll
      for (int c = 0; c < TC; ++c) pv[c] += step;
    }
    if (i < cn) {   // (the last round's one column short of cn: a round is 2 columns)
      A x[TC];
#pragma unroll
      for (int c = 0; c < TC; ++c) x[c] = ld<A>(vecs[c], i);
#pragma unroll
      for (int r = 0; r < TR; ++r) {
        const A w = ld<A>(rows[r], i);
#pragma unroll
        for (int c = 0; c < TC; ++c) acc[r][c] += w * x[c];
      }
    }
  };
  for (int pass = 0; pass < passes; ++pass) {
    // this thread's tile in this pass, found once for every chunk: (tm, tv), and whether any of its vectors is live
    const int t = pass * groups + static_cast<int>(threadIdx.x) / lanes, tm = t % tiles_m, tv = t / tiles_m;
    bool busy = false;
    if (t < tiles)
#pragma unroll
      for (int c = 0; c < TC; ++c) busy = busy || (c < tc && tc * tv + c < V && live(tc * tv + c));
    A acc[TR][TC];
#pragma unroll
    for (int r = 0; r < TR; ++r)
#pragma unroll
      for (int c = 0; c < TC; ++c) acc[r][c] = A(0);
    // chunks: chunk c in buffer c % 2, chunk c + 1 copied into the other while c is summed
    const bool chunked = stage != nullptr && !whole;
    if (chunked) {
      phase_mark(kPhaseProducts);
      barrier_before_refill(pass == 0);   // (the stage's last readers are done)
      issue(0, chunk, stage);
      phase_mark(kPhaseStage);
    }
    for (int c0 = 0; c0 < K; c0 += chunk) {
      const int cn = K - c0 < chunk ? K - c0 : chunk;
      T* const buf = (c0 / chunk) % 2 == 0 ? stage : twin;
      if (chunked) {
        const int next = c0 + chunk;
        if (next < K) issue(next, K - next < chunk ? K - next : chunk, buf == stage ? twin : stage);
        wait(buf, next < K ? 1 : 0);
        __syncthreads();
        phase_mark(kPhaseStage);
      }
      if (busy) {
        // (the stage's and global memory's vectors in separate branches: each load's space known to the compiler)
        if (stage != nullptr) {
          sum_tile(acc, tm, [&](int c) { return buf + static_cast<size_t>(stage_row(vector(tv, c), V, tc)) * pitch; },
                   c0, cn, std::true_type{});
        } else {
          sum_tile(acc, tm, [&](int c) { return v + static_cast<size_t>(vector(tv, c)) * ldv + c0; }, c0, cn,
                   std::false_type{});
        }
      }
      if (chunked) {
        // (this chunk's readers are done before its buffer takes the chunk after next: in the whole cluster where
        // the blocks write into each other's buffers)
        if (c0 + 2 * chunk < K) {
          phase_mark(kPhaseProducts);
          barrier_before_refill(false);
          phase_mark(kPhaseStage);
        } else {
          __syncthreads();
          phase_mark(kPhaseProducts);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < TR; ++r)
#pragma unroll
      for (int c = 0; c < TC; ++c) {
        if (c >= tc) break;   // (the same for every thread)
        A sum = acc[r][c];
        for (int off = lanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        const int m = tm + r * tiles_m, b = tc * tv + c;
        if (t < tiles && lane == 0 && m < M && b < V) store(m, b, busy && live(b) ? sum : A(0));
      }
  }
#if defined(DTMT_STAGE_MULTICAST)
  if (shared && threadIdx.x == 0) {   // (read by the next block_dots after its cluster barrier)
    unsigned* counts = reinterpret_cast<unsigned*>(share.bars + 2);
    counts[0] = done0;
    counts[1] = done1;
  }
#endif
}

// 1. products of the block's NH x n rows with every batch row's state, rounded to T as a GEMM's output is: on
// tensor cores (all NH x S rows, the last block's rows past n zero), or FMA (block_dots); into hp and pre [B][4][S].
template <int K, bool kSpilled, typename T, typename A>
__device__ __forceinline__ void subcell_products(const PersistentForwardArgs<T, A>& p, const SubcellSpan<T, A>& sp,
                                                 int t, const T* u, A* pre, unsigned char* products_buf) {
  constexpr int NH = Rows<K>::hid;
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  const A* hin = sp.hin;
  const T* hin_lp = sp.hin_lp;
  T* hp = sp.hp;
  const float* C = nullptr;
#if defined(DTMT_MMA_DEVICE)
  if constexpr (Mma<T>::available) {
    if (p.mma) {   // (without hs_lp, T is A)
      const T* h = hin_lp ? hin_lp : reinterpret_cast<const T*>(hin);
      C = block_mma<T, kSpilled>(u, matrix_pitch(H), NH * S, h, H, H, B, step_mask(p.mask, t, p.ldb), 0,
                                 products_buf);
    }
  }
#endif
  // output e: unit jj = e % n of gate q = (e / n) % NH, batch row b = e / (NH n)
  auto store = [&](int e, A acc) {
    const int jj = e % n, q = (e / n) % NH, b = e / (NH * n);
    const T rounded = Cvt<A, T>::store(acc);
    hp[static_cast<size_t>(b) * NH * H + q * H + j0 + jj] = rounded;
    pre[(b * 4 + (K == kATR ? 1 : q)) * S + jj] = Cvt<A, T>::load(rounded);   // (ATR: its q's slot)
  };
  if (C != nullptr) {
    const int ldc = round16(NH * S);
    for (int e = threadIdx.x; e < B * NH * n; e += blockDim.x)   // (0 for a row whose sentence has ended)
      store(e, static_cast<A>(C[(e / (NH * n)) * ldc + ((e / n) % NH) * S + e % n]));
  } else {
    // a row whose sentence has ended costs nothing: its products are 0 (what the backward reads of them); matrix row
    // m = q n + jj (unit jj of gate q), output e = m + NH n b as store numbers them
    auto live = [&](int b) { return row_valid(p.mask, t, p.ldb, b); };
    auto row = [&](int m) { return u + (static_cast<size_t>(m / n) * S + m % n) * matrix_pitch(H); };
    const T* h = hin_lp ? hin_lp : reinterpret_cast<const T*>(hin);   // (without hs_lp, T is A)
    T* stage = !p.mma && p.stage_cols > 0 ? reinterpret_cast<T*>(products_buf) : nullptr;
    StageShare share = stage_share<T>(p.multicast, p.mma, p.stage_cols, products_buf, B, H);
    share.rows = NH * S;
    block_dots<A, kSpilled ? 1 : kTileRows, kSpilled ? 1 : kTileVectors>(
        NH * n, B, H, live, row, h, H, stage, H <= p.stage_cols ? H : p.stage_cols, share,
        [&](int m, int b, A acc) { store(m + NH * n * b, acc); });
  }
  __syncthreads();
}

// 2. gate pre-activations in place: groups g < NG (ATR: p from the input alone, q from the product)
template <int K, typename T, typename A>
__device__ __forceinline__ void subcell_preactivations(const PersistentForwardArgs<T, A>& p,
                                                       const SubcellSpan<T, A>& sp, A* pre) {
  constexpr int NIN = Rows<K>::in, NG = Rows<K>::groups;
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  const T* xp = sp.xp;
  const T* bh = sp.bh;
  for (int e = threadIdx.x; e < B * NG * n; e += blockDim.x) {
    const int b = e / (NG * n), g = (e / n) % NG, jj = e % n, j = j0 + jj;
    A a;
    if constexpr (K == kATR) {
      a = g == 0 ? ld<A>(xp, b * H + j) : pre[(b * 4 + 1) * S + jj] + ld<A>(bh, j);
    } else {
      a = pre[(b * 4 + g) * S + jj] + ld<A>(bh, g * H + j);
      if constexpr (K != kTGRU) a += ld<A>(xp, static_cast<size_t>(b) * NIN * H + g * H + j);
    }
    pre[(b * 4 + g) * S + jj] = a;
  }
  __syncthreads();
}

// 3. the elementwise update of the block's units: into the next sub-cell's input state, or (the last sub-cell) the
// output and the next step's first state (h_last after the last step)
template <int K, typename T, typename A>
__device__ __forceinline__ void subcell_update(const PersistentForwardArgs<T, A>& p, const SubcellSpan<T, A>& sp,
                                               int t, int k, bool last, int next_t, const A* pre, const A* stats) {
  constexpr int NIN = Rows<K>::in, NG = Rows<K>::groups;
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  const size_t BH = sp.BH, TBH = sp.TBH;
  const A* hin = sp.hin;
  const T* xp = sp.xp;
  const T* bh = sp.bh;
  const T* lnw = sp.lnw;
  const T* lnb = sp.lnb;
  const T* drop = p.drop ? p.drop + static_cast<size_t>(k) * BH : nullptr;
  A* hout;
  T* hout_lp = nullptr;
  if (!last) {
    hout = p.hs + (k + 1) * TBH + t * BH;
    if (p.hs_lp) hout_lp = p.hs_lp + (k + 1) * TBH + t * BH;
  } else if (next_t >= 0) {
    hout = p.hs + next_t * BH;
    if (p.hs_lp) hout_lp = p.hs_lp + next_t * BH;
  } else {
    hout = p.h_last;
  }
  for (int e = threadIdx.x; e < B * n; e += blockDim.x) {
    const int b = e / n, jj = e % n, j = j0 + jj;
    const size_t o = static_cast<size_t>(b) * H + j;
    A gate[3];
    for (int g = 0; g < NG; ++g) {
      A a = pre[(b * 4 + g) * S + jj];
      if (lnw) a = (a - stats[(b * 3 + g) * 2]) * stats[(b * 3 + g) * 2 + 1] * ld<A>(lnw, g * H + j) +
                   ld<A>(lnb, g * H + j);
      gate[g] = K == kATR ? a : dt_sigmoid(a);
    }
    const A h = hin[o];
    const bool valid = row_valid(p.mask, t, p.ldb, b);
    A hn;
    if (!valid) {
      hn = h;   // an ended row keeps its state through every sub-cell (the block's input state at the last)
    } else if constexpr (K == kATR) {
      hn = atr_elem_forward<A>(gate[0], gate[1], h);
    } else {
      constexpr GatedInputRows in = gated_input_rows(K);
      const A hc = pre[(b * 4 + NG) * S + jj] + ld<A>(bh, NG * H + j);
      const A m = drop ? ld<A>(drop, o) : A(1);
      const T* x = NIN ? xp + static_cast<size_t>(b) * NIN * H : nullptr;
      const A xc = in.xc ? ld<A>(x, NG * H + j) : A(0), lin = in.lin ? ld<A>(x, (NG + 1) * H + j) : A(0);
      hn = gated_elem_forward<K, A>(gate[0], gate[1], NG == 3 ? gate[2] : A(0), xc, lin, hc, h, m);
    }
    A state = hn;
    if (last) st<A>(p.out + t * BH, static_cast<int>(o), valid ? hn : A(0));
    hout[o] = state;
    if (hout_lp) st<A>(hout_lp, static_cast<int>(o), state);
  }
}

// One sub-cell of one step for this block's units. K: the sub-cell's kind; its rows [NH][slice][matrix_pitch(H)]
// in shared memory (`resident`) or, where it is nullptr, in the spill buffer (`spilled`, read through L2: products
// in tiles of one row by one vector, a compact loop, so that the kernel does not carry a second copy of the
// resident products' unrolled tiles; docs/design/persistent_recurrence.md, "Tiles of the FMA products"); pre:
// [B][4][slice]; stats: [B][3][2] (mean, rstd).
template <int K, typename T, typename A>
__device__ void persistent_subcell(const PersistentForwardArgs<T, A>& p, int t, int k, bool last, int next_t,
                                   const T* resident, const T* spilled, A* pre, A* stats,
                                   unsigned char* products_buf) {
  const SubcellSpan<T, A> sp = subcell_span<K>(p, t, k);
  if (resident != nullptr) {
    subcell_products<K, false>(p, sp, t, resident, pre, products_buf);
  } else {
    subcell_products<K, true>(p, sp, t, spilled, pre, products_buf);
  }
  phase_mark(kPhaseProducts);
  subcell_preactivations<K>(p, sp, pre);
  phase_mark(kPhaseElements);
  if (sp.lnw)
    gate_statistics<A>(pre, 4, Rows<K>::groups, p.B, p.H, p.slice, sp.n, p.eps, p.partials, stats,
                       block_group(p.blocks), p.cluster);
  subcell_update<K>(p, sp, t, k, last, next_t, pre, stats);
  phase_mark(kPhaseElements);
  persistent_barrier(p.cluster);
}

template <int KIND, typename T, typename A>
__global__ void persistent_forward_kernel(PersistentForwardArgs<T, A> p) {
  constexpr int NH = Rows<KIND>::hid;
  DTMT_DYNAMIC_SMEM(smem);
  if (!select_rows<KIND>(p)) return;   // (a cluster with no rows left: all its blocks)
  phase_begin();
  const int H = p.H, S = p.slice;
  const auto [j0, n] = block_units(H, S, block_group(p.blocks).rank);
  const int r = resident_subcells(p.D, p.resident);
  T* u = reinterpret_cast<T*>(smem);   // the resident sub-cells' rows [NH or 3][S][matrix_pitch(H)], one after another
  auto spilled = [&](int k) {
    return spilled_matrix<T>(false, KIND, p.D, H, S, r, k, p.spill, block_group(p.blocks).rank);
  };
  A* pre = reinterpret_cast<A*>(smem + resident_matrix_bytes(false, KIND, p.D, H, S, sizeof(T), r));
  A* stats = pre + static_cast<size_t>(p.B) * 4 * S;
  // block_mma's buffers, or block_dots' stage
  unsigned char* products_buf = smem + round_bytes(forward_block_bytes(KIND, p.D, p.B, H, S, sizeof(T), sizeof(A), r));
  // the block's rows of every matrix, once (rows of units past H, in the last block, zero: the tensor-core
  // products read them)
  const T zero = Cvt<A, T>::store(A(0));
  for (int k = 0; k <= p.D; ++k) {
    const int rows = k == 0 ? NH : 3;
    T* uk = k < r ? resident_matrix<T>(false, KIND, H, S, k, u) : spilled(k);
    const T* w = k == 0 ? p.w_hh : p.t_w + static_cast<size_t>(k - 1) * 3 * H * H;
    for (size_t e = threadIdx.x; e < static_cast<size_t>(rows) * S * H; e += blockDim.x) {
      const int q = static_cast<int>(e / (static_cast<size_t>(S) * H)), jj = static_cast<int>((e / H) % S),
                i = static_cast<int>(e % H);
      uk[(static_cast<size_t>(q) * S + jj) * matrix_pitch(H) + i] =
          jj < n ? w[static_cast<size_t>(q * H + j0 + jj) * H + i] : zero;
    }
  }
  phase_mark(kPhaseSetup);
  __syncthreads();
  const StageShare share = stage_share<T>(p.multicast, p.mma, p.stage_cols, products_buf, p.B, H);
  stage_share_begin(share);
  for (int step = 0; step < p.steps; ++step) {
    const int t = p.reverse ? p.steps - 1 - step : step;
    const int next_t = step + 1 < p.steps ? (p.reverse ? t - 1 : t + 1) : -1;
    for (int k = 0; k <= p.D; ++k) {
      const T* resident = k < r ? resident_matrix<T>(false, KIND, H, S, k, u) : nullptr;
      const T* spill = k < r ? nullptr : spilled(k);
      if (k == 0) {
        persistent_subcell<KIND, T, A>(p, t, 0, p.D == 0, next_t, resident, spill, pre, stats, products_buf);
      } else {
        persistent_subcell<kTGRU, T, A>(p, t, k, k == p.D, next_t, resident, spill, pre, stats, products_buf);
      }
    }
  }
  stage_share_end(share);
  phase_end();
}

// ------------------------------------------------------------------------------------------------ backward
// The backward over reversed time in one cooperative launch, on the forward's saved tensors, with the decisions
// and roundings of the per-step backward (transition_cuda.cu's backward_impl with step_backward_kernel), so that
// the two agree to rounding. Block b owns the same units as in the forward; it keeps the *columns* of every
// recurrent matrix for its units (U[:, j] for j in its slice, a column of n_h*H, stored as a row of
// matrix_pitch(n_h*H)), since the gradient reaching a unit's state through a product is sum_r d(pre)[r] U[r, j].
// The carried gradient, the gradient from the sub-cell above and the gradients' U-paths are per unit, so they stay
// in the block's shared memory; only the pre-activation gradients (dhp, dhpt: every block reads all of them) and
// the layer-norm sums go through global memory, with a grid barrier after each. One launch runs the steps of one
// chunk (step_lo..step_hi; the driver launches the chunks one after another, each from the last one's dh0), its
// pre-activation gradients in the chunk's buffers, which the driver turns into weight gradients between the
// launches.
template <typename T, typename A> struct PersistentBackwardArgs {
  const T* xp;      // saved by the forward: [T, B, NIN*H]
  const T* hp;      // [T, B, NH*H]
  const T* hpt;     // [D, T, B, 3H]
  const A* hs;      // [D+1, T, B, H]
  const T* w_hh;    // [NH*H, H]
  const T* b_hh;
  const T* ln_w;
  const T* ln_b;
  const T* t_w;     // [D, 3H, H]
  const T* t_b;
  const T* t_ln_w;
  const T* t_ln_b;
  const T* drop;    // [D+1, B, H] or nullptr
  const T* mask;    // [T, B] or nullptr
  const T* grad_out;  // [T, B, H]
  const A* grad_hn;   // [B, H] the gradient reaching the state after step_hi - 1
  A* dh0;             // [B, H] out: the gradient reaching the state before step_lo
  T* dxp;             // [C, B, NIN*H] out, C = chunk_steps: rows t - chunk_t0 for the times t run
  T* dhp;             // [C, B, NH*H] out
  T* dhpt;            // [D, C, B, 3H] out
  A* dln_rows;        // [B, NG*H] layer-norm gain / offset gradient accumulators, zeroed (or nullptr)
  A* dlnb_rows;
  A* dtln_rows;       // [D, B, 2H], zeroed (or nullptr)
  A* dtlnb_rows;
  A* partials;        // [groups][2, G + 1, B, 3, 2]: the gate statistics' partials, then the layer-norm backward's
                      // (each with its joined ones last)
  T* spill;           // [grid, spill_elems] the columns of sub-cells resident..D (persistent_plan.h), or nullptr
  int steps, B, H, D, slice;
  int ldb, blocks;    // as the forward's
  int step_lo, step_hi;       // the steps run, step_hi - 1 down to step_lo (step s at time s, or steps-1-s reversed)
  int chunk_t0, chunk_steps;  // the gradient buffers' first time and their steps (a chunk: transition_cuda.cu's
                              // GradientChunks; 0 and `steps` for the whole sequence)
  int resident;       // sub-cells whose columns stay in shared memory (< 0: all D + 1)
  bool reverse;
  bool mma;           // U-path products on tensor cores (block_mma.cuh), as the forward's
  int stage_cols;     // else (FMA) block_dots' stage of the gradients, as the forward's
  bool cluster;       // thread-block clusters, as the forward's
  int multicast;      // clusters sharing the stage, as the forward's
  A eps;
};

// The backward's arguments for this block's group of batch rows, as the forward's select_rows.
template <int KIND, typename T, typename A>
__device__ __forceinline__ bool select_rows(PersistentBackwardArgs<T, A>& p) {
  constexpr int NIN = Rows<KIND>::in, NH = Rows<KIND>::hid, NG = Rows<KIND>::groups;
  const RowGroup g = enter_row_group(p, 2);
  const size_t r = static_cast<size_t>(g.first), H = static_cast<size_t>(p.H);
  shift_rows(p.xp, r, NIN * H);
  shift_rows(p.hp, r, NH * H);
  shift_rows(p.hpt, r, 3 * H);
  shift_rows(p.hs, r, H);
  shift_rows(p.drop, r, H);
  shift_rows(p.mask, r, 1);
  shift_rows(p.grad_out, r, H);
  shift_rows(p.grad_hn, r, H);
  shift_rows(p.dh0, r, H);
  shift_rows(p.dxp, r, NIN * H);
  shift_rows(p.dhp, r, NH * H);
  shift_rows(p.dhpt, r, 3 * H);
  shift_rows(p.dln_rows, r, NG * H);
  shift_rows(p.dlnb_rows, r, NG * H);
  shift_rows(p.dtln_rows, r, 2 * H);
  shift_rows(p.dtlnb_rows, r, 2 * H);
  return g.rows > 0;
}

// Per-unit buffers of the backward block, [B][S] each.
template <typename A> struct BackwardBuffers {
  A* n;       // [B][3][S] normalised (or raw) gate pre-activations of the sub-cell being differentiated
  A* d;       // [B][3][S] their gradients
  A* carry;   // [B][S] the gradient carried to the previous step (direct part)
  A* cg;      // [B][S] its U-path part (this step's; the per-step backward's carry_g), rounded to T
  A* inner;   // [B][S] the direct gradient from the sub-cell above
  A* gin;     // [B][S] its U-path part, rounded to T
  A* stats;   // [B][3][2] (mean, rstd) of the gate groups
  A* sums;    // [B][3][2] the layer-norm backward's row means of d and d * n
};

// out[b][jj] = sum_r dpre[b, r] * col[jj][r] for the block's units, rounded to T (the per-step GEMM's output dtype),
// on tensor cores with `mma` (block_mma.cuh), else FMA (block_dots, through its stage where stage_cols > 0:
// columns of each row the buffer holds at a time). Rows that had ended at the step whose gradients dpre are (`mask`:
// that step's row of the mask, step_mask) have dpre = 0: their result is 0 without a sum.
template <bool kSpilled, typename T, typename A>
__device__ void persistent_u_path(const T* dpre, int R, const T* col, int ldc, int B, int S, int n, A* out,
                                  const T* mask, bool mma, int stage_cols, unsigned char* products_buf,
                                  const StageShare& share) {
#if defined(DTMT_MMA_DEVICE)
  if constexpr (Mma<T>::available) {
    if (mma) {
      const float* C = block_mma<T, kSpilled>(col, ldc, n, dpre, R, R, B, mask, 0, products_buf);
      const int ldm = round16(n);
      for (int e = threadIdx.x; e < B * n; e += blockDim.x) {
        const int b = e % B, jj = e / B;
        out[b * S + jj] = Cvt<A, T>::load(Cvt<A, T>::store(static_cast<A>(C[b * ldm + jj])));
      }
      return;
    }
  }
#endif
  // matrix row jj: the column of unit jj; vector b: row b's gradients (block_dots; spilled columns, read through L2:
  // tiles of one column by one vector, as the forward's)
  block_dots<A, kSpilled ? 1 : kTileRows, kSpilled ? 1 : kTileVectors>(
      n, B, R, [&](int b) { return row_valid(mask, 0, B, b); },
      [&](int jj) { return col + static_cast<size_t>(jj) * ldc; }, dpre, R,
      !mma && stage_cols > 0 ? reinterpret_cast<T*>(products_buf) : nullptr, R <= stage_cols ? R : stage_cols, share,
      [&](int jj, int b, A acc) { out[b * S + jj] = Cvt<A, T>::load(Cvt<A, T>::store(acc)); });
}

// Where sub-cell k of step t reads and writes in the backward, for this block's units.
template <typename T, typename A> struct BackwardSpan {
  int j0, n;          // this block's first unit and its number of units
  size_t BH;          // ldb * H (a step's rows)
  bool top, base;     // the block's last sub-cell (takes the carried and output gradients), its first (carries)
  const A* hin;       // [B, H] the sub-cell's input state
  const T* xp;        // [B, NIN*H] the step's input products (base cells), or nullptr
  T* dxp;             // their gradients, or nullptr
  const T* hp;        // the recurrent products (base [B, NH*H], T-GRU [B, 3H])
  T* dhp;             // their gradients
  const T* bh;
  const T* lnw;       // the sub-cell's layer-norm gain and offset, or nullptr
  const T* lnb;
  A* dlnw;            // [B, NG*H] the row accumulators of their gradients, or nullptr
  A* dlnb;
};

template <int K, typename T, typename A>
__device__ __forceinline__ BackwardSpan<T, A> backward_span(const PersistentBackwardArgs<T, A>& p, int t, int k) {
  constexpr int NIN = Rows<K>::in, NH = Rows<K>::hid;
  BackwardSpan<T, A> sp;
  const int H = p.H, ldb = p.ldb, S = p.slice;
  const BlockUnits units = block_units(H, S, block_group(p.blocks).rank);
  sp.j0 = units.j0;
  sp.n = units.n;
  sp.BH = static_cast<size_t>(ldb) * H;
  sp.top = k == p.D;
  sp.base = k == 0;
  sp.hin = p.hs + k * static_cast<size_t>(p.steps) * sp.BH + t * sp.BH;
  sp.xp = NIN ? p.xp + static_cast<size_t>(t) * ldb * NIN * H : nullptr;
  const int r = t - p.chunk_t0;   // t's rows in the gradient buffers
  sp.dxp = NIN ? p.dxp + static_cast<size_t>(r) * ldb * NIN * H : nullptr;
  const size_t hoff =
      k == 0 ? static_cast<size_t>(t) * ldb * NH * H : (static_cast<size_t>(k - 1) * p.steps + t) * ldb * 3 * H;
  const size_t doff = k == 0 ? static_cast<size_t>(r) * ldb * NH * H
                             : (static_cast<size_t>(k - 1) * p.chunk_steps + r) * ldb * 3 * H;
  sp.hp = (k == 0 ? p.hp : p.hpt) + hoff;
  sp.dhp = (k == 0 ? p.dhp : p.dhpt) + doff;
  sp.bh = k == 0 ? p.b_hh : p.t_b + static_cast<size_t>(k - 1) * 3 * H;
  sp.lnw = k == 0 ? p.ln_w : (p.t_ln_w ? p.t_ln_w + static_cast<size_t>(k - 1) * 2 * H : nullptr);
  sp.lnb = k == 0 ? p.ln_b : (p.t_ln_b ? p.t_ln_b + static_cast<size_t>(k - 1) * 2 * H : nullptr);
  sp.dlnw = k == 0 ? p.dln_rows : (p.dtln_rows ? p.dtln_rows + static_cast<size_t>(k - 1) * sp.BH * 2 : nullptr);
  sp.dlnb = k == 0 ? p.dlnb_rows : (p.dtlnb_rows ? p.dtlnb_rows + static_cast<size_t>(k - 1) * sp.BH * 2 : nullptr);
  return sp;
}

// the (normalised) gate pre-activations into m.n, recomputed as the forward made them
template <int K, typename T, typename A>
__device__ __forceinline__ void backward_gates(const PersistentBackwardArgs<T, A>& p, const BackwardSpan<T, A>& sp,
                                               const BackwardBuffers<A>& m) {
  constexpr int NIN = Rows<K>::in, NH = Rows<K>::hid, NG = Rows<K>::groups;
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  const T* xp = sp.xp;
  const T* hp = sp.hp;
  const T* bh = sp.bh;
  const T* lnw = sp.lnw;
  for (int e = threadIdx.x; e < B * NG * n; e += blockDim.x) {
    const int b = e % B, g = (e / B) % NG, jj = e / (B * NG), j = j0 + jj;
    A a;
    if constexpr (K == kATR) {
      a = g == 0 ? ld<A>(xp, b * H + j) : ld<A>(hp, b * H + j) + ld<A>(bh, j);
    } else {
      a = ld<A>(hp, static_cast<size_t>(b) * NH * H + g * H + j) + ld<A>(bh, g * H + j);
      if constexpr (K != kTGRU) a += ld<A>(xp, static_cast<size_t>(b) * NIN * H + g * H + j);
    }
    m.n[(b * 3 + g) * S + jj] = a;
  }
  phase_mark(kPhaseElements);
  __syncthreads();
  if (lnw) {
    gate_statistics<A>(m.n, 3, NG, B, H, S, n, p.eps, p.partials, m.stats, block_group(p.blocks), p.cluster);
    for (int e = threadIdx.x; e < B * NG * n; e += blockDim.x) {
      const int b = e % B, g = (e / B) % NG, jj = e / (B * NG);
      A& v = m.n[(b * 3 + g) * S + jj];
      v = (v - m.stats[(b * 3 + g) * 2]) * m.stats[(b * 3 + g) * 2 + 1];
    }
    phase_mark(kPhaseNorm);
    __syncthreads();
  }
}

// the elementwise backward of the block's units at step t: the gates' gradients into m.d, the candidate's and the
// input products' stored, the input state's gradient into m.carry (base) or m.inner
template <int K, typename T, typename A>
__device__ __forceinline__ void backward_elements(const PersistentBackwardArgs<T, A>& p, const BackwardSpan<T, A>& sp,
                                                  int t, int k, const BackwardBuffers<A>& m) {
  constexpr int NIN = Rows<K>::in, NH = Rows<K>::hid, NG = Rows<K>::groups;
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  const size_t BH = sp.BH;
  const bool top = sp.top, base = sp.base;
  const A* hin = sp.hin;
  const T* xp = sp.xp;
  T* dxp = sp.dxp;
  const T* hp = sp.hp;
  T* dhp = sp.dhp;
  const T* bh = sp.bh;
  const T* lnw = sp.lnw;
  const T* lnb = sp.lnb;
  const T* drop = p.drop ? p.drop + static_cast<size_t>(k) * BH : nullptr;
  for (int e = threadIdx.x; e < B * n; e += blockDim.x) {
    const int b = e % B, jj = e / B, j = j0 + jj;
    const size_t o = static_cast<size_t>(b) * H + j;
    const bool valid = row_valid(p.mask, t, p.ldb, b);
    const A carry = (top || base) ? m.carry[b * S + jj] + m.cg[b * S + jj] : A(0);
    const A dout = top ? (valid ? carry + ld<A>(p.grad_out + t * BH, static_cast<int>(o)) : A(0))
                       : m.inner[b * S + jj] + m.gin[b * S + jj];
    auto post = [&](int g) -> A {
      const A v = m.n[(b * 3 + g) * S + jj];
      return lnw ? v * ld<A>(lnw, g * H + j) + ld<A>(lnb, g * H + j) : v;
    };
    const A h = hin[o];
    A dh;
    constexpr GatedInputRows in = gated_input_rows(K);
    const size_t xrow = static_cast<size_t>(b) * NIN * H;   // this batch row's input products
    if (!valid) {   // an ended row: no gradient reaches its gates (the per-step backward's zeros, not computed)
      for (int g = 0; g < NG; ++g) m.d[(b * 3 + g) * S + jj] = A(0);
      if constexpr (K != kATR) {
        if constexpr (in.xc) st<A>(dxp, static_cast<int>(xrow + NG * H + j), A(0));
        if constexpr (in.lin) st<A>(dxp, static_cast<int>(xrow + (NG + 1) * H + j), A(0));
        st<A>(dhp, static_cast<int>(static_cast<size_t>(b) * NH * H + NG * H + j), A(0));
      }
      dh = A(0);
    } else if constexpr (K == kATR) {
      A dp, dq;
      atr_elem_backward<A>(post(0), post(1), h, dout, dp, dq, dh);
      m.d[(b * 3 + 0) * S + jj] = dp;
      m.d[(b * 3 + 1) * S + jj] = dq;
    } else {
      const A r = dt_sigmoid(post(0)), z = dt_sigmoid(post(1)), l = NG == 3 ? dt_sigmoid(post(2)) : A(0);
      const A hc = ld<A>(hp, static_cast<size_t>(b) * NH * H + NG * H + j) + ld<A>(bh, NG * H + j);
      const A mult = drop ? ld<A>(drop, static_cast<int>(o)) : A(1);
      const A xc = in.xc ? ld<A>(xp, xrow + NG * H + j) : A(0);
      const A lin = in.lin ? ld<A>(xp, xrow + (NG + 1) * H + j) : A(0);
      A dr, dz, dl, dxc, dlin, dhc;
      gated_elem_backward<K, A>(r, z, l, xc, lin, hc, h, mult, dout, dr, dz, dl, dxc, dlin, dhc, dh);
      if constexpr (NG == 3) m.d[(b * 3 + 2) * S + jj] = dl;
      if constexpr (in.xc) st<A>(dxp, static_cast<int>(xrow + NG * H + j), dxc);
      if constexpr (in.lin) st<A>(dxp, static_cast<int>(xrow + (NG + 1) * H + j), dlin);
      m.d[(b * 3 + 0) * S + jj] = dr;
      m.d[(b * 3 + 1) * S + jj] = dz;
      st<A>(dhp, static_cast<int>(static_cast<size_t>(b) * NH * H + NG * H + j), dhc);
    }
    if (base && !valid) dh = carry;   // a padded row passes the carried gradient through
    if (base) {
      m.carry[b * S + jj] = dh;
    } else {
      m.inner[b * S + jj] = dh;
    }
  }
  phase_mark(kPhaseElements);
  __syncthreads();
}

// the gates' gradients through the layer norms: the gain / offset row accumulators, then the row sums over all H
// units (a grid barrier between)
template <int K, typename T, typename A>
__device__ __forceinline__ void backward_layer_norm(const PersistentBackwardArgs<T, A>& p, const BackwardSpan<T, A>& sp,
                                                    const BackwardBuffers<A>& m) {
  constexpr int NG = Rows<K>::groups;
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  const T* lnw = sp.lnw;
  A* dlnw = sp.dlnw;
  A* dlnb = sp.dlnb;
  // (partials of their own: a block that gets here early must not overwrite statistics another still combines)
  const BlockGroup group = block_group(p.blocks);
  A* sums_partials = p.partials + (static_cast<size_t>(group.blocks) + 1) * B * 3 * 2;
  for (int e = threadIdx.x; e < B * NG * n; e += blockDim.x) {
    const int b = e % B, g = (e / B) % NG, jj = e / (B * NG), j = j0 + jj;
    A& dv = m.d[(b * 3 + g) * S + jj];
    const A v = m.n[(b * 3 + g) * S + jj];
    dlnw[static_cast<size_t>(b) * NG * H + g * H + j] += dv * v;
    dlnb[static_cast<size_t>(b) * NG * H + g * H + j] += dv;
    dv *= ld<A>(lnw, g * H + j);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < B * NG; e += blockDim.x) {
    const int b = e / NG, g = e % NG;
    A s1 = A(0), s2 = A(0);
    for (int jj = 0; jj < n; ++jj) {
      s1 += m.d[(b * 3 + g) * S + jj];
      s2 += m.d[(b * 3 + g) * S + jj] * m.n[(b * 3 + g) * S + jj];
    }
    A* out = sums_partials + ((static_cast<size_t>(group.rank) * B + b) * 3 + g) * 2;
    out[0] = s1;
    out[1] = s2;
  }
  phase_mark(kPhaseNorm);
  persistent_barrier(p.cluster);
  // pair e: batch row e / NG, group e % NG
  join_pairs<Sums<A>>(
      B * NG,
      [&](int blk, int e) {
        const A* in = sums_partials + ((static_cast<size_t>(blk) * B + e / NG) * 3 + e % NG) * 2;
        return Sums<A>{in[0], in[1]};
      },
      sums_partials + static_cast<size_t>(group.blocks) * B * 3 * 2, 2,
      [&](int, const Sums<A>& all, A* out) {
        out[0] = all.s1 / A(H);
        out[1] = all.s2 / A(H);
      },
      [&](int e, const A* in) {
        m.sums[((e / NG) * 3 + e % NG) * 2] = in[0];
        m.sums[((e / NG) * 3 + e % NG) * 2 + 1] = in[1];
      },
      [&](int e, const Sums<A>& all) {
        m.sums[((e / NG) * 3 + e % NG) * 2] = all.s1 / A(H);
        m.sums[((e / NG) * 3 + e % NG) * 2 + 1] = all.s2 / A(H);
      },
      group, p.cluster);
  __syncthreads();
  for (int e = threadIdx.x; e < B * NG * n; e += blockDim.x) {   // d -> rstd (d - mean(d) - n mean(d n))
    const int b = e % B, g = (e / B) % NG, jj = e / (B * NG);
    A& dv = m.d[(b * 3 + g) * S + jj];
    dv = m.stats[(b * 3 + g) * 2 + 1] *
         (dv - m.sums[(b * 3 + g) * 2] - m.n[(b * 3 + g) * S + jj] * m.sums[(b * 3 + g) * 2 + 1]);
  }
  phase_mark(kPhaseNorm);
  __syncthreads();
}

template <int K, typename T, typename A>
__device__ void persistent_subcell_backward(const PersistentBackwardArgs<T, A>& p, int t, int k,
                                            const BackwardBuffers<A>& m) {
  constexpr int NIN = Rows<K>::in, NH = Rows<K>::hid, NG = Rows<K>::groups;
  const BackwardSpan<T, A> sp = backward_span<K>(p, t, k);
  const int H = p.H, B = p.B, S = p.slice, j0 = sp.j0, n = sp.n;
  T* dxp = sp.dxp;
  T* dhp = sp.dhp;
  backward_gates<K>(p, sp, m);
  backward_elements<K>(p, sp, t, k, m);
  if (sp.lnw) backward_layer_norm<K>(p, sp, m);
  // the gate pre-activations' gradients, for every block's next U-path and for the weight gradients
  for (int e = threadIdx.x; e < B * NG * n; e += blockDim.x) {
    const int b = e % B, g = (e / B) % NG, jj = e / (B * NG), j = j0 + jj;
    const A v = m.d[(b * 3 + g) * S + jj];
    if constexpr (K == kATR) {
      if (g == 0) {
        st<A>(dxp, b * H + j, v);
      } else {
        st<A>(dhp, b * H + j, v);
      }
    } else {
      st<A>(dhp, static_cast<int>(static_cast<size_t>(b) * NH * H + g * H + j), v);
      if constexpr (K != kTGRU) st<A>(dxp, static_cast<int>(static_cast<size_t>(b) * NIN * H + g * H + j), v);
    }
  }
  phase_mark(kPhaseElements);
  persistent_barrier(p.cluster);
}

template <int KIND, typename T, typename A>
__global__ void persistent_backward_kernel(PersistentBackwardArgs<T, A> p) {
  constexpr int NH = Rows<KIND>::hid;
  DTMT_DYNAMIC_SMEM(smem);
  if (!select_rows<KIND>(p)) return;   // (a cluster with no rows left: all its blocks)
  phase_begin();
  const int H = p.H, B = p.B, S = p.slice;
  // (not a structured binding: u_path captures n)
  const BlockUnits units = block_units(H, S, block_group(p.blocks).rank);
  const int j0 = units.j0, n = units.n;
  const int R0 = NH * H;   // a base column's length; a T-GRU's is 3H
  const int r = resident_subcells(p.D, p.resident);
  T* cols = reinterpret_cast<T*>(smem);   // the resident sub-cells' columns [S][matrix_pitch(R)], one after another
  auto spilled = [&](int k) {
    return spilled_matrix<T>(true, KIND, p.D, H, S, r, k, p.spill, block_group(p.blocks).rank);
  };
  A* buf = reinterpret_cast<A*>(smem + resident_matrix_bytes(true, KIND, p.D, H, S, sizeof(T), r));
  const size_t BS = static_cast<size_t>(B) * S;
  BackwardBuffers<A> m{buf, buf + 3 * BS, buf + 6 * BS, buf + 7 * BS, buf + 8 * BS, buf + 9 * BS,
                       buf + 10 * BS, buf + 10 * BS + 6 * B};
  // block_mma's buffers, or block_dots' stage
  unsigned char* products_buf =
      smem + round_bytes(backward_block_bytes(KIND, p.D, B, H, S, sizeof(T), sizeof(A), r));
  // (the stage's mbarriers after a stage of the longest gradient rows; the products' shape from a block's S columns)
  StageShare share = stage_share<T>(p.multicast, p.mma, p.stage_cols, products_buf, B,
                                    backward_u_path_length(KIND, p.D, H));
  share.rows = S;
  // the U-path through sub-cell k's columns (R long): out[b][jj] = sum_r dpre[b, r] col_jj[r]
  auto u_path = [&](int k, const T* dpre, int R, A* out, int t) {
    if (k < r) {
      persistent_u_path<false>(dpre, R, resident_matrix<T>(true, KIND, H, S, k, cols), matrix_pitch(R), B, S, n,
                               out, step_mask(p.mask, t, p.ldb), p.mma, p.stage_cols, products_buf, share);
    } else {
      persistent_u_path<true>(dpre, R, spilled(k), matrix_pitch(R), B, S, n, out, step_mask(p.mask, t, p.ldb), p.mma,
                              p.stage_cols, products_buf, share);
    }
  };
  for (int k = 0; k <= p.D; ++k) {
    const int R = (k == 0 ? NH : 3) * H;
    T* c = k < r ? resident_matrix<T>(true, KIND, H, S, k, cols) : spilled(k);
    const T* w = k == 0 ? p.w_hh : p.t_w + static_cast<size_t>(k - 1) * 3 * H * H;
    for (size_t e = threadIdx.x; e < static_cast<size_t>(n) * R; e += blockDim.x) {
      const int jj = static_cast<int>(e / R), r = static_cast<int>(e % R);
      c[static_cast<size_t>(jj) * matrix_pitch(R) + r] = w[static_cast<size_t>(r) * H + j0 + jj];
    }
  }
  for (int e = threadIdx.x; e < B * n; e += blockDim.x) {
    const int b = e % B, jj = e / B;
    m.carry[b * S + jj] = p.grad_hn[static_cast<size_t>(b) * H + j0 + jj];
    m.cg[b * S + jj] = A(0);
  }
  phase_mark(kPhaseSetup);
  __syncthreads();
  stage_share_begin(share);
  for (int step = p.step_hi - 1; step >= p.step_lo; --step) {
    const int t = p.reverse ? p.steps - 1 - step : step, rt = t - p.chunk_t0;
    for (int k = p.D; k >= 0; --k) {
      if (k < p.D)   // the U-path from T-GRU k + 1 of this step (its dhpt: every block's, before the last barrier)
        u_path(k + 1, p.dhpt + (static_cast<size_t>(k) * p.chunk_steps + rt) * p.ldb * 3 * H, 3 * H, m.gin, t);
      phase_mark(kPhaseProducts);
      __syncthreads();
      if (k == 0) {
        persistent_subcell_backward<KIND, T, A>(p, t, 0, m);
      } else {
        persistent_subcell_backward<kTGRU, T, A>(p, t, k, m);
      }
    }
    // the U-path of this step's base gradients: into the previous step's state (the next one processed)
    u_path(0, p.dhp + static_cast<size_t>(rt) * p.ldb * R0, R0, m.cg, t);
    phase_mark(kPhaseProducts);
    __syncthreads();
  }
  for (int e = threadIdx.x; e < B * n; e += blockDim.x) {
    const int b = e % B, jj = e / B;
    p.dh0[static_cast<size_t>(b) * H + j0 + jj] = m.carry[b * S + jj] + m.cg[b * S + jj];
  }
  stage_share_end(share);
  phase_end();
}

#if !defined(DTMT_CUDA_EMULATION)
// The configuration of a launch of `grid` blocks in thread-block clusters of `blocks` (cudaLaunchKernelEx with the
// cluster dimension in attribute[0], storage the caller keeps; above 8 blocks the non-portable attribute), and how
// many such clusters the device holds at once (`held`). Refused (an error the caller falls back from) where the
// clusters do not divide the grid or pass kClusterMaxBlocks, or where the kernel's code has no clusters (made from
// PTX below 9.0, a JIT: checked before the cluster queries, whose errors on such code vary).
template <typename Kernel>
cudaError_t cluster_config(Kernel* kernel, int grid, int blocks, int threads, size_t smem, cudaStream_t stream,
                           cudaLaunchAttribute* attribute, cudaLaunchConfig_t& config, int& held) {
  if (blocks < 1 || blocks > kClusterMaxBlocks || grid % blocks != 0) return cudaErrorInvalidClusterSize;
  cudaFuncAttributes attributes{};
  cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
  if (err != cudaSuccess) return err;
  if (attributes.ptxVersion < 90 || attributes.binaryVersion < 90) return cudaErrorNotSupported;
  if (blocks > 8) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
  }
  config = {};
  config.gridDim = dim3(grid, 1, 1);
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = blocks;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(&held, kernel, &config);
}

// A launch of `grid` blocks in thread-block clusters of `blocks` (cluster_config), `cooperative` where its grid
// barrier is needed too (both attributes: the grid form's clusters that read the stage once a cluster). Refused where
// cluster_config refuses it, or where the device cannot hold all of the grid's clusters at once (a cluster's blocks
// share a GPC).
template <typename Kernel, typename Arg>
cudaError_t launch_in_clusters(Kernel* kernel, const Arg& a, int grid, int blocks, bool cooperative, int threads,
                               size_t smem, cudaStream_t stream) {
  cudaLaunchAttribute attribute[2];
  cudaLaunchConfig_t config;
  int clusters = 0;   // clusters of this shape the device holds at once: all of the grid's must be resident
  const cudaError_t err = cluster_config(kernel, grid, blocks, threads, smem, stream, attribute, config, clusters);
  if (err != cudaSuccess) return err;
  if (clusters < grid / blocks) return cooperative ? cudaErrorCooperativeLaunchTooLarge : cudaErrorInvalidClusterSize;
  if (cooperative) {
    attribute[1].id = cudaLaunchAttributeCooperative;
    attribute[1].val.cooperative = 1;
    config.numAttrs = 2;
  }
  return cudaLaunchKernelEx(&config, kernel, a);
}
#endif

// The shared memory a block may opt into on this device (the emulation's setting on the CPU; 0 where it cannot
// be read).
inline size_t device_smem_optin() {
#if defined(DTMT_CUDA_EMULATION)
  return ::dtmt_emu::smem_optin;
#else
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 0;
  return static_cast<size_t>(optin);
#endif
}

// The clusters of batch rows a cluster launch takes where the device holds only `held` of its clusters at once (0:
// as many as it has): fewer clusters of more rows each (b.B, ceil(ldb / held), as many as leave none empty), so that
// none waits for another to end, and their FMA products' stage (b.stage_cols, where there is one) the plan's rule for
// those rows, restage(b): the stage planned for fewer rows could take a block past its shared memory. Returns the
// clusters; b.B is the rows of each.
template <typename Arg, typename Restage> int regroup_rows(Arg& b, int clusters, int held, Restage restage) {
  if (b.ldb > 0 && held >= 1 && held < clusters) {
    const RowSplit split = split_rows(b.ldb, held);
    b.B = static_cast<int>(split.rows);
    clusters = static_cast<int>(split.groups);
    if (b.stage_cols > 0) b.stage_cols = restage(b);
  }
  return clusters;
}

// Launches kernel(a) as a persistent launch of `grid` blocks of `threads` threads with smem_of(a) bytes of dynamic
// shared memory each: a cooperative launch (one block per SM; the grid barrier), or with a.cluster thread-block
// clusters of a.blocks (at most kClusterMaxBlocks, above 8 with the non-portable attribute; the cluster barrier), each
// a.B rows of the batch (select_rows; docs/design/persistent_recurrence.md, "Clusters of batch rows"). Where the device
// holds fewer of those clusters at once than the grid has, fewer clusters take more rows each (a.B and the shared
// memory grow), so that none waits for another to end. A launch the device cannot place (too much shared memory,
// blocks that cannot all be resident at once, a cluster it cannot schedule with that shared memory) returns an error
// and nothing runs: the driver falls back (transition_cuda.cu).
template <typename Arg, typename SmemOf, typename Restage>
cudaError_t launch_persistent(void (*kernel)(Arg), const Arg& a, int grid, int threads, SmemOf smem_of,
                              Restage restage, cudaStream_t stream) {
  const size_t smem = smem_of(a);
#if defined(DTMT_CUDA_EMULATION)
  (void)stream;
  if (a.cluster) {   // (the device's hold on clusters: the emulation's setting, so that the regrouping runs here)
    const int blocks = a.blocks > 0 ? a.blocks : grid;
    Arg b = a;
    const int clusters = regroup_rows(b, grid / blocks, ::dtmt_emu::clusters_held, restage);
    if (smem_of(b) > device_smem_optin()) return cudaErrorInvalidValue;   // (as the device's allowance refuses it)
    ::dtmt_emu::launch_clusters(kernel, clusters * blocks, threads, smem_of(b), b, blocks);
    return cudaSuccess;
  }
  // (as a GPU refuses them: shared memory past the opt-in at cudaFuncSetAttribute, more blocks than it holds at once
  // at the cooperative launch)
  if (smem > device_smem_optin()) return cudaErrorInvalidValue;
  if (grid > ::dtmt_emu::cooperative_blocks(threads, smem)) return cudaErrorCooperativeLaunchTooLarge;
  if (a.multicast > 1) {
    ::dtmt_emu::launch_cooperative_clusters(kernel, grid, threads, smem, a, a.multicast);
  } else {
    ::dtmt_emu::launch_cooperative(kernel, grid, threads, smem, a);
  }
  return cudaSuccess;
#else
  // The kernel's allowance of dynamic shared memory is set to this launch's size and the launch issued under one lock:
  // else another host thread launching the kernel with a smaller stage could lower the allowance between this set and
  // this launch, which the device would then refuse (found in review; the launch is asynchronous, the lock short).
  static std::mutex allowance;
  const std::lock_guard<std::mutex> lock(allowance);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  if (a.cluster) {
    const int blocks = a.blocks > 0 ? a.blocks : grid;
    int clusters = grid / blocks;
    Arg b = a;
    if (clusters > 1) {   // as many clusters as the device holds at once, each of ceil(ldb / clusters) rows
      cudaLaunchAttribute attribute[1];
      cudaLaunchConfig_t config;
      int held = 0;
      err = cluster_config(kernel, grid, blocks, threads, smem, stream, attribute, config, held);
      if (err != cudaSuccess) return err;
      const int asked = clusters;
      clusters = regroup_rows(b, clusters, held, restage);
      if (clusters != asked) {
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smem_of(b)));
        if (err != cudaSuccess) return err;
      }
    }
    return launch_in_clusters(kernel, b, clusters * blocks, blocks, false, threads, smem_of(b), stream);
  }
  if (a.multicast > 1) {
    // the grid form in clusters that read the stage once a cluster: code for sm_90a only (setup.py's DTMT_SM90A for
    // TORCH_CUDA_ARCH_LIST=9.0a), whose bulk copies multicast
#if defined(DTMT_SM90A)
    return launch_in_clusters(kernel, a, grid, a.multicast, true, threads, smem, stream);
#else
    return cudaErrorNotSupported;
#endif
  }
  Arg arg = a;
  void* args[] = {&arg};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), grid, threads, args, smem, stream);
#endif
}

// launch_persistent of a cell kind's forward or backward kernel, its shared memory and its stage's rule for a
// regrouped launch the plan's arithmetic (persistent_plan.h) on the arguments' sizes.
template <int KIND, bool BACKWARD, typename T, typename A, typename Arg>
cudaError_t launch_persistent_kind(void (*kernel)(Arg), const Arg& a, int grid, int threads, cudaStream_t stream) {
  auto smem_of = [threads](const Arg& b) {
    constexpr auto bytes = BACKWARD ? &persistent_backward_bytes : &persistent_forward_bytes;
    return bytes(KIND, b.D, b.B, b.H, b.slice, sizeof(T), sizeof(A), b.mma, threads, b.resident, b.stage_cols,
                 b.multicast);
  };
  auto restage = [](const Arg& b) {
    return persistent_stage_columns(BACKWARD, KIND, b.D, b.B, b.H, b.slice, sizeof(T), sizeof(A), b.resident,
                                    device_smem_optin());
  };
  return launch_persistent(kernel, a, grid, threads, smem_of, restage, stream);
}

template <typename T, typename A>
cudaError_t launch_persistent_backward(int kind, const PersistentBackwardArgs<T, A>& a, int grid, int threads,
                                       cudaStream_t stream) {
#define DTMT_CASE(K) \
  case K: return launch_persistent_kind<K, true, T, A>(persistent_backward_kernel<K, T, A>, a, grid, threads, stream);
  switch (kind) {
    DTMT_FOR_EACH_BASE_CELL_KIND(DTMT_CASE)
    default: return cudaErrorInvalidValue;
  }
#undef DTMT_CASE
}

template <typename T, typename A>
cudaError_t launch_persistent_forward(int kind, const PersistentForwardArgs<T, A>& a, int grid, int threads,
                                      cudaStream_t stream) {
#define DTMT_CASE(K) \
  case K: return launch_persistent_kind<K, false, T, A>(persistent_forward_kernel<K, T, A>, a, grid, threads, stream);
  switch (kind) {
    DTMT_FOR_EACH_BASE_CELL_KIND(DTMT_CASE)
    default: return cudaErrorInvalidValue;
  }
#undef DTMT_CASE
}

// The launchers of storage type T (accumulating in A), named once: explicitly instantiated (EXTERN empty) in a unit
// of their own a type (csrc/persistent_<type>.cu), so that a build compiles the four types' kernels in parallel
// (setup.py's nvcc jobs; the build was one unit's minutes), and declared `extern` in the ATen driver
// (transition_cuda.cu), which then compiles none of them.
#define DTMT_PERSISTENT_LAUNCHERS(EXTERN, T, A)                                                                     \
  EXTERN template cudaError_t launch_persistent_forward<T, A>(int, const PersistentForwardArgs<T, A>&, int, int,   \
                                                              cudaStream_t);                                        \
  EXTERN template cudaError_t launch_persistent_backward<T, A>(int, const PersistentBackwardArgs<T, A>&, int, int, \
                                                               cudaStream_t);

}  // namespace cuda
}  // namespace dtmt
