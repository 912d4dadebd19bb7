// CUDA kernels of the deep transition block (GRU / L-GRU / LAU base cell + T-GRUs) and of ATR: one fused
// kernel per sub-cell and step, forward and backward, over raw pointers.
//
// Self-contained on purpose: it depends only on the CUDA runtime headers and cell_math.h (the per-element
// math shared with the CPU kernels), never on torch, so it compiles standalone with `nvcc -c` (see
// tests/test_cuda_sources.py). transition_cuda.cu drives it from ATen (GEMMs, buffers, the time loop); the
// algorithm and the saved tensors are those of dtmt_kernels/ops/transition/triton.py.
//
// Launch: one block per batch row (grid = B), block_threads(H) threads looping over the row's H features,
// dynamic shared memory for the row's gate pre-activations (forward) or normalised values and gradients
// (backward); above 48 KB the limit is raised per kernel, up to the device's opt-in maximum (on an H100,
// 227 KB: H up to ~9,600 for float L-GRU / LAU backward, half that for double), and transition_cuda.cu
// refuses larger rows with the reason.
// Layer-norm statistics are block reductions in the accumulation type A (float, or double for double
// storage); every thread sums the warp partials in the same order, so results are deterministic.
// Storage type T: float, double, __half, __nv_bfloat16; states (hin / hout / carried gradients) are A.
//
// DTMT_CUDA_EMULATION (tests only, see tests/cuda_emulation.h): the same kernels compiled by a host C++
// compiler, each block's threads run as fibers on the host (__syncthreads switches between them, an exchange
// buffer for the warp shuffles), float, double and bfloat16 storage. It lets the kernels and the ATen driver be checked against
// the reference on a machine without a GPU.
#pragma once

#if defined(DTMT_CUDA_EMULATION)
#include "cuda_emulation.h"
#define DTMT_LAUNCH(kernel, grid, block, smem, stream, arg) ::dtmt_emu::launch(kernel, grid, block, smem, arg)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define DTMT_LAUNCH(kernel, grid, block, smem, stream, arg) kernel<<<grid, block, smem, stream>>>(arg)
#endif

#include "cell_math.h"

namespace dtmt {
namespace cuda {

// ------------------------------------------------------------------------------------------ conversions
template <typename A, typename T> struct Cvt {
  static __device__ __forceinline__ A load(T v) { return static_cast<A>(v); }
  static __device__ __forceinline__ T store(A v) { return static_cast<T>(v); }
};
template <typename A> struct Cvt<A, __half> {
  static __device__ __forceinline__ A load(__half v) { return static_cast<A>(__half2float(v)); }
  static __device__ __forceinline__ __half store(A v) { return __float2half_rn(static_cast<float>(v)); }
};
template <typename A> struct Cvt<A, __nv_bfloat16> {   // (the emulation has both 16-bit types: tests/cuda_emulation.h)
  static __device__ __forceinline__ A load(__nv_bfloat16 v) { return static_cast<A>(__bfloat162float(v)); }
  static __device__ __forceinline__ __nv_bfloat16 store(A v) { return __float2bfloat16_rn(static_cast<float>(v)); }
};
template <typename A, typename T> __device__ __forceinline__ A ld(const T* p, int i) {
  return Cvt<A, T>::load(p[i]);
}
template <typename A, typename T> __device__ __forceinline__ void st(T* p, int i, A v) { p[i] = Cvt<A, T>::store(v); }
// Whether batch row b is inside its sentence at step t (mask [T, B] 1 / 0, or nullptr: every row).
// (the step's row offset in size_t: T x B may pass INT_MAX where a step's values do not)
template <typename T> __device__ __forceinline__ bool row_valid(const T* mask, int t, int B, int b) {
  return mask == nullptr || ld<float>(mask + static_cast<size_t>(t) * B, b) > 0.5f;
}

// ------------------------------------------------------------------------------------- row layouts
template <int KIND> struct Rows {   // cell_math.h's table, at compile time
  static constexpr int in = cell_input_rows(KIND);
  static constexpr int hid = cell_hidden_rows(KIND);
  static constexpr int groups = cell_ln_groups(KIND);  // normalised gates (ATR: p, q)
};

// Threads per block: H rounded up to a warp, at most DTMT_CUDA_MAX_THREADS (each thread then loops over
// several features of the row). The emulation tests lower the cap to exercise that loop at small H.
#ifndef DTMT_CUDA_MAX_THREADS
#define DTMT_CUDA_MAX_THREADS 512
#endif
inline int block_threads(int H) {
  int t = ((H + 31) / 32) * 32;
  return t < 32 ? 32 : (t > DTMT_CUDA_MAX_THREADS ? DTMT_CUDA_MAX_THREADS : t);
}
constexpr int kRed = 64;  // shared slots for the block reductions (2 x 32 warps)

// ------------------------------------------------------------------------------------------ reductions
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums a and b over the block; every thread gets both totals (blockDim.x a multiple of 32).
template <typename A> __device__ __forceinline__ void block_sum2(A& a, A& b, A* red) {
  a = warp_sum(a);
  b = warp_sum(b);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // the previous reduction's readers are done with `red`
  if (lane == 0) {
    red[warp] = a;
    red[32 + warp] = b;
  }
  __syncthreads();
  a = A(0);
  b = A(0);
  for (int i = 0; i < nw; ++i) {
    a += red[i];
    b += red[32 + i];
  }
}

// In place over the row's own entries v[j] (j = threadIdx.x + k * blockDim.x): v -> (v - mean) * rstd.
template <typename A> __device__ A row_normalise(A* v, int H, A eps, A* red) {
  A s = 0, unused = 0;
  for (int j = threadIdx.x; j < H; j += blockDim.x) s += v[j];
  block_sum2(s, unused, red);
  const A mean = s / A(H);
  A var = 0;
  unused = 0;
  for (int j = threadIdx.x; j < H; j += blockDim.x) {
    A d = v[j] - mean;
    var += d * d;
  }
  block_sum2(var, unused, red);
  const A rstd = dt_rsqrt(var / A(H) + eps);
  for (int j = threadIdx.x; j < H; j += blockDim.x) v[j] = (v[j] - mean) * rstd;
  return rstd;
}

// dn -> rstd * (dn - mean(dn) - n * mean(dn * n)), in place over the row's own entries.
template <typename A> __device__ void row_normalise_backward(const A* n, A* dn, int H, A rstd, A* red) {
  A s1 = 0, s2 = 0;
  for (int j = threadIdx.x; j < H; j += blockDim.x) {
    s1 += dn[j];
    s2 += dn[j] * n[j];
  }
  block_sum2(s1, s2, red);
  s1 /= A(H);
  s2 /= A(H);
  for (int j = threadIdx.x; j < H; j += blockDim.x) dn[j] = rstd * (dn[j] - s1 - n[j] * s2);
}

// ------------------------------------------------------------------------------------------- arguments
// Pointers are already offset to the [B, ...] slab of this step / sub-cell; rows are contiguous.
template <typename T, typename A> struct StepForwardArgs {
  const T* xp;    // [B, in*H] input pre-activations W x + b_ih (unused by T-GRUs)
  const T* hp;    // [B, hid*H] recurrent pre-activations U h (bias added here)
  const T* bh;    // [hid*H] b_hh
  const A* hin;   // [B, H] the sub-cell's input state
  const T* lnw;   // [groups*H] layer-norm gains, or nullptr (no layer norm)
  const T* lnb;   // [groups*H] offsets
  const T* drop;  // [B, H] candidate-dropout multipliers, or nullptr
  const T* mask;  // [B] 1 valid / 0 padded, or nullptr (last sub-cell only)
  const A* hblk;  // [B, H] the block's input state (a padded row keeps it; last sub-cell only)
  A* hout;        // [B, H] new state
  T* hlp;         // [B, H] copy of the new state in the GEMM dtype, or nullptr
  T* out;         // [B, H] the step's output (last sub-cell), or nullptr (not last)
  int H;
  A eps;
};

template <typename T, typename A> struct StepBackwardArgs {
  const T* xp;
  const T* hp;
  const T* bh;
  const A* hin;
  const T* lnw;
  const T* lnb;
  const T* drop;
  const A* din;   // [B, H] gradient of the output, direct part (not top)
  const T* gin;   // [B, H] its U-path part, from the caller's GEMM (not top)
  const A* cd;    // [B, H] gradient carried from the later step (direct part)
  const T* cg;    // [B, H] its U-path part, or nullptr (none yet)
  const T* go;    // [B, H] output gradient of this step (top)
  const T* mask;  // [B] or nullptr
  T* dxp;         // [B, in*H] d(input pre-activations) (not written for T-GRUs)
  T* dhp;         // [B, hid*H] d(recurrent pre-activations)
  A* dh;          // [B, H] direct gradient to the input state (base: the new carried gradient)
  A* dlnw;        // [B, groups*H] per-row layer-norm gain gradient accumulators, or nullptr
  A* dlnb;        // [B, groups*H]
  int H;
  A eps;
  bool top;   // last sub-cell of the block: incoming gradient = valid ? cd + cg + go : 0
  bool base;  // first sub-cell: a padded row passes cd + cg through
};

// ---------------------------------------------------------------------------------------------- forward
template <int KIND, typename T, typename A> __global__ void step_forward_kernel(StepForwardArgs<T, A> p) {
  constexpr int NIN = Rows<KIND>::in, NH = Rows<KIND>::hid, NG = Rows<KIND>::groups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* red = reinterpret_cast<A*>(smem_raw);
  A* g = red + kRed;  // [NG*H] pre-activations, then gate values (ATR: p and q)
  const int row = blockIdx.x, H = p.H;
  const T* xr = KIND == kTGRU ? nullptr : p.xp + static_cast<size_t>(row) * NIN * H;
  const T* hr = p.hp + static_cast<size_t>(row) * NH * H;
  const A* h = p.hin + static_cast<size_t>(row) * H;

  if constexpr (KIND == kATR) {
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
      g[j] = ld<A>(xr, j);
      g[H + j] = ld<A>(hr, j) + ld<A>(p.bh, j);
    }
    if (p.lnw) {
      row_normalise(g, H, p.eps, red);
      row_normalise(g + H, H, p.eps, red);
      for (int j = threadIdx.x; j < H; j += blockDim.x) {
        g[j] = g[j] * ld<A>(p.lnw, j) + ld<A>(p.lnb, j);
        g[H + j] = g[H + j] * ld<A>(p.lnw, H + j) + ld<A>(p.lnb, H + j);
      }
    }
  } else {
    for (int k = 0; k < NG; ++k) {
      for (int j = threadIdx.x; j < H; j += blockDim.x) {
        A a = ld<A>(hr, k * H + j) + ld<A>(p.bh, k * H + j);
        if (KIND != kTGRU) a += ld<A>(xr, k * H + j);
        g[k * H + j] = a;
      }
      if (p.lnw) {
        row_normalise(g + k * H, H, p.eps, red);
        for (int j = threadIdx.x; j < H; j += blockDim.x)
          g[k * H + j] = dt_sigmoid(g[k * H + j] * ld<A>(p.lnw, k * H + j) + ld<A>(p.lnb, k * H + j));
      } else {
        for (int j = threadIdx.x; j < H; j += blockDim.x) g[k * H + j] = dt_sigmoid(g[k * H + j]);
      }
    }
  }

  bool valid = true;
  if (p.out && p.mask) valid = ld<float>(p.mask, row) > 0.5f;
  const size_t o = static_cast<size_t>(row) * H;
  for (int j = threadIdx.x; j < H; j += blockDim.x) {
    A hn;
    if constexpr (KIND == kATR) {
      hn = atr_elem_forward<A>(g[j], g[H + j], h[j]);
    } else {
      constexpr GatedInputRows in = gated_input_rows(KIND);
      const A hc = ld<A>(hr, NG * H + j) + ld<A>(p.bh, NG * H + j);
      const A m = p.drop ? ld<A>(p.drop + o, j) : A(1);
      const A xc = in.xc ? ld<A>(xr, NG * H + j) : A(0), lin = in.lin ? ld<A>(xr, (NG + 1) * H + j) : A(0);
      hn = gated_elem_forward<KIND, A>(g[j], g[H + j], NG == 3 ? g[2 * H + j] : A(0), xc, lin, hc, h[j], m);
    }
    A state = hn;
    if (p.out) {
      if (!valid) state = p.hblk[o + j];
      st<A>(p.out + o, j, valid ? hn : A(0));
    }
    p.hout[o + j] = state;
    if (p.hlp) st<A>(p.hlp + o, j, state);
  }
}

// --------------------------------------------------------------------------------------------- backward
// The row's pre-activations recomputed into n [NG*H] and normalised where the cell has layer norm (rstd[k] of group
// k; 1 without).
template <int KIND, typename T, typename A>
__device__ __forceinline__ void backward_preactivations(const StepBackwardArgs<T, A>& p, const T* xr, const T* hr,
                                                        A* n, A* rstd, A* red) {
  constexpr int NG = Rows<KIND>::groups;
  const int H = p.H;
  for (int k = 0; k < NG; ++k) {
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
      A a;
      if constexpr (KIND == kATR) {
        a = k == 0 ? ld<A>(xr, j) : ld<A>(hr, j) + ld<A>(p.bh, j);
      } else {
        a = ld<A>(hr, k * H + j) + ld<A>(p.bh, k * H + j);
        if (KIND != kTGRU) a += ld<A>(xr, k * H + j);
      }
      n[k * H + j] = a;
    }
    rstd[k] = p.lnw != nullptr ? row_normalise(n + k * H, H, p.eps, red) : A(1);
  }
}

// Element j of the row: its output's gradient (top: the carried one plus this step's, 0 on a padded row; else the
// sub-cell above's, direct plus through U) back through the cell's gates: the gates' gradients into d [NG*H], the
// candidate's and the input pre-activations' stored, the input state's gradient into p.dh (a padded base row passes
// the carried gradient through).
template <int KIND, typename T, typename A>
__device__ __forceinline__ void backward_element(const StepBackwardArgs<T, A>& p, int j, size_t o, bool valid,
                                                 const T* xr, const T* hr, T* dxr, T* dhr, const A* n, A* d) {
  constexpr int NG = Rows<KIND>::groups;
  const int H = p.H;
  const A* h = p.hin + o;
  auto post = [&](int k) -> A {  // LN(a) * w + b (or a): the sigmoid's argument / ATR's p, q
    return p.lnw != nullptr ? n[k * H + j] * ld<A>(p.lnw, k * H + j) + ld<A>(p.lnb, k * H + j) : n[k * H + j];
  };
  A carry = A(0);
  if (p.top || p.base) carry = p.cd[o + j] + (p.cg ? ld<A>(p.cg + o, j) : A(0));
  const A dout = p.top ? (valid ? carry + ld<A>(p.go + o, j) : A(0)) : p.din[o + j] + ld<A>(p.gin + o, j);
  A dh;
  if constexpr (KIND == kATR) {
    A dp, dq;
    atr_elem_backward<A>(post(0), post(1), h[j], dout, dp, dq, dh);
    d[j] = dp;
    d[H + j] = dq;
  } else {
    constexpr GatedInputRows in = gated_input_rows(KIND);
    const A r = dt_sigmoid(post(0)), z = dt_sigmoid(post(1)), l = NG == 3 ? dt_sigmoid(post(2)) : A(0);
    const A hc = ld<A>(hr, NG * H + j) + ld<A>(p.bh, NG * H + j);
    const A m = p.drop ? ld<A>(p.drop + o, j) : A(1);
    const A xc = in.xc ? ld<A>(xr, NG * H + j) : A(0), lin = in.lin ? ld<A>(xr, (NG + 1) * H + j) : A(0);
    A dr, dz, dl, dxc, dlin, dhc;
    gated_elem_backward<KIND, A>(r, z, l, xc, lin, hc, h[j], m, dout, dr, dz, dl, dxc, dlin, dhc, dh);
    if constexpr (NG == 3) d[2 * H + j] = dl;
    if constexpr (in.xc) st<A>(dxr, NG * H + j, dxc);
    if constexpr (in.lin) st<A>(dxr, (NG + 1) * H + j, dlin);
    d[j] = dr;
    d[H + j] = dz;
    st<A>(dhr, NG * H + j, dhc);
  }
  if (p.base && !valid) dh = carry;
  p.dh[o + j] = dh;
}

// The gates' gradients d [NG*H] through the layer norms (row-owned gain / offset accumulators: deterministic), then
// stored as the recurrent (and input) pre-activations' gradients.
template <int KIND, typename T, typename A>
__device__ __forceinline__ void backward_store(const StepBackwardArgs<T, A>& p, int row, T* dxr, T* dhr,
                                               const A* n, A* d, const A* rstd, A* red) {
  constexpr int NG = Rows<KIND>::groups;
  const int H = p.H;
  for (int k = 0; k < NG; ++k) {
    if (p.lnw != nullptr) {
      A* dw = p.dlnw + static_cast<size_t>(row) * NG * H + k * H;
      A* db = p.dlnb + static_cast<size_t>(row) * NG * H + k * H;
      for (int j = threadIdx.x; j < H; j += blockDim.x) {
        dw[j] += d[k * H + j] * n[k * H + j];
        db[j] += d[k * H + j];
        d[k * H + j] *= ld<A>(p.lnw, k * H + j);
      }
      row_normalise_backward(n + k * H, d + k * H, H, rstd[k], red);
    }
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
      const A v = d[k * H + j];
      if constexpr (KIND == kATR) {
        if (k == 0) st<A>(dxr, j, v);
        else st<A>(dhr, j, v);
      } else {
        st<A>(dhr, k * H + j, v);
        if (KIND != kTGRU) st<A>(dxr, k * H + j, v);
      }
    }
  }
}

template <int KIND, typename T, typename A> __global__ void step_backward_kernel(StepBackwardArgs<T, A> p) {
  constexpr int NIN = Rows<KIND>::in, NH = Rows<KIND>::hid, NG = Rows<KIND>::groups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* red = reinterpret_cast<A*>(smem_raw);
  const int row = blockIdx.x, H = p.H;
  A* n = red + kRed;  // [NG*H] normalised (or raw) pre-activations
  A* d = n + NG * H;  // [NG*H] their gradients
  const size_t o = static_cast<size_t>(row) * H;
  const T* xr = KIND == kTGRU ? nullptr : p.xp + static_cast<size_t>(row) * NIN * H;
  const T* hr = p.hp + static_cast<size_t>(row) * NH * H;
  T* dxr = KIND == kTGRU ? nullptr : p.dxp + static_cast<size_t>(row) * NIN * H;
  T* dhr = p.dhp + static_cast<size_t>(row) * NH * H;
  const bool valid = !p.mask || ld<float>(p.mask, row) > 0.5f;
  A rstd[NG];
  backward_preactivations<KIND>(p, xr, hr, n, rstd, red);
  for (int j = threadIdx.x; j < H; j += blockDim.x) backward_element<KIND>(p, j, o, valid, xr, hr, dxr, dhr, n, d);
  backward_store<KIND>(p, row, dxr, dhr, n, d, rstd, red);
}

// ------------------------------------------------------------------------------------------- row GEMM
// The time loops' recurrent products for B <= 8 rows (the driver's choice): c[M, N] = a[M, K] . w^T, w [N, K]
// row-major (the forward's h U^T; the backward's d(U h) U multiplies by U^T, transposed once per call by the
// driver). One warp per output column n: its lanes stride over k, so each load of w's row n is one coalesced
// 128-byte line per warp, and the row is read once for up to kGemmRowsPerPass rows of a, whose partial sums stay
// in registers (a is a few KB and stays in L1). kGemmWarps warps a block, so N columns are N warps spread over
// the device: at N = H = 512, 512 warps against the tiled GEMM's 16 blocks of 32 columns. Larger M re-reads w
// once per pass, which is why the tiled GEMM takes over above 8 rows. Each output is its lanes' partials
// (ascending k, stride 32) summed by a fixed butterfly, so a row's result does not depend on M or the launch.
constexpr int kGemmWarps = 8, kGemmThreads = 32 * kGemmWarps, kGemmRowsPerPass = 8;

template <typename T> struct GemmArgs {
  const T* a;  // [M, K]
  const T* w;  // [N, K]; the tiled GEMM's W_T = false: [K, N]
  T* c;        // [M, N]
  int M, N, K;
};

template <typename T, typename A> __global__ void rows_gemm_kernel(GemmArgs<T> p) {
  const int n = blockIdx.x * kGemmWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= p.N) return;  // the whole warp: its shuffles below need all 32 lanes or none
  const T* wr = p.w + static_cast<size_t>(n) * p.K;
  for (int m0 = 0; m0 < p.M; m0 += kGemmRowsPerPass) {
    const int rows = p.M - m0 < kGemmRowsPerPass ? p.M - m0 : kGemmRowsPerPass;
    const T* ar = p.a + static_cast<size_t>(m0) * p.K;
    A acc[kGemmRowsPerPass];
#pragma unroll
    for (int i = 0; i < kGemmRowsPerPass; ++i) acc[i] = A(0);
#pragma unroll 4
    for (int k = lane; k < p.K; k += 32) {
      const A wv = ld<A>(wr, k);
#pragma unroll
      for (int i = 0; i < kGemmRowsPerPass; ++i)
        if (i < rows) acc[i] += ld<A>(ar + static_cast<size_t>(i) * p.K, k) * wv;
    }
#pragma unroll
    for (int i = 0; i < kGemmRowsPerPass; ++i) {
      if (i >= rows) break;  // rows is the same for the whole warp
      const A v = warp_sum(acc[i]);
      if (lane == 0) st<A>(p.c + static_cast<size_t>(m0 + i) * p.N, n, v);
    }
  }
}

template <typename T, typename A> inline cudaError_t launch_rows_gemm(const GemmArgs<T>& g, cudaStream_t stream) {
  const int grid = (g.N + kGemmWarps - 1) / kGemmWarps;
  if (grid == 0 || g.M == 0) return cudaSuccess;   // (nothing to compute; a GPU refuses a grid of no blocks)
  auto* kernel = &rows_gemm_kernel<T, A>;
  DTMT_LAUNCH(kernel, grid, kGemmThreads, 0, stream, g);
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------- tiled GEMM
// The time loops' recurrent products for 8 < B <= 64 rows (the driver's choice; the row GEMM above is faster up
// to 8, this one from about 8 up: docs/design/gpu.md, "Step GEMMs"): c[M, N] = a[M, K] . w^T with w [N, K]
// row-major (W_T: the forward's h U^T) or a[M, K] . w with w [K, N] (the backward's d(U h) U). One block per
// kGemmBM x kGemmBN tile of c (1-D grid, column tiles fastest), kTiledThreads threads: each owns one column of
// the tile and kGemmRows consecutive rows (a warp shares its rows, so the a-tile reads are broadcasts). K is
// staged through shared memory in chunks of gemm_bk<A>() (25 KB of tiles: few chunks, since each chunk's loads
// are a round trip to L2 that the block waits for), converted to the accumulation type A; each output is a sum
// in ascending k, so the result does not depend on the launch.
constexpr int kGemmBM = 16, kGemmBN = 32, kTiledThreads = 128;
constexpr int kGemmRows = kGemmBM * kGemmBN / kTiledThreads;
template <typename A> __host__ __device__ constexpr int gemm_bk() { return sizeof(A) == 8 ? 64 : 128; }
template <typename A> inline size_t gemm_smem() {
  return sizeof(A) * (kGemmBM * gemm_bk<A>() + gemm_bk<A>() * (kGemmBN + 1));
}

template <bool W_T, typename T, typename A> __global__ void tiled_gemm_kernel(GemmArgs<T> p) {
  constexpr int kGemmBK = gemm_bk<A>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* as = reinterpret_cast<A*>(smem_raw);  // [kGemmBM][kGemmBK]
  A* ws = as + kGemmBM * kGemmBK;          // [kGemmBK][kGemmBN + 1] (padded: the transposing stores of W_T)
  const int tiles_n = (p.N + kGemmBN - 1) / kGemmBN;
  const int m0 = (blockIdx.x / tiles_n) * kGemmBM, n0 = (blockIdx.x % tiles_n) * kGemmBN;
  const int col = threadIdx.x % kGemmBN, r0 = (threadIdx.x / kGemmBN) * kGemmRows;
  A acc[kGemmRows];
  for (int i = 0; i < kGemmRows; ++i) acc[i] = A(0);
  for (int k0 = 0; k0 < p.K; k0 += kGemmBK) {
    for (int e = threadIdx.x; e < kGemmBM * kGemmBK; e += kTiledThreads) {
      const int m = m0 + e / kGemmBK, k = k0 + e % kGemmBK;
      as[e] = (m < p.M && k < p.K) ? ld<A>(p.a + static_cast<size_t>(m) * p.K, k) : A(0);
    }
    for (int e = threadIdx.x; e < kGemmBN * kGemmBK; e += kTiledThreads) {
      const int n = W_T ? e / kGemmBK : e % kGemmBN, kk = W_T ? e % kGemmBK : e / kGemmBN;
      const int gn = n0 + n, gk = k0 + kk;
      A v = A(0);
      if (gn < p.N && gk < p.K)
        v = W_T ? ld<A>(p.w + static_cast<size_t>(gn) * p.K, gk) : ld<A>(p.w + static_cast<size_t>(gk) * p.N, gn);
      ws[kk * (kGemmBN + 1) + n] = v;
    }
    __syncthreads();
    for (int kk = 0; kk < kGemmBK; ++kk) {
      const A wv = ws[kk * (kGemmBN + 1) + col];
      for (int i = 0; i < kGemmRows; ++i) acc[i] += as[(r0 + i) * kGemmBK + kk] * wv;
    }
    __syncthreads();
  }
  const int n = n0 + col;
  if (n >= p.N) return;
  for (int i = 0; i < kGemmRows; ++i) {
    const int m = m0 + r0 + i;
    if (m < p.M) st<A>(p.c + static_cast<size_t>(m) * p.N, n, acc[i]);
  }
}

template <bool W_T, typename T, typename A>
inline cudaError_t launch_tiled_gemm(const GemmArgs<T>& g, cudaStream_t stream) {
  const int grid = ((g.M + kGemmBM - 1) / kGemmBM) * ((g.N + kGemmBN - 1) / kGemmBN);
  if (grid == 0) return cudaSuccess;   // (no rows, B = 0: a GPU refuses a grid of no blocks)
  const size_t smem = gemm_smem<A>();
  auto* kernel = &tiled_gemm_kernel<W_T, T, A>;
  DTMT_LAUNCH(kernel, grid, kTiledThreads, smem, stream, g);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------- launch
template <int KIND, typename A> inline size_t forward_smem(int H) {
  return sizeof(A) * (kRed + static_cast<size_t>(Rows<KIND>::groups) * H);
}
template <int KIND, typename A> inline size_t backward_smem(int H) {
  return sizeof(A) * (kRed + 2 * static_cast<size_t>(Rows<KIND>::groups) * H);
}

template <typename F> inline cudaError_t allow_smem(F* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <int KIND, typename T, typename A>
inline cudaError_t launch_forward_kind(const StepForwardArgs<T, A>& a, int B, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;   // (a block a batch row: none; a GPU refuses a grid of no blocks)
  const size_t smem = forward_smem<KIND, A>(a.H);
  auto* kernel = &step_forward_kernel<KIND, T, A>;
  cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  DTMT_LAUNCH(kernel, B, block_threads(a.H), smem, stream, a);
  return cudaGetLastError();
}

template <int KIND, typename T, typename A>
inline cudaError_t launch_backward_kind(const StepBackwardArgs<T, A>& a, int B, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const size_t smem = backward_smem<KIND, A>(a.H);
  auto* kernel = &step_backward_kernel<KIND, T, A>;
  cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  DTMT_LAUNCH(kernel, B, block_threads(a.H), smem, stream, a);
  return cudaGetLastError();
}

// kind: kGRU, kLGRU, kLAU, kATR (base cells) or kTGRU.
template <typename T, typename A>
cudaError_t launch_step_forward(int kind, const StepForwardArgs<T, A>& a, int B, cudaStream_t stream) {
#define DTMT_CASE(K) \
  case K: return launch_forward_kind<K, T, A>(a, B, stream);
  switch (kind) {
    DTMT_FOR_EACH_CELL_KIND(DTMT_CASE)
    default: return cudaErrorInvalidValue;
  }
#undef DTMT_CASE
}

template <typename T, typename A>
cudaError_t launch_step_backward(int kind, const StepBackwardArgs<T, A>& a, int B, cudaStream_t stream) {
#define DTMT_CASE(K) \
  case K: return launch_backward_kind<K, T, A>(a, B, stream);
  switch (kind) {
    DTMT_FOR_EACH_CELL_KIND(DTMT_CASE)
    default: return cudaErrorInvalidValue;
  }
#undef DTMT_CASE
}

}  // namespace cuda
}  // namespace dtmt
