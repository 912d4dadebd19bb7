// The kernels' ops as PyTorch custom ops, namespace `dtmt` (torch.ops.dtmt.*): one schema each (TORCH_LIBRARY),
// the CPU kernels under the CPU dispatch key and, in a CUDA build, the CUDA kernels under the CUDA key. The
// inference engine's ops (a decoder step, beam search) are registered in the same namespace by
// csrc/engine/registration.cpp, with the same conventions.
// Their fake (meta) implementations and autograd are registered in Python, next to each op's reference
// (dtmt_kernels/ops/<op>/). The layers check their inputs in Python before they call an op, with messages in
// their own terms; the ops are public too (torch.ops.dtmt.*), so each checks here, before any kernel indexes into
// a tensor, every weight slot against its cell, every activation, gradient and saved tensor against the sizes the
// weights give, and ids against the vocabulary (op_checks.h): a wrong argument is a one-line error naming the op
// and the argument, never a crash (tests/op_fuzz.py calls every op with perturbed arguments).
//
// Conventions of every op here:
//   - an optional input is `Tensor?` (None: absent); the kernels see an absent tensor as an empty one;
//   - an op returns fresh tensors only (never an input or a view of one), and an absent result as an empty
//     tensor [0] (e.g. the gradient of an absent layer-norm gain);
//   - inputs need not be contiguous (the wrappers make them so; a no-op when they are);
//   - an op without a backward (inference: small_rows_linear, the encode ops) has torch's not-implemented autograd
//     kernel: a gradient through it is an error naming it (torch's fallback ran the backward with only a warning,
//     and the inputs' gradients were None).
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <array>

#include "attention.h"
#include "cell_math.h"
#include "loss.h"
#include "op_args.h"
#include "op_checks.h"
#include "small_gemm.h"
#include "transition.h"

namespace {

using at::Tensor;
using dtmt::args::dense;
using dtmt::args::given;
using dtmt::args::last_dim_dense;
using OptTensor = std::optional<Tensor>;

// The schemas' shared parts: the ten flat parameters of one direction (dtmt_kernels/ops/transition/layout.py).
#define DTMT_PARAMS_SCHEMA                                                                                         \
  "Tensor w_ih, Tensor b_ih, Tensor w_hh, Tensor b_hh, Tensor? ln_w, Tensor? ln_b, Tensor? t_w, Tensor? t_b, " \
  "Tensor? t_ln_w, Tensor? t_ln_b"

// x [T, B, I] and what the weights w give: H, the T-GRUs' D; h0 [B, H], mask [T, B] and drop [D + 1, B, H] (both
// optional) checked against them. Returns {T, B, I, H, D}.
std::array<int64_t, 5> check_sequence(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                      const dtmt::TransitionWeights& w, const char* op, const char* h_name = "h0") {
  dtmt::check_sizes(x, {-1, -1, -1}, op, "x ([T, B, I])");
  const int64_t T = x.size(0), B = x.size(1), I = x.size(2);
  const int64_t H = dtmt::check_cell(w, I, op, "the weights");
  const int64_t D = dtmt::given(w.t_w) ? w.t_w.size(0) : 0;
  dtmt::check_sizes(h0, {B, H}, op, h_name);
  dtmt::check_optional_sizes(mask, {T, B}, op, "mask");
  dtmt::check_mask(mask, op);
  dtmt::check_optional_sizes(drop, {D + 1, B, H}, op, "drop");
  // (an ATR step has no candidate: a dropout mask was taken and did nothing, where the layers refuse it)
  TORCH_CHECK(!dtmt::given(drop) || w.kind != dtmt::kATR, "dtmt::", op,
              ": drop must be None for ATR, which has no candidate to drop (contract §2)");
  dtmt::check_floating(h0, op, h_name);
  dtmt::check_floating(drop, op, "drop");
  dtmt::check_floating(x, op, "x");
  // every floating operand in x's dtype (the matrices may be int8 rows; the state float32 under autocast): ATen's
  // "self and mat2 must have the same dtype" had named no argument, and a float16 layer-norm gain or a float64 h0
  // beside a float32 x was converted here where the reference backend refuses it
  const at::ScalarType xt = x.scalar_type();
  for (const auto& [t, name, rows] : {std::tuple<const Tensor&, const char*, bool>{w.w_ih, "w_ih", true},
                                      {w.b_ih, "b_ih", false}, {w.w_hh, "w_hh", true}, {w.b_hh, "b_hh", false},
                                      {w.t_w, "t_w", true}, {w.t_b, "t_b", false}, {w.ln_w, "ln_w", false},
                                      {w.ln_b, "ln_b", false}, {w.t_ln_w, "t_ln_w", false},
                                      {w.t_ln_b, "t_ln_b", false}, {drop, "drop", false}})
    dtmt::check_dtype(t, xt, op, name, "x", rows);
  dtmt::check_state_dtype(h0, xt, op, h_name, "x");
  return {T, B, I, H, D};
}

// A result slot: the tensor, or an empty one where the kernel left it undefined.
Tensor or_empty(const Tensor& t, const Tensor& like) { return t.defined() ? t : at::empty({0}, like.options()); }

dtmt::TransitionWeights weights(int64_t kind, const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh,
                                const Tensor& b_hh, const OptTensor& ln_w, const OptTensor& ln_b,
                                const OptTensor& t_w, const OptTensor& t_b, const OptTensor& t_ln_w,
                                const OptTensor& t_ln_b) {
  return dtmt::TransitionWeights{kind,           dense(w_ih),      dense(b_ih),      dense(w_hh),
                                 dense(b_hh),    dense(ln_w, w_hh), dense(ln_b, w_hh), dense(t_w, w_hh),
                                 dense(t_b, w_hh), dense(t_ln_w, w_hh), dense(t_ln_b, w_hh)};
}

using Forward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Forward forward_tuple(const std::vector<Tensor>& r) { return {r[0], r[1], r[2], r[3], r[4], r[5], r[6]}; }

// The gradients in the inputs' order; those of absent inputs (and the bias slots that weight_grads=false leaves
// empty) as empty tensors. The four base-cell tensors are always present.
std::vector<Tensor> grads_list(std::vector<Tensor> g, const Tensor& x, const OptTensor& ln_w, const OptTensor& ln_b,
                               const OptTensor& t_w, const OptTensor& t_b, const OptTensor& t_ln_w,
                               const OptTensor& t_ln_b) {
  const bool present[10] = {true, true, true, true, given(ln_w), given(ln_b), given(t_w), given(t_b), given(t_ln_w),
                            given(t_ln_b)};
  for (size_t i = 0; i < g.size(); ++i) {
    const bool absent = i >= 2 && !present[i - 2];
    g[i] = absent ? at::empty({0}, x.options()) : or_empty(g[i], x);
  }
  return g;
}

// The forward op for the kernel `Kernel` of one device (transition_forward_cpu / _cuda): the same wrapper for both.
using ForwardKernel = std::vector<Tensor> (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                              const dtmt::TransitionWeights&, bool, double);

template <ForwardKernel Kernel>
Forward transition_forward(const Tensor& x, const Tensor& h0, const OptTensor& mask, const OptTensor& drop,
                           int64_t kind, const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh, const Tensor& b_hh,
                           const OptTensor& ln_w, const OptTensor& ln_b, const OptTensor& t_w, const OptTensor& t_b,
                           const OptTensor& t_ln_w, const OptTensor& t_ln_b, bool reverse, double eps) {
  const auto w = weights(kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
  const Tensor m = dense(mask, x), dr = dense(drop, x);
  check_sequence(x, h0, m, dr, w, "transition_forward");
  dtmt::check_eps(eps, "transition_forward", "eps");
  return forward_tuple(Kernel(dense(x), dense(h0), m, dr, w, reverse, eps));
}

// The backward op for the kernel `Kernel` of one device (transition_backward_cpu / _cuda): the same wrapper for both.
using BackwardKernel = std::vector<Tensor> (*)(const dtmt::BackwardInputs&, const dtmt::TransitionWeights&,
                                               const dtmt::SavedForward&, bool, double, bool);

template <BackwardKernel Kernel>
std::vector<Tensor> transition_backward(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                        const OptTensor& mask, const OptTensor& drop, int64_t kind,
                                        const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh, const Tensor& b_hh,
                                        const OptTensor& ln_w, const OptTensor& ln_b, const OptTensor& t_w,
                                        const OptTensor& t_b, const OptTensor& t_ln_w, const OptTensor& t_ln_b,
                                        const Tensor& xp, const Tensor& hs, const Tensor& hs_lp, const Tensor& hp,
                                        const Tensor& hpt, bool reverse, double eps, bool weight_grads) {
  const auto w = weights(kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
  const Tensor m = dense(mask, x), dr = dense(drop, x);
  constexpr const char* op = "transition_backward";
  const Tensor tw = t_w.value_or(Tensor());
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{w_ih, "w_ih"}, {w_hh, "w_hh"}, {tw, "t_w"}})
    TORCH_CHECK(!dtmt::given(t) || t.scalar_type() != at::kChar, "dtmt::", op, ": ", name,
                " is int8 rows, which are for inference: no gradient flows through them (train the float weights)");
  const auto [T, B, I, H, D] = check_sequence(x, grad_hn, m, dr, w, op, "grad_hn");   // (h0's shape)
  dtmt::check_eps(eps, op, "eps");
  (void)I;
  const int k = static_cast<int>(kind);
  dtmt::check_sizes(grad_out, {T, B, H}, op, "grad_out");
  // the forward's saved tensors (transition_forward's xp, hs, hs_lp, hp, hpt)
  dtmt::check_sizes(xp, {T, B, dtmt::cell_input_rows(k) * H}, op, "xp");
  dtmt::check_sizes(hs, {D + 1, T, B, H}, op, "hs");
  dtmt::check_optional_sizes(hs_lp, {D + 1, T, B, H}, op, "hs_lp");
  dtmt::check_sizes(hp, {T, B, dtmt::cell_hidden_rows(k) * H}, op, "hp");
  dtmt::check_sizes(hpt, {D, T, B, 3 * H}, op, "hpt");
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{grad_out, "grad_out"}, {xp, "xp"}, {hs, "hs"},
                                {hs_lp, "hs_lp"}, {hp, "hp"}, {hpt, "hpt"}})
    dtmt::check_floating(t, op, name);
  // ... and in the dtypes the forward gives them: the kernels read them as such (a float64 xp beside a float32 x
  // failed inside a kernel, naming nothing)
  const at::ScalarType xt = x.scalar_type(), acc = xt == at::kDouble ? at::kDouble : at::kFloat;
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{xp, "xp"}, {hp, "hp"}, {hpt, "hpt"},
                                {hs_lp, "hs_lp"}})
    TORCH_CHECK(!dtmt::given(t) || t.scalar_type() == xt, "dtmt::", op, ": ", name, " must have x's dtype ", xt,
                " (the forward's), got ", t.scalar_type());
  dtmt::check_dtype(grad_out, xt, op, "grad_out", "x");   // (autograd gives it in out's dtype, x's)
  TORCH_CHECK(!dtmt::given(hs) || hs.scalar_type() == acc, "dtmt::", op, ": hs must be ", acc,
              " (the forward's states for x of ", xt, "), got ", hs.scalar_type());
  auto g = Kernel(dtmt::BackwardInputs{dense(grad_out), dense(grad_hn), dense(x), m, dr}, w,
                  dtmt::SavedForward{dense(xp), dense(hs), dense(hs_lp), dense(hp), dense(hpt)}, reverse, eps,
                  weight_grads);
  // with weight_grads=false the slots of dw_ih, dw_hh and dt_w hold pre-activation gradients (transition.h)
  return grads_list(std::move(g), x, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
}

// ten parameters a direction, or twelve: the ten, then w_hh and t_w in the row-panel layout (small_gemm.h)
// (input_size: x's I, or -1 where the input products come from a table)
// (type: the dtype of the argument `of`, which every floating parameter has)
std::vector<dtmt::TransitionWeights> encode_directions(int64_t kind, at::TensorList params, int64_t input_size,
                                                       at::ScalarType type, const char* of, const char* op) {
  const size_t n = params.size(), per = n == 12 || n == 24 ? 12 : 10;
  TORCH_CHECK(n == 10 || n == 20 || n == 12 || n == 24,
              "dtmt::", op, ": ten parameter tensors a direction (twelve with row panels), got ", n);
  dtmt::check_list_dtype(params, type, op, "params", of);
  std::vector<dtmt::TransitionWeights> dirs;
  for (size_t d = 0; d < n; d += per) {
    const at::TensorList p = params.slice(d, per);
    dirs.push_back(weights(kind, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9]));
    // (each direction against its cell; one hidden size for both: the kernels' check_encode)
    dtmt::check_cell(dirs.back(), input_size, op, ("direction " + std::to_string(d / per)).c_str());
    if (per == 12) {
      dirs.back().w_hh_panels = p[10].contiguous();
      dirs.back().t_w_panels = p[11].contiguous();
    }
  }
  return dirs;
}

std::tuple<Tensor, Tensor> transition_encode(const Tensor& x, const Tensor& h0, const OptTensor& mask, int64_t kind,
                                             at::TensorList params, bool reverse, double eps) {
  dtmt::check_sizes(x, {-1, -1, -1}, "transition_encode", "x ([T, B, I])");
  dtmt::check_floating(h0, "transition_encode", "h0");
  dtmt::check_floating(x, "transition_encode", "x");
  dtmt::check_state_dtype(h0, x.scalar_type(), "transition_encode", "h0", "x");
  dtmt::check_eps(eps, "transition_encode", "eps");
  auto r = dtmt::transition_encode_cpu(
      dense(x), dense(h0), dense(mask, x),
      encode_directions(kind, params, x.size(2), x.scalar_type(), "x", "transition_encode"), reverse, eps);
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor> transition_encode_tokens(const Tensor& tokens, const Tensor& table,
                                                    const OptTensor& position_table, const Tensor& h0,
                                                    const OptTensor& mask, int64_t kind, at::TensorList params,
                                                    bool reverse, double eps) {
  dtmt::check_floating(h0, "transition_encode_tokens", "h0");
  dtmt::check_floating(table, "transition_encode_tokens", "table");
  const at::ScalarType type = table.scalar_type();
  dtmt::check_state_dtype(h0, type, "transition_encode_tokens", "h0", "table");
  dtmt::check_dtype(position_table.value_or(Tensor()), type, "transition_encode_tokens", "position_table", "table");
  dtmt::check_eps(eps, "transition_encode_tokens", "eps");
  auto r = dtmt::transition_encode_tokens_cpu(
      dense(tokens), dense(table), dense(position_table, table), dense(h0), dense(mask, table),
      encode_directions(kind, params, -1, type, "table", "transition_encode_tokens"), reverse, eps);
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor, Tensor> additive_scores_backward(const Tensor& grad, const Tensor& keys, const Tensor& query,
                                                           const Tensor& v) {
  auto g = dtmt::additive_scores_backward_cpu(dense(grad), dense(keys), dense(query), dense(v));
  return {g[0], g[1], g[2]};
}

Tensor additive_scores(const Tensor& keys, const Tensor& query, const Tensor& v) {
  return dtmt::additive_scores_forward_cpu(dense(keys), dense(query), dense(v));
}

// values: a view whose last dimension is contiguous is read in place (e.g. a transposed encoder output;
// last_dim_dense, op_args.h)
Tensor attention_context(const Tensor& alpha, const Tensor& values) {
  return dtmt::attention_context_forward_cpu(dense(alpha), last_dim_dense(values));
}

std::tuple<Tensor, Tensor> attention_context_backward(const Tensor& grad, const Tensor& alpha, const Tensor& values,
                                                      bool values_grad) {
  auto g = dtmt::attention_context_backward_cpu(dense(grad), dense(alpha), last_dim_dense(values), values_grad);
  return {g[0], g[1]};
}

Tensor small_rows_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias) {
  return dtmt::small_rows_linear(x, weight, bias.has_value() ? dense(*bias) : Tensor());
}

std::tuple<Tensor, Tensor, Tensor> smoothed_cross_entropy(const Tensor& logits, const Tensor& target, double smoothing,
                                                          int64_t ignore_index) {
  auto r = dtmt::smoothed_cross_entropy_cpu(dense(logits), dense(target), smoothing, ignore_index);
  return {r[0], r[1], r[2]};
}

#ifdef DTMT_WITH_CUDA
// The attention ops' CUDA kernels (attention_cuda.cu): the same layouts as the CPU wrappers above
Tensor additive_scores_cuda(const Tensor& keys, const Tensor& query, const Tensor& v) {
  return dtmt::additive_scores_forward_cuda(dense(keys), dense(query), dense(v));
}

std::tuple<Tensor, Tensor, Tensor> additive_scores_backward_cuda(const Tensor& grad, const Tensor& keys,
                                                                const Tensor& query, const Tensor& v) {
  auto g = dtmt::additive_scores_backward_cuda(dense(grad), dense(keys), dense(query), dense(v));
  return {g[0], g[1], g[2]};
}

Tensor attention_context_cuda(const Tensor& alpha, const Tensor& values) {
  return dtmt::attention_context_forward_cuda(dense(alpha), last_dim_dense(values));
}

std::tuple<Tensor, Tensor> attention_context_backward_cuda(const Tensor& grad, const Tensor& alpha,
                                                           const Tensor& values, bool values_grad) {
  auto g = dtmt::attention_context_backward_cuda(dense(grad), dense(alpha), last_dim_dense(values), values_grad);
  return {g[0], g[1]};
}
#endif

}  // namespace

TORCH_LIBRARY(dtmt, m) {
  m.def("transition_forward(Tensor x, Tensor h0, Tensor? mask, Tensor? drop, int kind, " DTMT_PARAMS_SCHEMA
        ", bool reverse, float eps) -> (Tensor out, Tensor h_n, Tensor xp, Tensor hs, Tensor hs_lp, Tensor hp, "
        "Tensor hpt)");
  m.def("transition_backward(Tensor grad_out, Tensor grad_hn, Tensor x, Tensor? mask, Tensor? drop, int kind, "
        DTMT_PARAMS_SCHEMA ", Tensor xp, Tensor hs, Tensor hs_lp, Tensor hp, Tensor hpt, bool reverse, float eps, "
        "bool weight_grads=True) -> Tensor[]");
  m.def("transition_encode(Tensor x, Tensor h0, Tensor? mask, int kind, Tensor[] params, bool reverse, float eps) "
        "-> (Tensor out, Tensor h_n)");
  m.def("transition_encode_tokens(Tensor tokens, Tensor table, Tensor? position_table, Tensor h0, Tensor? mask, "
        "int kind, Tensor[] params, bool reverse, float eps) -> (Tensor out, Tensor h_n)");
  m.def("additive_scores(Tensor keys, Tensor query, Tensor v) -> Tensor");
  m.def("additive_scores_backward(Tensor grad, Tensor keys, Tensor query, Tensor v) -> (Tensor, Tensor, Tensor)");
  m.def("attention_context(Tensor alpha, Tensor values) -> Tensor");
  m.def("attention_context_backward(Tensor grad, Tensor alpha, Tensor values, bool values_grad=True) -> "
        "(Tensor, Tensor)");
  m.def("small_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("smoothed_cross_entropy(Tensor logits, Tensor target, float smoothing, int ignore_index) -> "
        "(Tensor loss, Tensor nll, Tensor grad)");
}

TORCH_LIBRARY_IMPL(dtmt, CPU, m) {
  m.impl("transition_forward", &transition_forward<dtmt::transition_forward_cpu>);
  m.impl("transition_backward", &transition_backward<dtmt::transition_backward_cpu>);
  m.impl("transition_encode", &transition_encode);
  m.impl("transition_encode_tokens", &transition_encode_tokens);
  m.impl("additive_scores", &additive_scores);
  m.impl("additive_scores_backward", &additive_scores_backward);
  m.impl("attention_context", &attention_context);
  m.impl("attention_context_backward", &attention_context_backward);
  m.impl("small_rows_linear", &small_rows_linear);
  m.impl("smoothed_cross_entropy", &smoothed_cross_entropy);
}

TORCH_LIBRARY_IMPL(dtmt, Autograd, m) {
  for (const char* op : {"transition_encode", "transition_encode_tokens", "small_rows_linear"})
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
}

#ifdef DTMT_WITH_CUDA
TORCH_LIBRARY_IMPL(dtmt, CUDA, m) {
  m.impl("transition_forward", &transition_forward<dtmt::transition_forward_cuda>);
  m.impl("transition_backward", &transition_backward<dtmt::transition_backward_cuda>);
  m.impl("additive_scores", &additive_scores_cuda);
  m.impl("additive_scores_backward", &additive_scores_backward_cuda);
  m.impl("attention_context", &attention_context_cuda);
  m.impl("attention_context_backward", &attention_context_backward_cuda);
}
#endif
