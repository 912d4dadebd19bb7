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
// The row passes are the loops of csrc/isa/transition_rows.cpp (the copy for this CPU's instruction set,
// cpu_dispatch.h); this file allocates, runs the GEMMs and splits the rows among threads.
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
#include "cpu_dispatch.h"
#include "small_gemm.h"

namespace dtmt {
namespace {

using at::Tensor;

// The saved and gradient buffers are tens of MB, allocated fresh on every call and first touched inside the
// time loop; with 4 KiB pages that costs a page fault per 4 KiB. Asking for transparent huge pages on the
// 2 MiB-aligned interior (a hint: ignored where THP is off) makes it one fault per 2 MiB.
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

// One sub-cell over all B rows of a step: the row pass of the chosen instruction set, rows split among threads.
template <typename T>
void cell_rows(void (*pass)(const CellRows<T>&, int64_t, int64_t, T*), const CellRows<T>& a, int64_t B) {
  at::parallel_for(0, B, row_grain(a.H), [&](int64_t b0, int64_t b1) {
    std::vector<T> scratch(static_cast<size_t>(kCellScratch * a.H));
    pass(a, b0, b1, scratch.data());
  });
}

const void* ptr_or_null(const Tensor& t) { return t.defined() && t.numel() > 0 ? t.data_ptr() : nullptr; }

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

template <typename T>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                 const TransitionWeights& w, bool reverse, double eps) {
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, S = D + 1;
  const auto& kernels = typed_cpu_kernels<T>();
  auto opts = x.options();

  Tensor xp = empty_large({T_ * B, d.n_in * H}, opts);
  linear_into(xp, w.b_ih, x.reshape({T_ * B, d.I}), w.w_ih);
  xp = xp.view({T_, B, d.n_in * H});
  Tensor hs = empty_large({S, T_, B, H}, opts);
  Tensor hp = empty_large({T_, B, d.n_h * H}, opts);
  Tensor hpt = empty_large({D, T_, B, 3 * H}, opts);
  Tensor out = at::empty({T_, B, H}, opts);
  Tensor h_n = h0.clone();

  const T* tlnw = static_cast<const T*>(ptr_or_null(w.t_ln_w));
  const T* tlnb = static_cast<const T*>(ptr_or_null(w.t_ln_b));
  const T* dropp = static_cast<const T*>(ptr_or_null(drop));
  const T* maskp = static_cast<const T*>(ptr_or_null(mask));
  std::vector<Tensor> t_w;
  for (int64_t k = 0; k < D; ++k) t_w.push_back(w.t_w[k]);
  CellRows<T> base{};
  base.kind = static_cast<int>(w.kind);
  base.H = static_cast<int>(H);
  base.eps = static_cast<T>(eps);
  base.ln_w = static_cast<const T*>(ptr_or_null(w.ln_w));
  base.ln_b = static_cast<const T*>(ptr_or_null(w.ln_b));
  base.drop = dropp;

  for (int64_t step = 0; step < T_; ++step) {
    const int64_t t = reverse ? T_ - 1 - step : step;
    Tensor h_in = hs[0][t];
    h_in.copy_(h_n);
    Tensor hp_t = hp[t];
    linear_into(hp_t, w.b_hh, h_in, w.w_hh);
    base.xp = xp[t].data_ptr<T>();
    base.hp = hp_t.data_ptr<T>();
    base.h = h_in.data_ptr<T>();
    base.out = D > 0 ? hs[1][t].data_ptr<T>() : out[t].data_ptr<T>();
    cell_rows(kernels.cell_forward_rows, base, B);
    for (int64_t k = 1; k <= D; ++k) {
      Tensor in_k = hs[k][t];
      Tensor hpt_k = hpt[k - 1][t];
      linear_into(hpt_k, w.t_b[k - 1], in_k, t_w[k - 1]);
      CellRows<T> tgru{};
      tgru.kind = kTGRU;
      tgru.H = base.H;
      tgru.eps = base.eps;
      tgru.hp = hpt_k.data_ptr<T>();
      tgru.h = in_k.data_ptr<T>();
      tgru.ln_w = tlnw ? tlnw + (k - 1) * 2 * H : nullptr;
      tgru.ln_b = tlnb ? tlnb + (k - 1) * 2 * H : nullptr;
      tgru.drop = dropp ? dropp + k * B * H : nullptr;
      tgru.out = k < D ? hs[k + 1][t].data_ptr<T>() : out[t].data_ptr<T>();
      cell_rows(kernels.cell_forward_rows, tgru, B);
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

template <typename T>
std::vector<Tensor> backward_impl(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                  const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                  const Tensor& xp, const Tensor& hs, const Tensor& hp, const Tensor& hpt,
                                  bool reverse, double eps, bool weight_grads) {
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D;
  const auto& kernels = typed_cpu_kernels<T>();
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

  const T* tlnw = static_cast<const T*>(ptr_or_null(w.t_ln_w));
  const T* tlnb = static_cast<const T*>(ptr_or_null(w.t_ln_b));
  const T* dropp = static_cast<const T*>(ptr_or_null(drop));
  const T* maskp = static_cast<const T*>(ptr_or_null(mask));
  CellRows<T> base{};
  base.kind = static_cast<int>(w.kind);
  base.H = static_cast<int>(H);
  base.eps = static_cast<T>(eps);
  base.ln_w = static_cast<const T*>(ptr_or_null(w.ln_w));
  base.ln_b = static_cast<const T*>(ptr_or_null(w.ln_b));
  base.drop = dropp;
  base.dln_w = ln ? dln_rows.data_ptr<T>() : nullptr;
  base.dln_b = ln ? dlnb_rows.data_ptr<T>() : nullptr;

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
      CellRows<T> tgru{};
      tgru.kind = kTGRU;
      tgru.H = base.H;
      tgru.eps = base.eps;
      tgru.hp = hpt[k - 1][t].data_ptr<T>();
      tgru.h = hs[k][t].data_ptr<T>();
      tgru.ln_w = tlnw ? tlnw + (k - 1) * 2 * H : nullptr;
      tgru.ln_b = tlnb ? tlnb + (k - 1) * 2 * H : nullptr;
      tgru.drop = dropp ? dropp + k * B * H : nullptr;
      tgru.dout = dA.data_ptr<T>();
      tgru.dhp = dhpt_k.data_ptr<T>();
      tgru.dh = dB.data_ptr<T>();
      tgru.dln_w = tln ? dtln_rows[k - 1].data_ptr<T>() : nullptr;
      tgru.dln_b = tln ? dtlnb_rows[k - 1].data_ptr<T>() : nullptr;
      cell_rows(kernels.cell_backward_rows, tgru, B);
      dB.addmm_(dhpt_k, w.t_w[k - 1]);
      std::swap(dA, dB);
    }
    {
      Tensor dhp_t = dhp[t];
      base.xp = xp[t].data_ptr<T>();
      base.hp = hp[t].data_ptr<T>();
      base.h = hs[0][t].data_ptr<T>();
      base.dout = dA.data_ptr<T>();
      base.dxp = dxp[t].data_ptr<T>();
      base.dhp = dhp_t.data_ptr<T>();
      base.dh = dB.data_ptr<T>();
      cell_rows(kernels.cell_backward_rows, base, B);
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

void check_kind(int64_t kind) {
  TORCH_CHECK(kind == kGRU || kind == kLGRU || kind == kLAU || kind == kATR, "dtmt: unknown cell kind ", kind);
}

}  // namespace

std::vector<Tensor> transition_forward_cpu(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                           const TransitionWeights& w, bool reverse, double eps) {
  check_kind(w.kind);
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtmt_transition", [&] {
    result = forward_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps);
  });
  return result;
}

std::vector<Tensor> transition_backward_cpu(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                            const Tensor& mask, const Tensor& drop, const TransitionWeights& w,
                                            const Tensor& xp, const Tensor& hs, const Tensor& hp, const Tensor& hpt,
                                            bool reverse, double eps, bool weight_grads) {
  check_kind(w.kind);
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtmt_transition", [&] {
    result = backward_impl<scalar_t>(grad_out, grad_hn, x, mask, drop, w, xp, hs, hp, hpt, reverse, eps,
                                     weight_grads);
  });
  return result;
}

}  // namespace dtmt
