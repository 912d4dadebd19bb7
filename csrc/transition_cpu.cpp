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
// sub-cell; hs_lp, its copy in the input dtype, for 16-bit inputs), hp / hpt (recurrent pre-activations). Gate values, layer-norm statistics and candidates are
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
#include <ATen/ThreadLocalState.h>

#include <functional>
#include <string>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cell_math.h"
#include "op_checks.h"
#include "cpu_dispatch.h"
#include "phase_timers.h"
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
// Each thread's scratch rows (which a pass writes before it reads them) are kept between calls instead of allocated
// and zeroed (9 H values) by each: a decoding step makes four passes, an encoder step two.
template <typename T>
void cell_rows(void (*pass)(const CellRows<T>&, int64_t, int64_t, T*), const CellRows<T>& a, int64_t B) {
  at::parallel_for(0, B, row_grain(a.H), [&](int64_t b0, int64_t b1) {
    thread_local std::vector<T> scratch;
    const size_t n = static_cast<size_t>(kCellScratch * a.H);
    if (scratch.size() < n) scratch.resize(n);
    T* rows = scratch.data();   // (once: a thread_local named again would be looked up again)
    pass(a, b0, b1, rows);
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

// The accumulation type of a storage type: float for float, half and bfloat16, double for double.
template <typename S> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

// `t` in the accumulation dtype: itself where it already is one (float / double), else a converted copy (the small
// per-call tensors of 16-bit inputs: layer-norm parameters, dropout multipliers, the mask).
Tensor in_acc(const Tensor& t, at::ScalarType acc) {
  return !t.defined() || t.numel() == 0 || t.scalar_type() == acc ? t : t.to(acc);
}

// `rows` as A values for a row pass: the tensor's own data when it is in A (float / double inputs), else converted
// into `buf` (16-bit inputs).
template <typename A> const A* acc_rows(Tensor& buf, const Tensor& rows) {
  if (rows.scalar_type() == c10::CppTypeToScalarType<A>::value) return rows.data_ptr<A>();
  buf.copy_(rows);
  return buf.data_ptr<A>();
}

// What every step of one call reads besides its rows, in the accumulation type A (the call's own tensors for
// float / double inputs, converted copies for 16-bit ones): layer-norm parameters, candidate-dropout multipliers
// and the mask; and the row-pass settings they give the base cell and each T-GRU.
template <typename A> struct StepSettings {
  Tensor ln_w, ln_b, t_ln_w, t_ln_b, drop, mask;  // own what the pointers below point into
  CellRows<A> base{};                             // kind, H, eps, layer norm and dropout of the base cell
  int64_t B, H;

  StepSettings(const TransitionWeights& w, const Tensor& drop_in, const Tensor& mask_in, int64_t B_, int64_t H_,
               double eps)
      : B(B_), H(H_) {
    const at::ScalarType acc = c10::CppTypeToScalarType<A>::value;
    ln_w = in_acc(w.ln_w, acc), ln_b = in_acc(w.ln_b, acc);
    t_ln_w = in_acc(w.t_ln_w, acc), t_ln_b = in_acc(w.t_ln_b, acc);
    drop = in_acc(drop_in, acc), mask = in_acc(mask_in, acc);
    base.kind = static_cast<int>(w.kind);
    base.H = static_cast<int>(H);
    base.eps = static_cast<A>(eps);
    base.ln_w = ptr(ln_w);
    base.ln_b = ptr(ln_b);
    base.drop = ptr(drop);
  }

  // T-GRU k (1..depth): its slices of the layer-norm parameters and dropout multipliers.
  CellRows<A> tgru(int64_t k) const {
    CellRows<A> r{};
    r.kind = kTGRU;
    r.H = base.H;
    r.eps = base.eps;
    const A *lw = ptr(t_ln_w), *lb = ptr(t_ln_b);
    r.ln_w = lw ? lw + (k - 1) * 2 * H : nullptr;
    r.ln_b = lb ? lb + (k - 1) * 2 * H : nullptr;
    r.drop = base.drop ? base.drop + k * B * H : nullptr;
    return r;
  }

  // Whether batch row b is a real token at step t (no mask: every row is).
  bool valid(int64_t t, int64_t b) const {
    const A* m = ptr(mask);
    return !m || m[t * B + b] > A(0.5);
  }

  static const A* ptr(const Tensor& t) { return static_cast<const A*>(ptr_or_null(t)); }
};

// 16-bit inputs (bfloat16, half; LP true): the GEMMs run in the input dtype (ATen's, float accumulation) and their
// results (xp, hp, hpt) are stored in it; each step converts the rows it needs into float buffers for the row
// passes, which compute in float as for float inputs. States (hs, h_n, the carried gradients) and layer-norm
// statistics stay float; hs_lp holds the states in the input dtype, the GEMMs' operand. For float / double the
// conversions are skipped and the row passes read and write the tensors themselves.
template <typename S>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                 const TransitionWeights& w, bool reverse, double eps,
                                 const Tensor& xp_given = Tensor()) {
  using A = typename Acc<S>::type;
  constexpr bool LP = !std::is_same<S, A>::value;
  const Dims d = dims_of(x, w);
  const int64_t T_ = d.T, B = d.B, H = d.H, D = d.D, NS = D + 1;
  const auto& kernels = typed_cpu_kernels<A>();
  const auto opts = x.options();
  const at::ScalarType acc = c10::CppTypeToScalarType<A>::value;
  const auto acc_opts = opts.dtype(acc);

  Tensor xp;
  if (xp_given.defined()) {   // the input products given (cell_step_from_products_cpu)
    xp = xp_given.view({T_, B, d.n_in * H});
  } else {
    xp = empty_large({T_ * B, d.n_in * H}, opts);
    linear_into(xp, w.b_ih, x.reshape({T_ * B, d.I}), w.w_ih);
    xp = xp.view({T_, B, d.n_in * H});
  }
  Tensor hs = empty_large({NS, T_, B, H}, acc_opts);
  Tensor hs_lp = LP ? empty_large({NS, T_, B, H}, opts) : at::empty({0}, opts);
  Tensor hp = empty_large({T_, B, d.n_h * H}, opts);
  Tensor hpt = empty_large({D, T_, B, 3 * H}, opts);
  Tensor out = at::empty({T_, B, H}, opts);
  Tensor h_n = h0.to(acc, /*non_blocking=*/false, /*copy=*/true);
  // float rows of the current step (16-bit inputs only)
  Tensor xp_a, hp_a, hpt_a, out_a;
  if (LP) {
    xp_a = at::empty({B, d.n_in * H}, acc_opts);
    hp_a = at::empty({B, d.n_h * H}, acc_opts);
    hpt_a = at::empty({B, 3 * H}, acc_opts);
    out_a = at::empty({B, H}, acc_opts);
  }
  // the GEMM operand of state k at step t (hs_lp's row, filled from hs, for 16-bit inputs)
  auto gemm_state = [&](int64_t k, int64_t t) -> Tensor {
    if (!LP) return hs[k][t];
    Tensor r = hs_lp[k][t];
    r.copy_(hs[k][t]);
    return r;
  };

  const StepSettings<A> set(w, drop, mask, B, H, eps);
  std::vector<Tensor> t_w;
  for (int64_t k = 0; k < D; ++k) t_w.push_back(w.t_w[k]);
  CellRows<A> base = set.base;

  for (int64_t step = 0; step < T_; ++step) {
    const int64_t t = reverse ? T_ - 1 - step : step;
    Tensor h_in = hs[0][t];
    h_in.copy_(h_n);
    Tensor hp_t = hp[t];
    linear_into(hp_t, w.b_hh, gemm_state(0, t), w.w_hh);
    A* out_t = LP ? out_a.data_ptr<A>() : out[t].data_ptr<A>();
    base.xp = acc_rows<A>(xp_a, xp[t]);
    base.hp = acc_rows<A>(hp_a, hp_t);
    base.h = h_in.data_ptr<A>();
    base.out = D > 0 ? hs[1][t].data_ptr<A>() : out_t;
    cell_rows(kernels.cell_forward_rows, base, B);
    for (int64_t k = 1; k <= D; ++k) {
      Tensor hpt_k = hpt[k - 1][t];
      linear_into(hpt_k, w.t_b[k - 1], gemm_state(k, t), t_w[k - 1]);
      CellRows<A> tgru = set.tgru(k);
      tgru.hp = acc_rows<A>(hpt_a, hpt_k);
      tgru.h = hs[k][t].data_ptr<A>();
      tgru.out = k < D ? hs[k + 1][t].data_ptr<A>() : out_t;
      cell_rows(kernels.cell_forward_rows, tgru, B);
    }
    // Masking: a padded step carries the state unchanged and outputs zero.
    A* hn_p = h_n.data_ptr<A>();
    for (int64_t b = 0; b < B; ++b) {
      if (set.valid(t, b)) {
        std::memcpy(hn_p + b * H, out_t + b * H, sizeof(A) * H);
      } else {
        std::memset(out_t + b * H, 0, sizeof(A) * H);
      }
    }
    if (LP) out[t].copy_(out_a);
  }
  return {out, h_n.to(h0.scalar_type()), xp, hs, hs_lp, hp, hpt};
}

// The backward pass of one layer call over reversed time, as an object: its buffers are members, and a time step,
// its two halves (the T-GRUs, then the base cell) and the gradients' assembly are methods. backward_impl runs it.
// 16-bit inputs (LP) as in forward_impl: float rows of the current step, products in the input dtype.
template <typename S>
class TransitionBackward {
  using A = typename Acc<S>::type;
  static constexpr bool LP = !std::is_same<S, A>::value;

 public:
  TransitionBackward(const BackwardInputs& in, const TransitionWeights& w, const SavedForward& saved, double eps)
      : x_(in.x), grad_hn_(in.grad_hn), w_(w), xp_(saved.xp), hs_(saved.hs), hs_lp_(saved.hs_lp), hp_(saved.hp),
        hpt_(saved.hpt), d_(dims_of(in.x, w)), B_(d_.B), H_(d_.H), D_(d_.D), kernels_(typed_cpu_kernels<A>()),
        opts_(in.x.options()), acc_(c10::CppTypeToScalarType<A>::value), set_(w, in.drop, in.mask, B_, H_, eps) {
    const Tensor &xp = saved.xp, &hp = saved.hp, &hpt = saved.hpt;
    TORCH_CHECK(!LP || saved.hs_lp.numel() == saved.hs.numel(),
                "dtmt::transition_backward: 16-bit inputs need the forward's hs_lp");
    const auto acc_opts = opts_.dtype(acc_);
    const int ng = cell_ln_groups(static_cast<int>(w.kind));
    dxp_ = empty_large(xp.sizes(), opts_);
    dhp_ = empty_large(hp.sizes(), opts_);
    dhpt_ = empty_large(hpt.sizes(), opts_);
    ln_ = w.ln_w.defined() && w.ln_w.numel() > 0;
    tln_ = w.t_ln_w.defined() && w.t_ln_w.numel() > 0;
    dln_rows_ = at::zeros({ln_ ? B_ : 0, ng * H_}, acc_opts);
    dlnb_rows_ = at::zeros({ln_ ? B_ : 0, ng * H_}, acc_opts);
    dtln_rows_ = at::zeros({tln_ ? D_ : 0, B_, 2 * H_}, acc_opts);
    dtlnb_rows_ = at::zeros({tln_ ? D_ : 0, B_, 2 * H_}, acc_opts);
    d_cur_ = in.grad_hn.to(acc_, /*non_blocking=*/false, /*copy=*/true);
    dA_ = at::empty({B_, H_}, acc_opts);
    dB_ = at::empty({B_, H_}, acc_opts);
    // (always converted, empty too: in_acc leaves empty tensors, absent arguments, as they are, and a batch of no
    // rows then read a 16-bit grad_out as A)
    go_a_ = in.grad_out.scalar_type() == acc_ ? in.grad_out : in.grad_out.to(acc_);
    if (LP) {   // float rows of the current step and the input-dtype product of the path through U
      xp_a_ = at::empty({B_, d_.n_in * H_}, acc_opts);
      hp_a_ = at::empty({B_, d_.n_h * H_}, acc_opts);
      hpt_a_ = at::empty({B_, 3 * H_}, acc_opts);
      dxp_a_ = at::empty({B_, d_.n_in * H_}, acc_opts);
      dhp_a_ = at::empty({B_, d_.n_h * H_}, acc_opts);
      dhpt_a_ = at::empty({B_, 3 * H_}, acc_opts);
      through_u_ = at::empty({B_, H_}, opts_);
    }
    base_ = set_.base;
    base_.dln_w = ln_ ? dln_rows_.data_ptr<A>() : nullptr;
    base_.dln_b = ln_ ? dlnb_rows_.data_ptr<A>() : nullptr;
  }

  // Time step t: the gradient into the last sub-cell's output, back through the T-GRUs and the base cell; the
  // carried gradient of the valid rows becomes the cell's input-state gradient (padded rows pass it untouched).
  void step(int64_t t) {
    const A* go = go_a_[t].data_ptr<A>();
    const A* dc = d_cur_.data_ptr<A>();
    A* da = dA_.data_ptr<A>();
    for (int64_t b = 0; b < B_; ++b) {
      const bool valid = set_.valid(t, b);
      for (int64_t j = 0; j < H_; ++j) da[b * H_ + j] = valid ? dc[b * H_ + j] + go[b * H_ + j] : A(0);
    }
    for (int64_t k = D_; k >= 1; --k) tgru_step(t, k);
    base_step(t);
    const A* db = dB_.data_ptr<A>();
    A* dcur = d_cur_.data_ptr<A>();
    for (int64_t b = 0; b < B_; ++b)
      if (set_.valid(t, b)) std::memcpy(dcur + b * H_, db + b * H_, sizeof(A) * H_);
  }

  // dx, dh0, the weight and bias gradients (or, without weight_grads, the pre-activation gradients in their
  // places, for a caller that forms them over many calls at once), the layer norms' gradients: the op's 12 outputs.
  std::vector<Tensor> result(bool weight_grads) const {
    const int64_t N = d_.T * B_;
    const auto st = x_.scalar_type();
    Tensor dxp2 = dxp_.view({N, d_.n_in * H_});
    Tensor dx = dxp2.mm(w_.w_ih).view({d_.T, B_, d_.I});
    Tensor dh0 = d_cur_.to(grad_hn_.scalar_type());
    Tensor dln_w = ln_ ? dln_rows_.sum(0).to(st) : Tensor();
    Tensor dln_b = ln_ ? dlnb_rows_.sum(0).to(st) : Tensor();
    Tensor dt_ln_w = tln_ ? dtln_rows_.sum(1).to(st) : Tensor();
    Tensor dt_ln_b = tln_ ? dtlnb_rows_.sum(1).to(st) : Tensor();
    Tensor dhp2 = dhp_.view({N, d_.n_h * H_}), dhpt2 = dhpt_.view({D_, N, 3 * H_});
    if (!weight_grads)
      return {dx, dh0, dxp2, Tensor(), dhp2, Tensor(), dln_w, dln_b, dhpt2, Tensor(), dt_ln_w, dt_ln_b};
    const Tensor& hs_g = LP ? hs_lp_ : hs_;   // the states as the GEMMs read them
    const auto g = transition_weight_grads(x_.reshape({N, d_.I}), hs_g.view({D_ + 1, N, H_}), dxp2, dhp2, dhpt2,
                                           acc_);
    return {dx, dh0, g[0], g[1], g[2], g[3], dln_w, dln_b, g[4], g[5], dt_ln_w, dt_ln_b};
  }

 private:
  // T-GRU k at step t: dA (its output's gradient) -> dB (its input state's), its pre-activation gradients stored
  void tgru_step(int64_t t, int64_t k) {
    Tensor dhpt_k = dhpt_[k - 1][t];
    CellRows<A> tgru = set_.tgru(k);
    tgru.hp = acc_rows<A>(hpt_a_, hpt_[k - 1][t]);
    tgru.h = hs_[k][t].data_ptr<A>();
    tgru.dout = dA_.data_ptr<A>();
    tgru.dhp = grad_rows(dhpt_a_, dhpt_k);
    tgru.dh = dB_.data_ptr<A>();
    tgru.dln_w = tln_ ? dtln_rows_[k - 1].data_ptr<A>() : nullptr;
    tgru.dln_b = tln_ ? dtlnb_rows_[k - 1].data_ptr<A>() : nullptr;
    cell_rows(kernels_.cell_backward_rows, tgru, B_);
    add_through_u(dhpt_a_, dhpt_k, w_.t_w[k - 1]);
    std::swap(dA_, dB_);
  }

  // the base cell at step t: dA -> dB, its input and recurrent pre-activation gradients stored
  void base_step(int64_t t) {
    Tensor dxp_t = dxp_[t];
    Tensor dhp_t = dhp_[t];
    base_.xp = acc_rows<A>(xp_a_, xp_[t]);
    base_.hp = acc_rows<A>(hp_a_, hp_[t]);
    base_.h = hs_[0][t].data_ptr<A>();
    base_.dout = dA_.data_ptr<A>();
    base_.dxp = grad_rows(dxp_a_, dxp_t);
    base_.dhp = grad_rows(dhp_a_, dhp_t);
    base_.dh = dB_.data_ptr<A>();
    cell_rows(kernels_.cell_backward_rows, base_, B_);
    if (LP) dxp_t.copy_(dxp_a_);
    add_through_u(dhp_a_, dhp_t, w_.w_hh);
  }

  A* grad_rows(Tensor& buf, Tensor& rows) { return LP ? buf.data_ptr<A>() : rows.data_ptr<A>(); }

  // dB += d(pre-activations) U, the pre-activation gradients first stored in their tensor's rows
  void add_through_u(const Tensor& buf, Tensor& rows, const Tensor& u) {
    if (!LP) {
      dB_.addmm_(rows, u);
      return;
    }
    rows.copy_(buf);
    at::mm_out(through_u_, rows, u);
    dB_.add_(through_u_);
  }

  const Tensor& x_;
  const Tensor& grad_hn_;
  const TransitionWeights& w_;
  const Tensor &xp_, &hs_, &hs_lp_, &hp_, &hpt_;
  const Dims d_;
  const int64_t B_, H_, D_;
  const TypedCpuKernels<A>& kernels_;
  const at::TensorOptions opts_;
  const at::ScalarType acc_;
  const StepSettings<A> set_;
  bool ln_ = false, tln_ = false;
  Tensor dxp_, dhp_, dhpt_, dln_rows_, dlnb_rows_, dtln_rows_, dtlnb_rows_, d_cur_, dA_, dB_, go_a_;
  Tensor xp_a_, hp_a_, hpt_a_, dxp_a_, dhp_a_, dhpt_a_, through_u_;
  CellRows<A> base_;
};

template <typename S>
std::vector<Tensor> backward_impl(const BackwardInputs& in, const TransitionWeights& w, const SavedForward& saved,
                                  bool reverse, double eps, bool weight_grads) {
  TransitionBackward<S> pass(in, w, saved, eps);
  const int64_t T_ = in.x.size(0);
  for (int64_t step = T_ - 1; step >= 0; --step) pass.step(reverse ? T_ - 1 - step : step);
  return pass.result(weight_grads);
}

// One unmasked step without dropout and without what training keeps (decoding): forward_impl's arithmetic over a
// single step (the same GEMMs on the same operands, the same row passes), none of its saved tensors. xp_given: the
// input products (x is then not read).
template <typename T>
Tensor step_impl(const Tensor& x, const Tensor& xp_given, const Tensor& h_in, const TransitionWeights& w, double eps,
                 StepScratch* scratch) {
  const Tensor h = h_in.contiguous();
  const int64_t B = h.size(0), H = h.size(1);
  const int64_t n_in = cell_input_rows(static_cast<int>(w.kind)), n_h = cell_hidden_rows(static_cast<int>(w.kind));
  const int64_t D = w.t_w.defined() && w.t_w.numel() > 0 ? w.t_w.size(0) : 0;
  // the state and input against the weights, before any product sizes a buffer from them (the weights themselves
  // were checked at the op's boundary: op_checks.h's check_cell)
  TORCH_CHECK(w.w_hh.dim() == 2 && w.w_hh.size(0) == n_h * H && weight_in_features(w.w_hh) == H &&
                  (!x.defined() || (w.w_ih.dim() == 2 && w.w_ih.size(0) == n_in * H &&
                                    weight_in_features(w.w_ih) == x.size(1))),
              "dtmt::cell_step: the state [B, ", H, "]", x.defined() ? " and input [B, " : "",
              x.defined() ? std::to_string(x.size(1)) + "]" : std::string(), " do not fit the cell's weights (w_hh ",
              matrix_text(w.w_hh), ", w_ih ", matrix_text(w.w_ih), ")");
  const auto& kernels = typed_cpu_kernels<T>();
  const auto opts = h.options();
  Tensor xp = xp_given;
  if (!xp.defined()) {
    xp = step_tensor(scratch, {B, n_in * H}, opts);
    linear_into(xp, w.b_ih, x.contiguous(), w.w_ih);
  }
  Tensor hp = step_tensor(scratch, {B, n_h * H}, opts);
  DTMT_PHASE_START(product_phase, recurrent_product);
  linear_into(hp, w.b_hh, h, w.w_hh);
  DTMT_PHASE_END(product_phase);
  DTMT_PHASE_START(rows_phase, cell_rows);
  const StepSettings<T> set(w, Tensor(), Tensor(), B, H, eps);
  Tensor cur = step_tensor(scratch, {B, H}, opts);
  CellRows<T> base = set.base;
  base.xp = xp.data_ptr<T>();
  base.hp = hp.data_ptr<T>();
  base.h = h.data_ptr<T>();
  base.out = cur.data_ptr<T>();
  cell_rows(kernels.cell_forward_rows, base, B);
  DTMT_PHASE_END(rows_phase);
  if (D > 0) {
    TORCH_CHECK(static_cast<int64_t>(w.t_w_k.size()) == D && static_cast<int64_t>(w.t_b_k.size()) == D,
                "dtmt::cell_step: the T-GRUs' weight slices are missing (weights from cell_weights / with_tgru_slices)");
    Tensor hpt = step_tensor(scratch, {B, 3 * H}, opts);
    for (int64_t k = 1; k <= D; ++k) {
      DTMT_PHASE_START(tgru_product_phase, tgru_product);
      linear_into(hpt, w.t_b_k[k - 1], cur, w.t_w_k[k - 1]);
      DTMT_PHASE_END(tgru_product_phase);
      DTMT_PHASE_START(tgru_rows_phase, tgru_rows);
      Tensor next = step_tensor(scratch, {B, H}, opts);
      CellRows<T> tgru = set.tgru(k);
      tgru.hp = hpt.data_ptr<T>();
      tgru.h = cur.data_ptr<T>();
      tgru.out = next.data_ptr<T>();
      cell_rows(kernels.cell_forward_rows, tgru, B);
      DTMT_PHASE_END(tgru_rows_phase);
      cur = next;
    }
  }
  return cur;
}

// Inference over a sequence (transition_encode_cpu, float / double): forward_impl's arithmetic, the same GEMMs on the
// same operand values and the same row passes, without the sequence tensors it keeps for backward (hs, hp, hpt):
// one step's rows, reused from step to step. Returns {out [T, B, H], h_n [B, H]}. Why: at batch 1 a step streams a
// direction's recurrent matrices (1.75 MB for the small dtmt), about what the core's L2 holds; the saved sequences
// written alongside pushed them out, so every step read them from L3 (docs/design/cpu_kernels.md, "The encoder
// at batch 1").
// xp: the input products of every position [T * B, n_in * H] (input_products or table_products), B = h0's rows.
template <typename T>
std::vector<Tensor> encode_impl(const Tensor& xp, int64_t T_, const Tensor& h0, const Tensor& mask,
                                const TransitionWeights& w, bool reverse, double eps) {
  const int64_t n_in = cell_input_rows(static_cast<int>(w.kind)), n_h = cell_hidden_rows(static_cast<int>(w.kind));
  const int64_t B = h0.size(0), H = w.w_hh.size(0) / n_h;
  const int64_t D = w.t_w.defined() && w.t_w.numel() > 0 ? w.t_w.size(0) : 0;
  const auto& kernels = typed_cpu_kernels<T>();
  const auto opts = xp.options();
  Tensor out = at::empty({T_, B, H}, opts);
  // states[0]: the carried state (h_n), states[k]: the state entering T-GRU k
  Tensor states = at::empty({D + 1, B, H}, opts);
  states[0].copy_(h0);
  std::vector<Tensor> state(static_cast<size_t>(D + 1)), t_w, t_b;
  for (int64_t k = 0; k <= D; ++k) state[k] = states[k];
  for (int64_t k = 0; k < D; ++k) {
    t_w.push_back(w.t_w[k]);
    t_b.push_back(w.t_b[k]);
  }
  Tensor hp = at::empty({B, n_h * H}, opts);
  Tensor hpt = at::empty({B, 3 * H}, opts);
  const StepSettings<T> set(w, Tensor(), mask, B, H, eps);
  CellRows<T> base = set.base;
  base.hp = hp.data_ptr<T>();
  base.h = state[0].data_ptr<T>();
  std::vector<CellRows<T>> tgru;
  for (int64_t k = 1; k <= D; ++k) {
    tgru.push_back(set.tgru(k));
    tgru.back().hp = hpt.data_ptr<T>();
    tgru.back().h = state[k].data_ptr<T>();
  }
  // batch 1, float32: the recurrent products from the row panels where the weights carry them (transition.h)
  const bool panels = std::is_same<T, float>::value && B == 1 && w.w_hh_panels.defined() && w.w_hh_panels.numel() > 0;
  if (panels) {
    TORCH_CHECK(w.w_hh.scalar_type() == at::kFloat && is_row_panels(w.w_hh_panels, w.w_hh.size(0), H),
                "dtmt::transition_encode: row panels of float32 weights expected (w_hh ", w.w_hh.sizes(), " ",
                w.w_hh.scalar_type(), ", its panels ", w.w_hh_panels.sizes(), ")");
    TORCH_CHECK(D == 0 || (w.t_w_panels.dim() == 4 && w.t_w_panels.size(0) == D),
                "dtmt::transition_encode: the T-GRUs' row panels must be [", D, ", P, H, ", kPanelWidth, "], got ",
                w.t_w_panels.sizes());
  }
  std::vector<Tensor> t_panels;
  for (int64_t k = 0; panels && k < D; ++k) t_panels.push_back(w.t_w_panels[k]);
  const T* xp_p = xp.data_ptr<T>();
  T* out_p = out.data_ptr<T>();
  T* hn_p = state[0].data_ptr<T>();
  for (int64_t step = 0; step < T_; ++step) {
    const int64_t t = reverse ? T_ - 1 - step : step;
    T* out_t = out_p + t * B * H;
    if (panels) {
      row_panels_into(hp, w.b_hh, state[0], w.w_hh_panels);
    } else {
      linear_into(hp, w.b_hh, state[0], w.w_hh);
    }
    base.xp = xp_p + t * B * n_in * H;
    base.out = D > 0 ? state[1].data_ptr<T>() : out_t;
    cell_rows(kernels.cell_forward_rows, base, B);
    for (int64_t k = 1; k <= D; ++k) {
      if (panels) {
        row_panels_into(hpt, t_b[k - 1], state[k], t_panels[k - 1]);
      } else {
        linear_into(hpt, t_b[k - 1], state[k], t_w[k - 1]);
      }
      CellRows<T>& a = tgru[k - 1];
      a.out = k < D ? state[k + 1].data_ptr<T>() : out_t;
      cell_rows(kernels.cell_forward_rows, a, B);
    }
    // Masking: a padded step carries the state unchanged and outputs zero.
    for (int64_t b = 0; b < B; ++b) {
      if (set.valid(t, b)) {
        std::memcpy(hn_p + b * H, out_t + b * H, sizeof(T) * H);
      } else {
        std::memset(out_t + b * H, 0, sizeof(T) * H);
      }
    }
  }
  return {out, state[0].clone()};
}

}  // namespace

TransitionWeights with_tgru_slices(TransitionWeights w) {
  const int64_t D = w.t_w.defined() && w.t_w.numel() > 0 ? w.t_w.size(0) : 0;
  w.t_w_k.clear();
  w.t_b_k.clear();
  for (int64_t k = 0; k < D; ++k) {
    w.t_w_k.push_back(w.t_w[k]);
    w.t_b_k.push_back(w.t_b.defined() && w.t_b.numel() > 0 ? w.t_b[k] : at::Tensor());
  }
  return w;
}

namespace {

void check_kind(int64_t kind) {
  TORCH_CHECK(base_cell(kind), "dtmt: unknown cell kind ", kind, " (", kBaseCellNames, ")");
}

}  // namespace

std::vector<Tensor> transition_forward_cpu(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                           const TransitionWeights& w, bool reverse, double eps) {
  check_kind(w.kind);
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dtmt_transition", [&] {
    result = forward_impl<scalar_t>(x, h0, mask, drop, w, reverse, eps);
  });
  return result;
}

Tensor cell_step_from_products_cpu(const Tensor& xp, const Tensor& h, const TransitionWeights& w, double eps,
                                  StepScratch* scratch) {
  check_kind(w.kind);
  const int64_t B = h.size(0), n_in = cell_input_rows(static_cast<int>(w.kind)), H = h.size(1);
  TORCH_CHECK(xp.dim() == 2 && xp.size(0) == B && xp.size(1) == n_in * H && xp.is_contiguous() &&
                  xp.scalar_type() == h.scalar_type() && (xp.scalar_type() == at::kFloat ||
                                                          xp.scalar_type() == at::kDouble),
              "dtmt::cell_step_from_products: xp [B, ", n_in * H, "] contiguous, of h's dtype (float or double), got ",
              xp.sizes());
  Tensor result;
  AT_DISPATCH_FLOATING_TYPES(xp.scalar_type(), "dtmt_cell_step_from_products", [&] {
    result = step_impl<scalar_t>(Tensor(), xp, h, w, eps, scratch);
  });
  return result;
}

Tensor cell_step_cpu(const Tensor& x, const Tensor& h, const TransitionWeights& w, double eps, StepScratch* scratch) {
  check_kind(w.kind);
  TORCH_CHECK(x.dim() == 2 && h.dim() == 2 && x.size(0) == h.size(0) && x.scalar_type() == h.scalar_type(),
              "dtmt::cell_step: x [B, I] and h [B, H] of one dtype expected, got ", x.sizes(), " ", x.scalar_type(),
              " and ", h.sizes(), " ", h.scalar_type());
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble)   // 16-bit: the sequence kernel's conversions
    return transition_forward_cpu(x.contiguous().unsqueeze(0), h.contiguous(), Tensor(), Tensor(), w, false, eps)[1];
  Tensor result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtmt_cell_step", [&] {
    result = step_impl<scalar_t>(x, Tensor(), h, w, eps, scratch);
  });
  return result;
}

namespace {

// The input products x W_ih^T + b_ih of every position [T * B, n_in * H] (one GEMM; x [T, B, I]).
Tensor input_products(const Tensor& x, const TransitionWeights& w) {
  const int64_t T_ = x.size(0), B = x.size(1);
  Tensor xp = empty_large({T_ * B, w.w_ih.size(0)}, x.options());
  linear_into(xp, w.b_ih, x.reshape({T_ * B, x.size(2)}), w.w_ih);
  return xp;
}

// Direction d's input products [T * B, N] read from tables (transition_encode_tokens_cpu): row t * B + b is
// table[tokens[t, b]] + position_table[t] (where given) + b_ih, over the table's columns d * N .. (d + 1) * N.
template <typename T>
Tensor table_products(const Tensor& tokens, const Tensor& table, const Tensor& position_table, const Tensor& b_ih,
                      int64_t d, int64_t N) {
  const int64_t T_ = tokens.size(0), B = tokens.size(1), width = table.size(1);
  Tensor xp = empty_large({T_ * B, N}, table.options());
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const T* rows = table.data_ptr<T>() + d * N;
  const T* pos = position_table.defined() ? position_table.data_ptr<T>() + d * N : nullptr;
  const T* bias = b_ih.defined() && b_ih.numel() > 0 ? b_ih.data_ptr<T>() : nullptr;
  T* out = xp.data_ptr<T>();
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const T* row = rows + tok[t * B + b] * width;
      T* o = out + (t * B + b) * N;
      if (pos != nullptr) {
        const T* p = pos + t * width;
        for (int64_t n = 0; n < N; ++n) o[n] = row[n] + p[n];
      } else {
        std::memcpy(o, row, sizeof(T) * N);
      }
      if (bias != nullptr)
        for (int64_t n = 0; n < N; ++n) o[n] += bias[n];
    }
  }
  return xp;
}

// Each direction of a layer through `run(d)` (which fills r[d] = {out, h_n}), on two threads where the layer has two
// directions and there are two (transition_encode_cpu), then the directions' outputs joined.
std::vector<Tensor> each_direction(int64_t D, const std::function<std::vector<Tensor>(int64_t)>& run) {
  DTMT_PHASE_START(encode_phase, encode);
  std::vector<std::vector<Tensor>> r(static_cast<size_t>(D));
  if (D == 2 && at::get_num_threads() == 2 && !at::in_parallel_region()) {
    // the caller's thread-local state (grad mode above all) on the worker too: parallel_for does not carry it
    const at::ThreadLocalState caller;
    at::parallel_for(0, 2, 1, [&](int64_t d0, int64_t d1) {
      const at::ThreadLocalStateGuard same(caller);
      for (int64_t d = d0; d < d1; ++d) r[d] = run(d);
    });
  } else {
    for (int64_t d = 0; d < D; ++d) r[d] = run(d);
  }
  std::vector<Tensor> joined = D == 1 ? std::vector<Tensor>{r[0][0], r[0][1].unsqueeze(0)}
                                      : std::vector<Tensor>{at::cat({r[0][0], r[1][0]}, -1),
                                                            at::stack({r[0][1], r[1][1]})};
  DTMT_PHASE_END(encode_phase);
  return joined;
}

// What both encode ops read besides their inputs, checked against the weights: D = 1 or 2 directions of one kind
// and hidden size H, each w_ih of n_in*H rows, h0 [D, B, H] and a mask [T, B] or empty.
void check_encode(const std::vector<TransitionWeights>& dirs, const Tensor& h0, const Tensor& mask, int64_t T_,
                  int64_t B, const char* op) {
  const int64_t D = static_cast<int64_t>(dirs.size());
  TORCH_CHECK(D == 1 || D == 2, "dtmt::", op, ": one or two directions, got ", D);
  for (const auto& w : dirs) check_kind(w.kind);
  const int64_t H = dirs[0].w_hh.size(0) / cell_hidden_rows(static_cast<int>(dirs[0].kind));
  for (const auto& w : dirs)
    TORCH_CHECK(w.w_hh.size(0) == cell_hidden_rows(static_cast<int>(w.kind)) * H &&
                    w.w_ih.size(0) == cell_input_rows(static_cast<int>(w.kind)) * H,
                "dtmt::", op, ": every direction's w_ih and w_hh must have n_in * H and n_h * H rows (H = ", H, ")");
  TORCH_CHECK(h0.dim() == 3 && h0.size(0) == D && h0.size(1) == B && h0.size(2) == H, "dtmt::", op, ": h0 [", D,
              ", ", B, ", ", H, "] expected, got ", h0.sizes());
  TORCH_CHECK(!mask.defined() || mask.numel() == 0 || (mask.dim() == 2 && mask.size(0) == T_ && mask.size(1) == B),
              "dtmt::", op, ": mask [", T_, ", ", B, "] expected, got ", mask.sizes());
  check_mask(mask, op);
}

}  // namespace

std::vector<Tensor> transition_encode_cpu(const Tensor& x, const Tensor& h0, const Tensor& mask,
                                          const std::vector<TransitionWeights>& dirs, bool reverse, double eps) {
  const int64_t D = static_cast<int64_t>(dirs.size());
  TORCH_CHECK(x.dim() == 3, "dtmt::transition_encode: x [T, B, I] expected, got ", x.sizes());
  check_encode(dirs, h0, mask, x.size(0), x.size(1), "transition_encode");
  return each_direction(D, [&](int64_t d) {
    const bool rev = d == 1 || reverse;
    if (x.scalar_type() == at::kFloat) return encode_impl<float>(input_products(x, dirs[d]), x.size(0), h0[d], mask,
                                                                 dirs[d], rev, eps);
    if (x.scalar_type() == at::kDouble) return encode_impl<double>(input_products(x, dirs[d]), x.size(0), h0[d], mask,
                                                                   dirs[d], rev, eps);
    // 16-bit inputs: the sequence kernel's conversions
    std::vector<Tensor> r = transition_forward_cpu(x, h0[d], mask, Tensor(), dirs[d], rev, eps);
    return std::vector<Tensor>{r[0], r[1]};
  });
}

std::vector<Tensor> transition_encode_tokens_cpu(const Tensor& tokens, const Tensor& table,
                                                 const Tensor& position_table, const Tensor& h0, const Tensor& mask,
                                                 const std::vector<TransitionWeights>& dirs, bool reverse,
                                                 double eps) {
  const int64_t D = static_cast<int64_t>(dirs.size());
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
              "dtmt::transition_encode_tokens: int64 tokens [T, B] expected, got ", tokens.sizes(), " ",
              tokens.scalar_type());
  check_encode(dirs, h0, mask, tokens.size(0), tokens.size(1), "transition_encode_tokens");
  const auto st = table.scalar_type();
  const int64_t N = dirs[0].w_ih.size(0);
  // (the mask, bool or floating point as transition_encode's, is converted by the step's settings)
  TORCH_CHECK(h0.scalar_type() == st, "dtmt::transition_encode_tokens: h0 of the table's dtype (", st,
              ") expected, got ", h0.scalar_type());
  TORCH_CHECK((st == at::kFloat || st == at::kDouble) && table.dim() == 2 && table.size(1) == D * N,
              "dtmt::transition_encode_tokens: a float or double table [V, ", D * N, "] (each direction's ", N,
              " input products) expected, got ", table.sizes(), " ", st);
  const bool positional = position_table.defined() && position_table.numel() > 0;
  TORCH_CHECK(!positional || (position_table.dim() == 2 && position_table.size(0) >= tokens.size(0) &&
                              position_table.size(1) == D * N && position_table.scalar_type() == st),
              "dtmt::transition_encode_tokens: position_table must be [>= T = ", tokens.size(0), ", ", D * N,
              "] of the table's dtype, got ", position_table.sizes(), " ", position_table.scalar_type());
  const int64_t V = table.size(0);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens.numel(); ++i)
    TORCH_CHECK_INDEX(tok[i] >= 0 && tok[i] < V, "dtmt::transition_encode_tokens: token ", tok[i],
                      " is not in the table (", V, " rows)");   // IndexError, as F.embedding gives
  for (const auto& w : dirs)
    TORCH_CHECK(w.w_ih.size(0) == N && w.w_ih.scalar_type() == st &&
                    (!w.b_ih.defined() || w.b_ih.numel() == 0 || (w.b_ih.numel() == N && w.b_ih.scalar_type() == st)),
                "dtmt::transition_encode_tokens: the directions' input matrices must be of the table's dtype (", st,
                ") and ", N, " rows");
  const Tensor pos = positional ? position_table : Tensor();
  return each_direction(D, [&](int64_t d) {
    const bool rev = d == 1 || reverse;
    if (st == at::kFloat)
      return encode_impl<float>(table_products<float>(tokens, table, pos, dirs[d].b_ih, d, N), tokens.size(0), h0[d],
                                mask, dirs[d], rev, eps);
    return encode_impl<double>(table_products<double>(tokens, table, pos, dirs[d].b_ih, d, N), tokens.size(0), h0[d],
                               mask, dirs[d], rev, eps);
  });
}

std::vector<Tensor> transition_backward_cpu(const BackwardInputs& in, const TransitionWeights& w,
                                            const SavedForward& saved, bool reverse, double eps, bool weight_grads) {
  check_kind(w.kind);
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "dtmt_transition", [&] {
    result = backward_impl<scalar_t>(in, w, saved, reverse, eps, weight_grads);
  });
  return result;
}

}  // namespace dtmt
