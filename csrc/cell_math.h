// Per-element and per-row math of the recurrent cells (contract §2), free of any framework.
//
// Everything here is `DTMT_HD` (host + device inline), so the C++ CPU kernels (isa/transition_rows.cpp) and the
// CUDA kernels share one definition of each gate, candidate, state update and layer norm, forward and
// backward. The row functions loop over one batch row of H features; the element functions are what a
// CUDA kernel with one thread per feature calls directly.
//
// Row layouts (pre-activations, one batch row; "x" rows come from the input GEMM W x + b_ih, "h" rows from
// the recurrent GEMM U h + b_hh):
//   GRU   x: [r z c]        h: [r z c]      gates r z      c = tanh(xc + r*hc)
//   LGRU  x: [r z l c lin]  h: [r z l c]    gates r z l    c = tanh(xc + r*hc) + l*lin
//   LAU   x: [r z g c lin]  h: [r z g c]    gates r z g    c = tanh((1-r)*xc + r*hc); h' = ((1-z)h + z c)(1-g) + g lin
//   TGRU  x: none           h: [r z c]      gates r z      c = tanh(r*hc)
//   ATR   x: [p]            h: [q]          i = σ(p+q), f = σ(p-q), h' = i p + f h
// With layer norm on, gate k's pre-activation a_k = x_k + h_k is replaced by LN(a_k)*w_k + b_k before the
// sigmoid (ATR: p and q are normalised separately). Candidate dropout multiplies the candidate c.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DTMT_HD __host__ __device__ __forceinline__
#define DTMT_RESTRICT __restrict__
#else
#define DTMT_HD inline
#define DTMT_RESTRICT __restrict__
#endif

// Row reductions (layer-norm statistics) vectorise on the host only with an explicit simd reduction; the
// compiler may not reorder a plain floating-point sum by itself. Ignored where OpenMP is off or on device.
#if defined(_OPENMP) && !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__)
#define DTMT_PRAGMA(x) _Pragma(#x)
#define DTMT_SIMD_SUM(...) DTMT_PRAGMA(omp simd reduction(+ : __VA_ARGS__))
#define DTMT_SIMD_MAX(...) DTMT_PRAGMA(omp simd reduction(max : __VA_ARGS__))
#define DTMT_SIMD DTMT_PRAGMA(omp simd)
#else
#define DTMT_SIMD
#define DTMT_SIMD_SUM(...)
#define DTMT_SIMD_MAX(...)
#endif

// The CPU loops are compiled once per instruction set (csrc/isa/kernels.h, with -DDTMT_ISA=<name>): each copy
// of these inline functions goes into a namespace of its own, or the linker could keep an AVX-512 copy of one
// for code that runs on any CPU. Everything else (the torch-facing C++, the CUDA code) uses default_target.
#ifndef DTMT_ISA
#define DTMT_CELL_MATH_NS default_target
#else
#define DTMT_CELL_MATH_NS DTMT_ISA
#endif

namespace dtmt {
inline namespace DTMT_CELL_MATH_NS {

// The cells' kind numbers and row counts: the one table of the row layout, dtmt_kernels/ops/transition/layout.py's
// CELLS, which setup.py writes into cell_layout.inc (the C++ and CUDA kernels read it from there).
#include "cell_layout.inc"

// ---------------------------------------------------------------------------------------------------------
// Scalar functions. On the host, float uses a branch-free exp (Cody-Waite reduction + degree-6 polynomial,
// ~2 ulp) so the feature loops vectorise; double uses libm so float64 gradchecks see exact math.
// ---------------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
DTMT_HD float dt_exp(float x) { return expf(x); }
DTMT_HD double dt_exp(double x) { return exp(x); }
#else
inline float dt_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // n = round(x / ln 2) with the 1.5 * 2^23 trick (exact for |n| < 2^22, no rounding instruction needed).
  const float shifter = 12582912.0f;
  float t = x * 1.44269504088896341f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693145751953125f;       // ln2 high part (exact product)
  r = r - n * 1.428606765330187045e-06f;       // ln2 low part
  // e^r on [-ln2/2, ln2/2]
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t ti;
  std::memcpy(&ti, &t, sizeof(ti));
  int32_t bits = (ti - 0x4B400000 + 127) << 23;  // 2^n: low bits of t hold n + 2^22 + 2^23
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline double dt_exp(double x) { return std::exp(x); }
#endif

template <typename A> DTMT_HD A dt_sigmoid(A x) { return A(1) / (A(1) + dt_exp(-x)); }

// tanh(x) = 1 - 2 / (e^{2x} + 1): one exp, saturates cleanly at both ends.
DTMT_HD float dt_tanh(float x) { return 1.0f - 2.0f / (dt_exp(2.0f * x) + 1.0f); }
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
DTMT_HD double dt_tanh(double x) { return tanh(x); }
#else
inline double dt_tanh(double x) { return std::tanh(x); }
#endif

template <typename A> DTMT_HD A dt_rsqrt(A x) { return A(1) / sqrt(x); }

// ---------------------------------------------------------------------------------------------------------
// Element functions: one feature of one cell, given the gate values (already through the sigmoid).
// Forward returns the new state; backward takes dh' and returns the gradients of the pre-sigmoid gates
// (d*_pre), of the candidate's input / recurrent parts, of the linear input and the direct path to h.
// ---------------------------------------------------------------------------------------------------------

// GRU and T-GRU (xc = 0): c = m * tanh(xc + r*hc); h' = (1-z) h + z c
template <typename A> DTMT_HD A gru_elem_forward(A r, A z, A xc, A hc, A h, A m) {
  A c = m * dt_tanh(xc + r * hc);
  return h + z * (c - h);
}
template <typename A>
DTMT_HD void gru_elem_backward(A r, A z, A xc, A hc, A h, A m, A dhn, A& dr_pre, A& dz_pre, A& dxc, A& dhc,
                               A& dh) {
  A tc = dt_tanh(xc + r * hc);
  A c = m * tc;
  A du = dhn * z * m * (A(1) - tc * tc);
  dxc = du;
  dhc = du * r;
  dr_pre = du * hc * r * (A(1) - r);
  dz_pre = dhn * (c - h) * z * (A(1) - z);
  dh = dhn * (A(1) - z);
}

// L-GRU: c = m * (tanh(xc + r*hc) + l*lin); h' = (1-z) h + z c
template <typename A> DTMT_HD A lgru_elem_forward(A r, A z, A l, A xc, A lin, A hc, A h, A m) {
  A c = m * (dt_tanh(xc + r * hc) + l * lin);
  return h + z * (c - h);
}
template <typename A>
DTMT_HD void lgru_elem_backward(A r, A z, A l, A xc, A lin, A hc, A h, A m, A dhn, A& dr_pre, A& dz_pre,
                                A& dl_pre, A& dxc, A& dlin, A& dhc, A& dh) {
  A tc = dt_tanh(xc + r * hc);
  A c = m * (tc + l * lin);
  A dc = dhn * z * m;  // gradient w.r.t. the undropped candidate
  A du = dc * (A(1) - tc * tc);
  dxc = du;
  dhc = du * r;
  dlin = dc * l;
  dl_pre = dc * lin * l * (A(1) - l);
  dr_pre = du * hc * r * (A(1) - r);
  dz_pre = dhn * (c - h) * z * (A(1) - z);
  dh = dhn * (A(1) - z);
}

// LAU: c = m * tanh((1-r) xc + r hc); s = (1-z) h + z c; h' = s (1-g) + g lin
template <typename A> DTMT_HD A lau_elem_forward(A r, A z, A g, A xc, A lin, A hc, A h, A m) {
  A c = m * dt_tanh((A(1) - r) * xc + r * hc);
  A s = h + z * (c - h);
  return s + g * (lin - s);
}
template <typename A>
DTMT_HD void lau_elem_backward(A r, A z, A g, A xc, A lin, A hc, A h, A m, A dhn, A& dr_pre, A& dz_pre,
                               A& dg_pre, A& dxc, A& dlin, A& dhc, A& dh) {
  A tc = dt_tanh((A(1) - r) * xc + r * hc);
  A c = m * tc;
  A s = h + z * (c - h);
  A ds = dhn * (A(1) - g);
  dg_pre = dhn * (lin - s) * g * (A(1) - g);
  dlin = dhn * g;
  A du = ds * z * m * (A(1) - tc * tc);
  dxc = du * (A(1) - r);
  dhc = du * r;
  dr_pre = du * (hc - xc) * r * (A(1) - r);
  dz_pre = ds * (c - h) * z * (A(1) - z);
  dh = ds * (A(1) - z);
}

// A gated kind's element by its kind number: the one place a gated cell's element is chosen (the CPU rows below,
// the CUDA per-step and persistent kernels all call these). What it reads beyond the gates r, z and the third gate
// l (NG = 3): the candidate's input row xc, row NG of the input products (none for a T-GRU: 0), and, where the
// input projection has a row more (L-GRU, LAU), the linear path's lin after it (else 0); gated_input_rows says
// which. A new gated cell adds its branch to both functions.
struct GatedInputRows {
  bool xc, lin;
};
DTMT_HD constexpr GatedInputRows gated_input_rows(int kind) {
  return {cell_input_rows(kind) > 0, cell_input_rows(kind) > cell_ln_groups(kind) + 1};
}
template <int KIND, typename A> DTMT_HD A gated_elem_forward(A r, A z, A l, A xc, A lin, A hc, A h, A m) {
  if constexpr (KIND == kGRU || KIND == kTGRU) {
    return gru_elem_forward<A>(r, z, xc, hc, h, m);
  } else if constexpr (KIND == kLGRU) {
    return lgru_elem_forward<A>(r, z, l, xc, lin, hc, h, m);
  // (a new gated kind: its forward branch here)
  } else {
    static_assert(KIND == kLAU, "gated_elem_forward: a gated kind without its element");
    return lau_elem_forward<A>(r, z, l, xc, lin, hc, h, m);
  }
}
// dl_pre and dlin are left 0 for a kind without them.
template <int KIND, typename A>
DTMT_HD void gated_elem_backward(A r, A z, A l, A xc, A lin, A hc, A h, A m, A dhn, A& dr_pre, A& dz_pre,
                                 A& dl_pre, A& dxc, A& dlin, A& dhc, A& dh) {
  dl_pre = A(0);
  dlin = A(0);
  if constexpr (KIND == kGRU || KIND == kTGRU) {
    gru_elem_backward<A>(r, z, xc, hc, h, m, dhn, dr_pre, dz_pre, dxc, dhc, dh);
  } else if constexpr (KIND == kLGRU) {
    lgru_elem_backward<A>(r, z, l, xc, lin, hc, h, m, dhn, dr_pre, dz_pre, dl_pre, dxc, dlin, dhc, dh);
  // (a new gated kind: its backward branch here)
  } else {
    static_assert(KIND == kLAU, "gated_elem_backward: a gated kind without its element");
    lau_elem_backward<A>(r, z, l, xc, lin, hc, h, m, dhn, dr_pre, dz_pre, dl_pre, dxc, dlin, dhc, dh);
  }
}

// ATR: i = σ(p+q), f = σ(p-q), h' = i p + f h  (p, q after their optional layer norms)
template <typename A> DTMT_HD A atr_elem_forward(A p, A q, A h) {
  return dt_sigmoid(p + q) * p + dt_sigmoid(p - q) * h;
}
template <typename A> DTMT_HD void atr_elem_backward(A p, A q, A h, A dhn, A& dp, A& dq, A& dh) {
  A i = dt_sigmoid(p + q);
  A f = dt_sigmoid(p - q);
  A da = dhn * p * i * (A(1) - i);  // through i = σ(p + q)
  A db = dhn * h * f * (A(1) - f);  // through f = σ(p - q)
  dp = dhn * i + da + db;
  dq = da - db;
  dh = dhn * f;
}

// ---------------------------------------------------------------------------------------------------------
// Layer norm over one row of H values (biased variance, as torch.nn.functional.layer_norm).
// ---------------------------------------------------------------------------------------------------------

// In place: a[0..H) -> (a - mean) * rstd; returns rstd.
template <typename A> DTMT_HD A layer_norm_row_normalise(int H, A* DTMT_RESTRICT a, A eps) {
  A mean = 0;
  DTMT_SIMD_SUM(mean)
  for (int j = 0; j < H; ++j) mean += a[j];
  mean /= A(H);
  A var = 0;
  DTMT_SIMD_SUM(var)
  for (int j = 0; j < H; ++j) {
    A d = a[j] - mean;
    var += d * d;
  }
  var /= A(H);
  A rstd = dt_rsqrt(var + eps);
  for (int j = 0; j < H; ++j) a[j] = (a[j] - mean) * rstd;
  return rstd;
}

// Given n (normalised values), rstd, and dn = d(loss)/d(n), returns da in dn's place:
// da = rstd * (dn - mean(dn) - n * mean(dn * n)).
template <typename A>
DTMT_HD void layer_norm_row_backward(int H, const A* DTMT_RESTRICT n, A rstd, A* DTMT_RESTRICT dn) {
  A s1 = 0, s2 = 0;
  DTMT_SIMD_SUM(s1, s2)
  for (int j = 0; j < H; ++j) {
    s1 += dn[j];
    s2 += dn[j] * n[j];
  }
  s1 /= A(H);
  s2 /= A(H);
  for (int j = 0; j < H; ++j) dn[j] = rstd * (dn[j] - s1 - n[j] * s2);
}

// ---------------------------------------------------------------------------------------------------------
// Row functions: one batch row of one sub-cell. T = storage type, A = accumulation type.
// scratch must hold 3 * cell_ln_groups(KIND) * H values of A.
// ---------------------------------------------------------------------------------------------------------

// Gates (r, z [, l|g]) for one row: g[k*H + j] = σ(pre), with pre = a or LN(a)*w + b, a = x_k + h_k.
// n (optional) receives the normalised values and rstd the per-gate 1/std, for the backward pass.
template <typename T, typename A>
DTMT_HD void gates_forward_row(int ngates, int H, const T* DTMT_RESTRICT xp, const T* DTMT_RESTRICT hp,
                               const T* DTMT_RESTRICT lnw, const T* DTMT_RESTRICT lnb, A eps,
                               A* DTMT_RESTRICT g, A* DTMT_RESTRICT n, A* DTMT_RESTRICT rstd) {
  for (int k = 0; k < ngates; ++k) {
    A* gk = g + k * H;
    const T* hk = hp + k * H;
    if (xp) {
      const T* xk = xp + k * H;
      for (int j = 0; j < H; ++j) gk[j] = A(xk[j]) + A(hk[j]);
    } else {
      for (int j = 0; j < H; ++j) gk[j] = A(hk[j]);
    }
    if (lnw) {
      A rs = layer_norm_row_normalise(H, gk, eps);
      if (rstd) rstd[k] = rs;
      const T* wk = lnw + k * H;
      const T* bk = lnb + k * H;
      if (n) {
        A* nk = n + k * H;
        for (int j = 0; j < H; ++j) nk[j] = gk[j];
      }
      for (int j = 0; j < H; ++j) gk[j] = dt_sigmoid(gk[j] * A(wk[j]) + A(bk[j]));
    } else {
      for (int j = 0; j < H; ++j) gk[j] = dt_sigmoid(gk[j]);
    }
  }
}

// Backward of the gates: dpre[k*H + j] holds d/d(pre-sigmoid). Writes da to dxp (if any) and dhp gate
// rows, accumulates the layer-norm gain/offset gradients of this row into dlnw/dlnb.
template <typename T, typename A>
DTMT_HD void gates_backward_row(int ngates, int H, const T* DTMT_RESTRICT lnw, const A* DTMT_RESTRICT n,
                                const A* DTMT_RESTRICT rstd, A* DTMT_RESTRICT dpre, T* DTMT_RESTRICT dxp,
                                T* DTMT_RESTRICT dhp, T* DTMT_RESTRICT dlnw, T* DTMT_RESTRICT dlnb) {
  for (int k = 0; k < ngates; ++k) {
    A* dk = dpre + k * H;
    if (lnw) {
      const A* nk = n + k * H;
      const T* wk = lnw + k * H;
      T* dwk = dlnw + k * H;
      T* dbk = dlnb + k * H;
      for (int j = 0; j < H; ++j) {
        dwk[j] += T(dk[j] * nk[j]);
        dbk[j] += T(dk[j]);
        dk[j] *= A(wk[j]);
      }
      layer_norm_row_backward(H, nk, rstd[k], dk);
    }
    T* dhk = dhp + k * H;
    for (int j = 0; j < H; ++j) dhk[j] = T(dk[j]);
    if (dxp) {
      T* dxk = dxp + k * H;
      for (int j = 0; j < H; ++j) dxk[j] = T(dk[j]);
    }
  }
}

// The element loop of gated_forward_row: DROP (candidate dropout present) is a template argument so that the loop
// has no branch on it and vectorises (a per-element `drop ? drop[j] : 1` kept it scalar: a conditional load).
template <int KIND, bool DROP, typename T, typename A>
DTMT_HD void gated_forward_elems(int H, const A* DTMT_RESTRICT g, const T* DTMT_RESTRICT xp,
                                 const T* DTMT_RESTRICT hp, const T* DTMT_RESTRICT h,
                                 const T* DTMT_RESTRICT drop, T* DTMT_RESTRICT out) {
  constexpr int NG = cell_ln_groups(KIND);
  const A* r = g;
  const A* z = g + H;
  const A* l = g + 2 * H;  // l (L-GRU) or g (LAU)
  const T* hc = hp + (NG)*H;
  constexpr GatedInputRows in = gated_input_rows(KIND);
  DTMT_SIMD   // no dependence between elements (without it GCC versions the loop on a runtime alias check)
  for (int j = 0; j < H; ++j) {
    const A m = DROP ? A(drop[j]) : A(1);
    const A xc = in.xc ? A(xp[NG * H + j]) : A(0), lin = in.lin ? A(xp[(NG + 1) * H + j]) : A(0);
    out[j] = T(gated_elem_forward<KIND, A>(r[j], z[j], NG == 3 ? l[j] : A(0), xc, lin, A(hc[j]), A(h[j]), m));
  }
}

// Forward of one row of a gated cell (GRU, L-GRU, LAU, T-GRU). drop may be null (no candidate dropout).
template <int KIND, typename T, typename A>
DTMT_HD void gated_forward_row(int H, const T* DTMT_RESTRICT xp, const T* DTMT_RESTRICT hp,
                               const T* DTMT_RESTRICT h, const T* DTMT_RESTRICT lnw,
                               const T* DTMT_RESTRICT lnb, const T* DTMT_RESTRICT drop, A eps,
                               A* DTMT_RESTRICT scratch, T* DTMT_RESTRICT out) {
  constexpr int NG = cell_ln_groups(KIND);
  A* g = scratch;
  gates_forward_row<T, A>(NG, H, KIND == kTGRU ? nullptr : xp, hp, lnw, lnb, eps, g, nullptr, nullptr);
  if (drop) {
    gated_forward_elems<KIND, true, T, A>(H, g, xp, hp, h, drop, out);
  } else {
    gated_forward_elems<KIND, false, T, A>(H, g, xp, hp, h, drop, out);
  }
}

// The element loop of gated_backward_row (DROP a template argument, as for gated_forward_elems).
template <int KIND, bool DROP, typename T, typename A>
DTMT_HD void gated_backward_elems(int H, const A* DTMT_RESTRICT g, const T* DTMT_RESTRICT xp,
                                  const T* DTMT_RESTRICT hp, const T* DTMT_RESTRICT h,
                                  const T* DTMT_RESTRICT drop, const T* DTMT_RESTRICT dout,
                                  A* DTMT_RESTRICT dpre, T* DTMT_RESTRICT dxp, T* DTMT_RESTRICT dhp,
                                  T* DTMT_RESTRICT dh) {
  constexpr int NG = cell_ln_groups(KIND);
  const A* r = g;
  const A* z = g + H;
  const A* l = g + 2 * H;
  const T* hc = hp + NG * H;
  T* dhc = dhp + NG * H;
  constexpr GatedInputRows in = gated_input_rows(KIND);
  DTMT_SIMD   // as in gated_forward_elems
  for (int j = 0; j < H; ++j) {
    const A m = DROP ? A(drop[j]) : A(1);
    const A xc = in.xc ? A(xp[NG * H + j]) : A(0), lin = in.lin ? A(xp[(NG + 1) * H + j]) : A(0);
    A dr, dz, dl, dxc, dlin, dhcj, dhj;
    gated_elem_backward<KIND, A>(r[j], z[j], NG == 3 ? l[j] : A(0), xc, lin, A(hc[j]), A(h[j]), m, A(dout[j]), dr,
                                 dz, dl, dxc, dlin, dhcj, dhj);
    if (in.xc) dxp[NG * H + j] = T(dxc);
    if (in.lin) dxp[(NG + 1) * H + j] = T(dlin);
    dpre[j] = dr;
    dpre[H + j] = dz;
    if (NG == 3) dpre[2 * H + j] = dl;
    dhc[j] = T(dhcj);
    dh[j] = T(dhj);
  }
}

// Backward of one row of a gated cell: recomputes the forward from (xp, hp, h), takes dout = dL/dh', and
// writes dxp (input rows; not for T-GRU), dhp (recurrent rows) and dh (direct path only: the path through
// U h is added by the caller's GEMM). Layer-norm parameter gradients are accumulated into dlnw/dlnb.
template <int KIND, typename T, typename A>
DTMT_HD void gated_backward_row(int H, const T* DTMT_RESTRICT xp, const T* DTMT_RESTRICT hp,
                                const T* DTMT_RESTRICT h, const T* DTMT_RESTRICT lnw,
                                const T* DTMT_RESTRICT lnb, const T* DTMT_RESTRICT drop, A eps,
                                const T* DTMT_RESTRICT dout, A* DTMT_RESTRICT scratch, T* DTMT_RESTRICT dxp,
                                T* DTMT_RESTRICT dhp, T* DTMT_RESTRICT dh, T* DTMT_RESTRICT dlnw,
                                T* DTMT_RESTRICT dlnb) {
  constexpr int NG = cell_ln_groups(KIND);
  A* g = scratch;
  A* n = scratch + NG * H;
  A* dpre = scratch + 2 * NG * H;
  A rstd[3];
  const T* xin = KIND == kTGRU ? nullptr : xp;
  gates_forward_row<T, A>(NG, H, xin, hp, lnw, lnb, eps, g, n, rstd);
  if (drop) {
    gated_backward_elems<KIND, true, T, A>(H, g, xp, hp, h, drop, dout, dpre, dxp, dhp, dh);
  } else {
    gated_backward_elems<KIND, false, T, A>(H, g, xp, hp, h, drop, dout, dpre, dxp, dhp, dh);
  }
  gates_backward_row<T, A>(NG, H, lnw, n, rstd, dpre, KIND == kTGRU ? nullptr : dxp, dhp, dlnw, dlnb);
}

// ATR row forward. With layer norm, lnw/lnb hold [p | q] gains and offsets.
template <typename T, typename A>
DTMT_HD void atr_forward_row(int H, const T* DTMT_RESTRICT xp, const T* DTMT_RESTRICT hp,
                             const T* DTMT_RESTRICT h, const T* DTMT_RESTRICT lnw, const T* DTMT_RESTRICT lnb,
                             A eps, A* DTMT_RESTRICT scratch, T* DTMT_RESTRICT out) {
  A* p = scratch;
  A* q = scratch + H;
  for (int j = 0; j < H; ++j) {
    p[j] = A(xp[j]);
    q[j] = A(hp[j]);
  }
  if (lnw) {
    layer_norm_row_normalise(H, p, eps);
    layer_norm_row_normalise(H, q, eps);
    for (int j = 0; j < H; ++j) {
      p[j] = p[j] * A(lnw[j]) + A(lnb[j]);
      q[j] = q[j] * A(lnw[H + j]) + A(lnb[H + j]);
    }
  }
  DTMT_SIMD
  for (int j = 0; j < H; ++j) out[j] = T(atr_elem_forward<A>(p[j], q[j], A(h[j])));
}

// The element loop of atr_backward_row: LN (layer norm present) is a template argument, as DROP is for
// gated_backward_elems (a per-element `lnw ? ... : ...` is a conditional load, which kept the loop scalar).
template <bool LN, typename T, typename A>
DTMT_HD void atr_backward_elems(int H, const A* DTMT_RESTRICT np, const A* DTMT_RESTRICT nq,
                                const T* DTMT_RESTRICT lnw, const T* DTMT_RESTRICT lnb, const T* DTMT_RESTRICT h,
                                const T* DTMT_RESTRICT dout, A* DTMT_RESTRICT dp, A* DTMT_RESTRICT dq,
                                T* DTMT_RESTRICT dh) {
  DTMT_SIMD
  for (int j = 0; j < H; ++j) {
    A p = LN ? np[j] * A(lnw[j]) + A(lnb[j]) : np[j];
    A q = LN ? nq[j] * A(lnw[H + j]) + A(lnb[H + j]) : nq[j];
    A dhj;
    atr_elem_backward<A>(p, q, A(h[j]), A(dout[j]), dp[j], dq[j], dhj);
    dh[j] = T(dhj);
  }
}

template <typename T, typename A>
DTMT_HD void atr_backward_row(int H, const T* DTMT_RESTRICT xp, const T* DTMT_RESTRICT hp,
                              const T* DTMT_RESTRICT h, const T* DTMT_RESTRICT lnw, const T* DTMT_RESTRICT lnb,
                              A eps, const T* DTMT_RESTRICT dout, A* DTMT_RESTRICT scratch,
                              T* DTMT_RESTRICT dxp, T* DTMT_RESTRICT dhp, T* DTMT_RESTRICT dh,
                              T* DTMT_RESTRICT dlnw, T* DTMT_RESTRICT dlnb) {
  A* np = scratch;      // normalised p (or raw p)
  A* nq = scratch + H;  // normalised q (or raw q)
  A* dp = scratch + 2 * H;
  A* dq = scratch + 3 * H;
  for (int j = 0; j < H; ++j) {
    np[j] = A(xp[j]);
    nq[j] = A(hp[j]);
  }
  if (!lnw) {
    atr_backward_elems<false, T, A>(H, np, nq, lnw, lnb, h, dout, dp, dq, dh);
  } else {
    const A rp = layer_norm_row_normalise(H, np, eps);
    const A rq = layer_norm_row_normalise(H, nq, eps);
    atr_backward_elems<true, T, A>(H, np, nq, lnw, lnb, h, dout, dp, dq, dh);
    DTMT_SIMD
    for (int j = 0; j < H; ++j) {
      dlnw[j] += T(dp[j] * np[j]);
      dlnb[j] += T(dp[j]);
      dlnw[H + j] += T(dq[j] * nq[j]);
      dlnb[H + j] += T(dq[j]);
      dp[j] *= A(lnw[j]);
      dq[j] *= A(lnw[H + j]);
    }
    layer_norm_row_backward(H, np, rp, dp);
    layer_norm_row_backward(H, nq, rq, dq);
  }
  for (int j = 0; j < H; ++j) {
    dxp[j] = T(dp[j]);
    dhp[j] = T(dq[j]);
  }
}

}  // namespace DTMT_CELL_MATH_NS
}  // namespace dtmt
