// A thread block's matrix product on tensor cores, for the persistent kernels (persistent_cuda_kernels.cuh; issue
// 72 item 2; design note docs/design/persistent_recurrence.md, "Products on tensor cores"):
//
//   C[c][m] = sum_k a[m][k] * src[c][k]     m < M (rows resident in shared memory), c < B (batch rows in global
//                                           memory; rows whose sentence has ended at step t count as 0), k < K
//
// with the warp matrix API of the CUDA toolkit (nvcuda::wmma, <mma.h>): TF32 (m16n16k8) for float storage, f16 and
// bf16 (m16n16k16) for __half / __nv_bfloat16; float accumulation. Double storage has none (the FMA products).
// Both operands go through shared memory a chunk of kMmaChunk columns at a time, rounded to the MMA's input type
// and zero past M, B and K, so the resident matrix keeps the FMA path's layout (rows matrix_pitch(H) long) and the
// product has no alignment demand on the caller. Tile (mt, nt) of C is warp (mt + nt * Mt) % warps's; with more
// tiles than warps, passes of `warps` tiles, each staging only its own batch rows; with at most half as many, K split
// over several warps a tile (below). C is column-major [Np][Mp] (Mp, Np: M and B rounded up to 16), float.
//
// Compiled for devices of compute capability 8.0 and up (TF32 and bf16 MMA); below, the function is not there and
// the kernels keep their FMA products (persistent_mma in transition_cuda.cu). DTMT_CUDA_EMULATION:
// tests/cuda_emulation.h's wmma (whole tiles per thread, TF32, f16 and bf16).
#pragma once

#include "persistent_phases.cuh"
#include "persistent_plan.h"
#include "transition_cuda_kernels.cuh"

#if !defined(DTMT_CUDA_EMULATION)
#include <mma.h>
#endif

#if defined(DTMT_CUDA_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define DTMT_MMA_DEVICE 1   // this pass compiles the tensor-core products
#endif

// block_mma is a call, not inlined: the kernels call it from every sub-cell kind's products, forward and backward,
// and each inlined copy was compiled apart (nvcc's time for the persistent kernels), for a product of microseconds
// against a call's few instructions. A call's pointers are generic, so it states each one's space
// (DTMT_ASSUME_SPACE: __builtin_assume(__isShared(p)) or __isGlobal, which nvcc turns into loads of the named
// space, as it infers them where the code is inlined; test_persistent_kernels_load_from_named_spaces).
#if defined(DTMT_CUDA_EMULATION)
#define DTMT_NOINLINE __attribute__((noinline))
#define DTMT_ASSUME_SPACE(space, p) ((void)(p))
#else
#define DTMT_NOINLINE __noinline__
#define DTMT_ASSUME_SPACE(space, p) __builtin_assume(__is##space(p))
#endif

namespace dtmt {
namespace cuda {

// The MMA a storage type T uses: its fragment element type and k (a tile is 16 x 16 x k). (Not in a device pass
// below compute capability 8.0, whose <mma.h> has no TF32 or bf16: there no type has one.)
template <typename T> struct Mma { static constexpr bool available = false; };
constexpr int kMmaLoadsA = 8, kMmaLoadsB = 16;   // values of each operand a thread loads at once (block_mma)
#if !defined(__CUDA_ARCH__) || defined(DTMT_MMA_DEVICE)
template <> struct Mma<float> {
  static constexpr bool available = true;
  static constexpr int k = 8;
  using fragment_type = nvcuda::wmma::precision::tf32;
  static __device__ __forceinline__ float round(float v) { return nvcuda::wmma::__float_to_tf32(v); }
};
template <typename H> struct Mma16 {   // f16 and bf16: m16n16k16, the stored values as they are
  static constexpr bool available = true;
  static constexpr int k = 16;
  using fragment_type = H;
  static __device__ __forceinline__ H round(H v) { return v; }
};
template <> struct Mma<__half> : Mma16<__half> {};
template <> struct Mma<__nv_bfloat16> : Mma16<__nv_bfloat16> {};
#endif

#if defined(DTMT_MMA_DEVICE)
// C (see above) from a [m * lda + k] (shared memory, T; global with kGlobalA: a matrix read from the spill buffer)
// and src [c * lds + k] (global memory, T) on the tensor cores;
// rows c whose mask is 0 at step t count as 0. `buf`: mma_buffer_bytes(M, B, blockDim.x, sizeof(T)) bytes, 128-byte
// aligned; returns C (float, column-major, leading dimension round16(M)). Every thread of the block calls it; it
// begins and ends with a block barrier. blockDim.x a multiple of 32.
//
// Where the tiles leave warps idle (tiles * 2 <= warps: B <= 64 for the GRU's 12 rows a block at H = 512), K is
// split over `ks` warps a tile (the largest power of two with tiles * ks <= warps, and at most a chunk's k-steps,
// kMmaChunk / k: 8 in TF32, 4 in 16 bits): warp slice s takes the k-steps
// i with i % ks == s, each summed in its own accumulator, and the slices' sums are joined in slice order through C
// (slice 0 stores, then each next slice adds its own to what C holds and stores it: a fixed order, deterministic).
// Each chunk's values of src are loaded all at once where a thread's share is at most kMmaLoadsB (rows_b * kMmaChunk
// <= kMmaLoadsB * blockDim.x: B <= 64 at 256 threads), those of a where at most kMmaLoadsA (Mp <= 32), and the next
// chunk's first round of both is loaded before this chunk's products, so that their round trip (L2 for src, and for
// a matrix read from the spill buffer) overlaps the products. src is staged as it is, ended rows too; C's
// columns of the ended rows are set to 0 at the end (a column of C depends only on its own batch row).
template <typename T, bool kGlobalA>
__device__ DTMT_NOINLINE const float* block_mma(const T* a, int lda, int M, const T* src, int lds, int K, int B,
                                                const T* mask, int t, unsigned char* buf) {
  if constexpr (kGlobalA) {
    DTMT_ASSUME_SPACE(Global, a);
  } else {
    DTMT_ASSUME_SPACE(Shared, a);
  }
  DTMT_ASSUME_SPACE(Global, src);
  DTMT_ASSUME_SPACE(Shared, buf);
  namespace wmma = nvcuda::wmma;
  using F = typename Mma<T>::fragment_type;
  constexpr int KM = Mma<T>::k;
  const int Mp = round16(M), Np = round16(B), Mt = Mp / 16, tiles = Mt * (Np / 16);
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  int ks = 1;   // warps a tile (K split over them; at most a chunk's k-steps: none idle in a chunk)
  while (tiles * ks * 2 <= warps && ks * 2 <= kMmaChunk / KM) ks *= 2;
  const int per_pass = ks > 1 ? tiles : warps;   // tiles a pass (with ks > 1 a single pass)
  float* C = reinterpret_cast<float*>(buf);
  T* sa = reinterpret_cast<T*>(buf + round_bytes(static_cast<size_t>(Np) * Mp * sizeof(float)));
  T* sb = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sa) +
                               round_bytes(static_cast<size_t>(Mp) * kMmaStageLd * sizeof(T)));
  const T zero = Cvt<float, T>::store(0.0f);
  // a round of a chunk (columns k0.. of kc, `rows` rows staged, the first `valid` of them from p's rows r0..) from
  // `base`: value e = base + u blockDim.x is row e / kc, column k0 + e % kc (0 past the valid rows and K); then the
  // round into the stage dst (rows kMmaStageLd apart), rounded to the MMA's input type
  auto load_round = [&](auto& v, const T* p, int ld, int r0, int valid, int rows, int k0, int kc, int base) {
    constexpr int N = sizeof(v) / sizeof(v[0]);
#pragma unroll
    for (int u = 0; u < N; ++u) {
      const int e = base + u * static_cast<int>(blockDim.x), r = e / kc, k = k0 + e % kc;
      v[u] = e < rows * kc && r < valid && k < K ? p[static_cast<size_t>(r0 + r) * ld + k] : zero;
    }
  };
  auto store_round = [&](const auto& v, T* dst, int rows, int kc, int base) {
    constexpr int N = sizeof(v) / sizeof(v[0]);
#pragma unroll
    for (int u = 0; u < N; ++u) {
      const int e = base + u * static_cast<int>(blockDim.x);
      if (e < rows * kc) dst[(e / kc) * kMmaStageLd + e % kc] = Mma<T>::round(v[u]);
    }
  };
  T va[kMmaLoadsA], vb[kMmaLoadsB];   // a round of this thread's values of a and of src, in flight
  auto chunk_cols = [&](int k0) {
    const int rest = (K - k0 + KM - 1) / KM * KM;
    return rest < kMmaChunk ? rest : kMmaChunk;
  };
  for (int first = 0; first < tiles; first += per_pass) {
    const int last = (first + per_pass < tiles ? first + per_pass : tiles) - 1;
    const int nt0 = first / Mt, rows_b = (last / Mt - nt0 + 1) * 16;   // this pass's batch tiles
    const int tile = first + (ks > 1 ? warp % tiles : warp), slice = ks > 1 ? warp / tiles : 0;
    const bool mine = ks > 1 ? warp < tiles * ks : tile <= last;
    const int mt = tile % Mt, nt = tile / Mt;
    // a chunk's first round of both operands (a: Mp rows, the first M; src: this pass's batch rows nt0 16.., those
    // below B), and the whole chunk into the stages, its first round loaded before
    auto load_first = [&](int k0) {
      load_round(va, a, lda, 0, M, Mp, k0, chunk_cols(k0), threadIdx.x);
      load_round(vb, src, lds, nt0 * 16, B - nt0 * 16, rows_b, k0, chunk_cols(k0), threadIdx.x);
    };
    // one operand's chunk into its stage: the round loaded before, then the others, a round at a time
    auto stage_operand = [&](auto& v, const T* p, int ld, int r0, int valid, int rows, T* dst, int k0, int kc) {
      const int per_round = static_cast<int>(blockDim.x * (sizeof(v) / sizeof(v[0])));
      store_round(v, dst, rows, kc, threadIdx.x);
      for (int base = threadIdx.x + per_round; base < rows * kc; base += per_round) {
        load_round(v, p, ld, r0, valid, rows, k0, kc, base);
        store_round(v, dst, rows, kc, base);
      }
    };
    auto stage_chunk = [&](int k0) {
      const int kc = chunk_cols(k0);
      stage_operand(va, a, lda, 0, M, Mp, sa, k0, kc);
      stage_operand(vb, src, lds, nt0 * 16, B - nt0 * 16, rows_b, sb, k0, kc);
    };
    wmma::fragment<wmma::accumulator, 16, 16, KM, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    __syncthreads();   // (what the block wrote before the call, src among it, is written; and C's last readers done)
    phase_mark(kPhaseProducts);   // (the phase clock: benchmarks/phase_probe.cu only; else empty)
    load_first(0);
    for (int k0 = 0; k0 < K; k0 += kMmaChunk) {
      const int kc = chunk_cols(k0);
      __syncthreads();   // the previous chunk's (or pass's) products have read the stages
      stage_chunk(k0);
      __syncthreads();
      phase_mark(kPhaseStage);
      if (k0 + kMmaChunk < K) load_first(k0 + kMmaChunk);   // (in flight during this chunk's products)
      if (mine) {
        for (int kk = ((slice - k0 / KM) % ks + ks) % ks * KM; kk < kc; kk += ks * KM) {   // (its k-steps)
          wmma::fragment<wmma::matrix_a, 16, 16, KM, F, wmma::row_major> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, KM, F, wmma::col_major> fb;
          wmma::load_matrix_sync(fa, sa + mt * 16 * kMmaStageLd + kk, kMmaStageLd);
          wmma::load_matrix_sync(fb, sb + (nt - nt0) * 16 * kMmaStageLd + kk, kMmaStageLd);
          if constexpr (std::is_same<T, float>::value) {   // (the stages hold TF32 values already: the API asks it)
            for (int i = 0; i < fa.num_elements; ++i) fa.x[i] = wmma::__float_to_tf32(fa.x[i]);
            for (int i = 0; i < fb.num_elements; ++i) fb.x[i] = wmma::__float_to_tf32(fb.x[i]);
          }
          wmma::mma_sync(acc, fa, fb, acc);
        }
      }
      phase_mark(kPhaseProducts);
    }
    // the slices' sums joined in slice order: slice 0 stores its own; slice s adds its own to what C holds (every
    // load of the tile before any store: a block barrier between, where the emulation's fibers, each holding the
    // whole tile, would otherwise read each other's stores)
    float* const ct = C + nt * 16 * Mp + mt * 16;
    if (mine && slice == 0) wmma::store_matrix_sync(ct, acc, Mp, wmma::mem_col_major);
    for (int s = 1; s < ks; ++s) {
      wmma::fragment<wmma::accumulator, 16, 16, KM, float> sum;
      __syncthreads();
      if (mine && slice == s) wmma::load_matrix_sync(sum, ct, Mp, wmma::mem_col_major);
      __syncthreads();
      if (mine && slice == s) {
        for (int i = 0; i < acc.num_elements; ++i) acc.x[i] = sum.x[i] + acc.x[i];
        wmma::store_matrix_sync(ct, acc, Mp, wmma::mem_col_major);
      }
    }
  }
  __syncthreads();
  if (mask != nullptr) {   // the ended rows' products are 0
    DTMT_ASSUME_SPACE(Global, mask);
    for (int e = threadIdx.x; e < B * Mp; e += blockDim.x)
      if (!row_valid(mask, t, B, e / Mp)) C[e] = 0.0f;
    __syncthreads();
  }
  return C;
}
#endif

}  // namespace cuda
}  // namespace dtmt
