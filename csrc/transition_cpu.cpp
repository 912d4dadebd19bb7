// C++ CPU kernels of the deep transition block (GRU / L-GRU / LAU base cell + T-GRUs) and of ATR.
//
// Forward, for a sequence of T steps (walked backwards when `reverse`):
//   xp = x W_ih^T + b_ih                           one GEMM over T*B rows, before the loop
//   per step t:  hp  = h U^T + b_hh                 GEMM [B,H] x [H, n_h*H]
//                h1  = base_row(xp[t], hp, h)      one fused pass per batch row (parallel over rows)
//                for each T-GRU k: GEMM, then one fused pass
//                mask: padded rows keep h and output 0
// (GEMMs of at most kSmallRowsMax rows, i.e. decoding at batch 1, run the weight-streaming kernel of
// small_gemm_cpu.cpp; larger ones ATen's GEMM.)
// Saved for backward (per step and sequence): xp (input pre-activations), hs (the state entering every
// sub-cell), hp / hpt (recurrent pre-activations). Gate values, layer-norm statistics and candidates are
// recomputed in the backward pass from these, which keeps the saved bytes well below autograd's.
//
// Backward walks the steps in the opposite order. Per step and sub-cell: one fused pass per row recomputes
// the forward and produces d(pre-activations) and the direct gradient to the sub-cell's input state, then
// one GEMM adds the path through U. Weight and bias gradients are GEMMs / column sums over all T*B rows
// after the loop; layer-norm gain/offset gradients are accumulated per batch row (each row owned by one
// thread) and summed at the end, so results are deterministic.
#include "transition.h"

#include <ATen/Parallel.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cell_math.h"
#include "small_gemm.h"

namespace dtmt {
namespace {

using at::Tensor;

template <typename scalar_t> struct AccType { using type = scalar_t; };

// The saved and gradient buffers are tens of MB, allocated fresh on every call and first touched inside the
// time loop; with 4 KiB pages that costs a page fault per 4 KiB. Asking for transparent huge pages on the
// 2 MiB-aligned interior (a hint: ignored where THP is off) cuts the faults ~500x.
Tensor empty_large(at::IntArrayRef shape, const at::TensorOptions& opts) {
  Tensor t = at::empty(shape, opts);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = 2u << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + t.nbytes();
  const uintptr_t a = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t b = end & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#endif
  return t;
}

int64_t row_grain(int64_t H) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(H, 1)); }

template <typename F> void for_rows(int64_t B, int64_t H, int64_t scratch_per_row, const F& f) {
  at::parallel_for(0, B, row_grain(H), [&](int64_t b0, int64_t b1) {
    std::vector<double> storage;  // double-sized slots suffice for float or double accumulators
    storage.resize(static_cast<size_t>(scratch_per_row));
    for (int64_t b = b0; b < b1; ++b) f(b, storage.data());
  });
}

const void* ptr_or_null(const Tensor& t) { return t.defined() && t.numel() > 0 ? t.data_ptr() : nullptr; }

// Base-cell row functions for one KIND.
template <int KIND, typename T, typename A> struct BaseRow {
  static void forward(int H, const T* xp, const T* hp, const T* h, const T* lnw, const T* lnb, const T* drop,
                      A eps, A* scratch, T* out) {
    if constexpr (KIND == kATR) {
      atr_forward_row<T, A>(H, xp, hp, h, lnw, lnb, eps, scratch, out);
    } else {
      gated_forward_row<KIND, T, A>(H, xp, hp, h, lnw, lnb, drop, eps, scratch, out);
    }
  }
  static void backward(int H, const T* xp, const T* hp, const T* h, const T* lnw, const T* lnb, const T* drop,
                       A eps, const T* dout, A* scratch, T* dxp, T* dhp, T* dh, T* dlnw, T* dlnb) {
    if constexpr (KIND == kATR) {
      atr_backward_row<T, A>(H, xp, hp, h, lnw, lnb, eps, dout, scratch, dxp, dhp, dh, dlnw, dlnb);
    } else {
      gated_backward_row<KIND, T, A>(H, xp, hp, h, lnw, lnb, drop, eps, dout, scratch, dxp, dhp, dh, dlnw,
                                     dlnb);
    }
  }
};

struct Dims {
  int64_t T, B, I, H, D, n_in, n_h;
};

Dims dims_of(const Tensor& x, const TransitionWeights& w) {
  Dims d;
  d.T = x.size(0);
  d.B = x.size(1);
  d.I = x.size(2);
  d.n_h = cell_hidden_rows(static_cast<int>(w.kind));
  d.n_in = cell_input_rows(static_cast<int>(w.kind));
  d.H = w.w_hh.size(0) / d.n_h;
  d.D = w.t_w.defined() && w.t_w.numel() > 0 ? w.t_w.size(0) : 0;
  return d;
}

template <int KIND, typename T>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                 const TransitionWeights& w, bool reverse, double eps_d) {
  using A = typename AccType<T>::type;
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, S = D + 1;
  const A eps = static_cast<A>(eps_d);
  auto opts = x.options();

  Tensor xp = empty_large({T_ * B, d.n_in * H}, opts);
  linear_into(xp, w.b_ih, x.reshape({T_ * B, d.I}), w.w_ih);
  xp = xp.view({T_, B, d.n_in * H});
  Tensor hs = empty_large({S, T_, B, H}, opts);
  Tensor hp = empty_large({T_, B, d.n_h * H}, opts);
  Tensor hpt = empty_large({D, T_, B, 3 * H}, opts);
  Tensor out = at::empty({T_, B, H}, opts);
  Tensor h_n = h0.clone();

  const T* lnw = static_cast<const T*>(ptr_or_null(w.ln_w));
  const T* lnb = static_cast<const T*>(ptr_or_null(w.ln_b));
  const T* tlnw = static_cast<const T*>(ptr_or_null(w.t_ln_w));
  const T* tlnb = static_cast<const T*>(ptr_or_null(w.t_ln_b));
  const T* dropp = static_cast<const T*>(ptr_or_null(drop));
  const T* maskp = static_cast<const T*>(ptr_or_null(mask));
  std::vector<Tensor> t_w;
  for (int64_t k = 0; k < D; ++k) t_w.push_back(w.t_w[k]);
  const int64_t scratch = 9 * H;

  for (int64_t step = 0; step < T_; ++step) {
    const int64_t t = reverse ? T_ - 1 - step : step;
    Tensor h_in = hs[0][t];
    h_in.copy_(h_n);
    Tensor hp_t = hp[t];
    linear_into(hp_t, w.b_hh, h_in, w.w_hh);
    T* base_out = D > 0 ? hs[1][t].data_ptr<T>() : out[t].data_ptr<T>();
    const T* xp_t = xp[t].data_ptr<T>();
    const T* hp_p = hp_t.data_ptr<T>();
    const T* h_p = h_in.data_ptr<T>();
    for_rows(B, H, scratch, [&](int64_t b, double* s) {
      BaseRow<KIND, T, A>::forward(static_cast<int>(H), xp_t + b * d.n_in * H, hp_p + b * d.n_h * H, h_p + b * H,
                                   lnw, lnb, dropp ? dropp + b * H : nullptr, eps, reinterpret_cast<A*>(s),
                                   base_out + b * H);
    });
    for (int64_t k = 1; k <= D; ++k) {
      Tensor in_k = hs[k][t];
      Tensor hpt_k = hpt[k - 1][t];
      linear_into(hpt_k, w.t_b[k - 1], in_k, t_w[k - 1]);
      T* out_k = k < D ? hs[k + 1][t].data_ptr<T>() : out[t].data_ptr<T>();
      const T* hp_k = hpt_k.data_ptr<T>();
      const T* in_p = in_k.data_ptr<T>();
      const T* lw = tlnw ? tlnw + (k - 1) * 2 * H : nullptr;
      const T* lb = tlnb ? tlnb + (k - 1) * 2 * H : nullptr;
      const T* dk = dropp ? dropp + k * B * H : nullptr;
      for_rows(B, H, scratch, [&](int64_t b, double* s) {
        gated_forward_row<kTGRU, T, A>(static_cast<int>(H), nullptr, hp_k + b * 3 * H, in_p + b * H, lw, lb,
                                       dk ? dk + b * H : nullptr, eps, reinterpret_cast<A*>(s), out_k + b * H);
      });
    }
    // Masking: a padded step carries the state unchanged and outputs zero.
    T* out_t = out[t].data_ptr<T>();
    T* hn_p = h_n.data_ptr<T>();
    for (int64_t b = 0; b < B; ++b) {
      const bool valid = !maskp || maskp[t * B + b] > T(0.5);
      if (valid) {
        std::memcpy(hn_p + b * H, out_t + b * H, sizeof(T) * H);
      } else {
        std::memset(out_t + b * H, 0, sizeof(T) * H);
      }
    }
  }
  return {out, h_n, xp, hs, hp, hpt};
}

template <int KIND, typename T>
std::vector<Tensor> backward_impl(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                  const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                  const Tensor& xp, const Tensor& hs, const Tensor& hp, const Tensor& hpt,
                                  bool reverse, double eps_d, bool weight_grads) {
  using A = typename AccType<T>::type;
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D;
  const A eps = static_cast<A>(eps_d);
  auto opts = x.options();
  const int ng = cell_ln_groups(static_cast<int>(w.kind));

  Tensor dxp = empty_large(xp.sizes(), opts);
  Tensor dhp = empty_large(hp.sizes(), opts);
  Tensor dhpt = empty_large(hpt.sizes(), opts);
  const bool ln = w.ln_w.defined() && w.ln_w.numel() > 0;
  const bool tln = w.t_ln_w.defined() && w.t_ln_w.numel() > 0;
  Tensor dln_rows = at::zeros({ln ? B : 0, ng * H}, opts);
  Tensor dlnb_rows = at::zeros({ln ? B : 0, ng * H}, opts);
  Tensor dtln_rows = at::zeros({tln ? D : 0, B, 2 * H}, opts);
  Tensor dtlnb_rows = at::zeros({tln ? D : 0, B, 2 * H}, opts);
  Tensor d_cur = grad_hn.clone();
  Tensor dA = at::empty({B, H}, opts);
  Tensor dB = at::empty({B, H}, opts);

  const T* lnw = static_cast<const T*>(ptr_or_null(w.ln_w));
  const T* lnb = static_cast<const T*>(ptr_or_null(w.ln_b));
  const T* tlnw = static_cast<const T*>(ptr_or_null(w.t_ln_w));
  const T* tlnb = static_cast<const T*>(ptr_or_null(w.t_ln_b));
  const T* dropp = static_cast<const T*>(ptr_or_null(drop));
  const T* maskp = static_cast<const T*>(ptr_or_null(mask));
  const int64_t scratch = 9 * H;

  for (int64_t step = T_ - 1; step >= 0; --step) {
    const int64_t t = reverse ? T_ - 1 - step : step;
    // Gradient w.r.t. the last sub-cell's output: carried gradient plus this step's output gradient.
    {
      const T* go = grad_out[t].data_ptr<T>();
      const T* dc = d_cur.data_ptr<T>();
      T* da = dA.data_ptr<T>();
      for (int64_t b = 0; b < B; ++b) {
        const bool valid = !maskp || maskp[t * B + b] > T(0.5);
        for (int64_t j = 0; j < H; ++j) da[b * H + j] = valid ? dc[b * H + j] + go[b * H + j] : T(0);
      }
    }
    for (int64_t k = D; k >= 1; --k) {
      Tensor dhpt_k = dhpt[k - 1][t];
      const T* hp_k = hpt[k - 1][t].data_ptr<T>();
      const T* in_p = hs[k][t].data_ptr<T>();
      const T* lw = tlnw ? tlnw + (k - 1) * 2 * H : nullptr;
      const T* lb = tlnb ? tlnb + (k - 1) * 2 * H : nullptr;
      const T* dk = dropp ? dropp + k * B * H : nullptr;
      T* dlw = tln ? dtln_rows[k - 1].data_ptr<T>() : nullptr;
      T* dlb = tln ? dtlnb_rows[k - 1].data_ptr<T>() : nullptr;
      T* dhpt_p = dhpt_k.data_ptr<T>();
      const T* da = dA.data_ptr<T>();
      T* db = dB.data_ptr<T>();
      for_rows(B, H, scratch, [&](int64_t b, double* s) {
        gated_backward_row<kTGRU, T, A>(static_cast<int>(H), nullptr, hp_k + b * 3 * H, in_p + b * H, lw, lb,
                                        dk ? dk + b * H : nullptr, eps, da + b * H, reinterpret_cast<A*>(s),
                                        nullptr, dhpt_p + b * 3 * H, db + b * H,
                                        dlw ? dlw + b * 2 * H : nullptr, dlb ? dlb + b * 2 * H : nullptr);
      });
      dB.addmm_(dhpt_k, w.t_w[k - 1]);
      std::swap(dA, dB);
    }
    {
      Tensor dhp_t = dhp[t];
      const T* xp_t = xp[t].data_ptr<T>();
      const T* hp_t = hp[t].data_ptr<T>();
      const T* h_p = hs[0][t].data_ptr<T>();
      T* dxp_t = dxp[t].data_ptr<T>();
      T* dhp_p = dhp_t.data_ptr<T>();
      T* dlw = ln ? dln_rows.data_ptr<T>() : nullptr;
      T* dlb = ln ? dlnb_rows.data_ptr<T>() : nullptr;
      const T* da = dA.data_ptr<T>();
      T* db = dB.data_ptr<T>();
      for_rows(B, H, scratch, [&](int64_t b, double* s) {
        BaseRow<KIND, T, A>::backward(static_cast<int>(H), xp_t + b * d.n_in * H, hp_t + b * d.n_h * H,
                                      h_p + b * H, lnw, lnb, dropp ? dropp + b * H : nullptr, eps, da + b * H,
                                      reinterpret_cast<A*>(s), dxp_t + b * d.n_in * H, dhp_p + b * d.n_h * H,
                                      db + b * H, dlw ? dlw + b * ng * H : nullptr,
                                      dlb ? dlb + b * ng * H : nullptr);
      });
      dB.addmm_(dhp_t, w.w_hh);
    }
    // Padded rows pass the carried gradient through untouched; valid rows take the cell's input gradient.
    {
      const T* db = dB.data_ptr<T>();
      T* dc = d_cur.data_ptr<T>();
      for (int64_t b = 0; b < B; ++b) {
        const bool valid = !maskp || maskp[t * B + b] > T(0.5);
        if (valid) std::memcpy(dc + b * H, db + b * H, sizeof(T) * H);
      }
    }
  }

  const int64_t N = T_ * B;
  Tensor dxp2 = dxp.view({N, d.n_in * H});
  Tensor dx = dxp2.mm(w.w_ih).view({T_, B, d.I});
  Tensor dln_w = ln ? dln_rows.sum(0) : Tensor();
  Tensor dln_b = ln ? dlnb_rows.sum(0) : Tensor();
  Tensor dt_ln_w = tln ? dtln_rows.sum(1) : Tensor();
  Tensor dt_ln_b = tln ? dtlnb_rows.sum(1) : Tensor();
  if (!weight_grads)  // the caller forms the weight and bias gradients itself, over many calls at once
    return {dx, d_cur, dxp2, Tensor(), dhp.view({N, d.n_h * H}), Tensor(), dln_w, dln_b, dhpt.view({D, N, 3 * H}),
            Tensor(), dt_ln_w, dt_ln_b};
  Tensor dw_ih = dxp2.t().mm(x.reshape({N, d.I}));
  Tensor db_ih = dxp2.sum(0);
  Tensor dhp2 = dhp.view({N, d.n_h * H});
  Tensor dw_hh = dhp2.t().mm(hs[0].view({N, H}));
  Tensor db_hh = dhp2.sum(0);
  Tensor dt_w = at::empty({D, 3 * H, H}, opts);
  Tensor dt_b = at::empty({D, 3 * H}, opts);
  for (int64_t k = 0; k < D; ++k) {
    Tensor g = dhpt[k].view({N, 3 * H});
    Tensor dtw_k = dt_w[k];
    at::mm_out(dtw_k, g.t(), hs[k + 1].view({N, H}));
    dt_b[k].copy_(g.sum(0));
  }
  return {dx, d_cur, dw_ih, db_ih, dw_hh, db_hh, dln_w, dln_b, dt_w, dt_b, dt_ln_w, dt_ln_b};
}

template <template <int, typename> class Impl, typename... Args>
std::vector<Tensor> dispatch_kind(int64_t kind, at::ScalarType dtype, Args&&... args) {
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(dtype, "dtmt_transition", [&] {
    switch (kind) {
      case kGRU: result = Impl<kGRU, scalar_t>::run(std::forward<Args>(args)...); break;
      case kLGRU: result = Impl<kLGRU, scalar_t>::run(std::forward<Args>(args)...); break;
      case kLAU: result = Impl<kLAU, scalar_t>::run(std::forward<Args>(args)...); break;
      case kATR: result = Impl<kATR, scalar_t>::run(std::forward<Args>(args)...); break;
      default: TORCH_CHECK(false, "dtmt: unknown cell kind ", kind);
    }
  });
  return result;
}

template <int KIND, typename T> struct ForwardImpl {
  template <typename... Args> static std::vector<Tensor> run(Args&&... args) {
    return forward_impl<KIND, T>(std::forward<Args>(args)...);
  }
};
template <int KIND, typename T> struct BackwardImpl {
  template <typename... Args> static std::vector<Tensor> run(Args&&... args) {
    return backward_impl<KIND, T>(std::forward<Args>(args)...);
  }
};

}  // namespace

std::vector<Tensor> transition_forward_cpu(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                           const TransitionWeights& w, bool reverse, double eps) {
  return dispatch_kind<ForwardImpl>(w.kind, x.scalar_type(), x, h0, mask, drop, w, reverse, eps);
}

std::vector<Tensor> transition_backward_cpu(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                            const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                            const Tensor& xp, const Tensor& hs, const Tensor& hp, const Tensor& hpt,
                                            bool reverse, double eps, bool weight_grads) {
  return dispatch_kind<BackwardImpl>(w.kind, x.scalar_type(), grad_out, grad_hn, x, mask, drop, w, xp, hs, hp, hpt,
                                     reverse, eps, weight_grads);
}

}  // namespace dtmt
