// Inference-only fused pieces of a decoder step (declared and specified in decode_step.h).
//
// Each op runs the arithmetic of several modules in one call (the attention step alone is a linear, the scores, a
// masked softmax, the context and a linear; why: docs/design/decoding.md, "The decoder step as one call"), the same
// arithmetic as the modules: the linears with linear_into (the small-row kernel at batch 1), the scores and context
// with the kernels of attention_cpu.cpp, the softmax and layer norms with plain loops. No autograd: the Python side
// calls them only when nothing needs a gradient.
#include "decode_step.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention.h"
#include "cell_math.h"
#include "cpu_dispatch.h"
#include "op_checks.h"
#include "phase_timers.h"
#include "small_gemm.h"
#include "transition.h"

namespace dtmt {
namespace {

using at::Tensor;

bool present(const Tensor& t) { return t.defined() && t.numel() > 0; }

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, StepScratch* scratch = nullptr) {
  Tensor out = step_tensor(scratch, {x.size(0), w.size(0)}, x.options());
  linear_into(out, present(b) ? b : Tensor(), x, w);
  return out;
}

// x = LN(x) * w + b over one row of R, in place (the normalisation of cell_math.h, as the cells use).
template <typename T> void layer_norm_inplace(T* x, const T* w, const T* b, double eps, int64_t R) {
  layer_norm_row_normalise(static_cast<int>(R), x, static_cast<T>(eps));
  for (int64_t r = 0; r < R; ++r) x[r] = x[r] * w[r] + b[r];
}

// Every value of the contiguous float / double t within +-kExpScoreBound (NaN is not).
bool within_exp_score_bound(const Tensor& t) {
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "within_exp_score_bound", [&] {
    ok = typed_cpu_kernels<scalar_t>().within_bound(t.data_ptr<scalar_t>(), t.numel(),
                                                    static_cast<scalar_t>(kExpScoreBound));
  });
  return ok;
}

void check_cpu(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    TORCH_CHECK(!present(*t) || t->device().is_cpu(), "dtmt._C.", op, " takes CPU tensors");
}

}  // namespace

AttentionWeights AttentionWeights::from_list(const std::vector<Tensor>& t, double ln_eps) {
  TORCH_CHECK(t.size() == 6, "dtmt._C: the attention weights are 6 tensors (", kAttentionWeightFields, "), got ",
              t.size());
  AttentionWeights w{t[0], t[1], t[2], t[3], t[4], t[5], ln_eps};
  // v [NH, D] gives the heads; w_q [NH * D, Q] (int8 rows: Q + 4); ln_w and ln_b both empty or both [NH * D];
  // w_o [C', C] with b_o [C'], or both empty
  TORCH_CHECK(w.v.defined() && w.v.dim() == 2 && w.v.numel() > 0, "dtmt._C: the attention's v must be [NH, D], got ",
              w.v.defined() ? w.v.sizes() : at::IntArrayRef{});
  const int64_t A = w.v.numel();
  TORCH_CHECK(w.w_q.defined() && w.w_q.dim() == 2 && w.w_q.size(0) == A, "dtmt._C: the attention's w_q must have ",
              A, " rows (NH * D of v ", w.v.sizes(), "), got ", w.w_q.defined() ? w.w_q.sizes() : at::IntArrayRef{});
  TORCH_CHECK(present(w.ln_w) == present(w.ln_b) && (!present(w.ln_w) || (w.ln_w.numel() == A && w.ln_b.numel() == A)),
              "dtmt._C: the attention's ln_w and ln_b must both be empty or both [", A, "], got ", w.ln_w.sizes(),
              " and ", w.ln_b.sizes());
  TORCH_CHECK(!present(w.w_o) ? !present(w.b_o)
                              : w.w_o.dim() == 2 && (!present(w.b_o) || w.b_o.numel() == w.w_o.size(0)),
              "dtmt._C: the attention's w_o [C', C] and b_o [C'] (or both empty), got ", w.w_o.sizes(), " and ",
              w.b_o.sizes());
  return w;
}

ReadoutWeights ReadoutWeights::from_list(const std::vector<Tensor>& t, double eps, bool with_output) {
  TORCH_CHECK(t.size() == 10, "dtmt._C: the readout weights are 10 tensors (", kReadoutWeightFields, "), got ",
              t.size());
  ReadoutWeights w{t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], eps};
  // w_y, w_s, w_c [R, *] (int8 rows too) with biases [R] or empty; ln_w and ln_b both empty or both [3, R];
  // w_out [V, R] (int8: R + 4) with b_out [V] or empty; without `with_output` (the features alone) both may be
  // empty (a readout with deep layers has no output layer among them)
  TORCH_CHECK(w.w_y.defined() && w.w_y.dim() == 2 && w.w_y.size(0) > 0, "dtmt._C: the readout's w_y must be [R, E]");
  const int64_t R = w.w_y.size(0);
  for (const auto& [m, b, name] : {std::tuple<const Tensor&, const Tensor&, const char*>{w.w_y, w.b_y, "y"},
                                   {w.w_s, w.b_s, "s"}, {w.w_c, w.b_c, "c"}})
    TORCH_CHECK(m.defined() && m.dim() == 2 && m.size(0) == R && (!present(b) || b.numel() == R),
                "dtmt._C: the readout's w_", name, " must be [", R, ", *] with b_", name, " [", R,
                "] or empty, got ", m.defined() ? m.sizes() : at::IntArrayRef{}, " and ", b.sizes());
  TORCH_CHECK(present(w.ln_w) == present(w.ln_b) &&
                  (!present(w.ln_w) || (w.ln_w.numel() == 3 * R && w.ln_b.numel() == 3 * R)),
              "dtmt._C: the readout's ln_w and ln_b must both be empty or both [3, ", R, "], got ", w.ln_w.sizes(),
              " and ", w.ln_b.sizes());
  if (!with_output && !present(w.w_out) && !present(w.b_out)) return w;
  TORCH_CHECK(w.w_out.defined() && w.w_out.dim() == 2 && w.w_out.size(0) > 0 && weight_in_features(w.w_out) == R &&
                  (!present(w.b_out) || w.b_out.numel() == w.w_out.size(0)),
              "dtmt._C: the readout's w_out must be [V, ", R, "] (int8 rows: ", R + kInt8RowTail,
              " bytes) with b_out [V] or empty, got ",
              w.w_out.defined() ? w.w_out.sizes() : at::IntArrayRef{}, " and ", w.b_out.sizes());
  return w;
}

MemoryWeights MemoryWeights::from_list(const std::vector<Tensor>& t) {
  TORCH_CHECK(t.size() == 8, "dtmt._C: the memory weights are 8 tensors (", kMemoryWeightFields, "), got ",
              t.size());
  return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]};
}

TransitionWeights cell_weights(int64_t kind, const std::vector<Tensor>& p, const char* op, const char* what) {
  TORCH_CHECK(p.size() == 10, "dtmt::", op, ": ", what, ": a cell takes ten parameter tensors, got ", p.size());
  for (const auto& t : p) check_cpu({&t}, "cell");
  TransitionWeights w{kind, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9]};
  check_cell(w, -1, op, what);
  return with_tgru_slices(std::move(w));
}

std::vector<Tensor> SourceProducts::weigh(const Tensor& alpha, int64_t group, StepScratch* scratch) const {
  const int64_t n = alpha.size(0), width = NH * S, N = products.size(1), R = N - N_ih;
  TORCH_CHECK(alpha.is_contiguous() && alpha.dim() == 3 && alpha.size(1) * alpha.size(2) == width &&
                  n == static_cast<int64_t>(block.size()) * group && alpha.scalar_type() == products.scalar_type(),
              "dtmt::SourceProducts: alpha [rows, NH, S] of the products' sentences expected, got ", alpha.sizes());
  std::vector<int64_t> row_block(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) row_block[r] = block[r / group];
  Tensor xp = step_tensor(scratch, {n, N_ih}, alpha.options()), c_part = step_tensor(scratch, {n, R}, alpha.options());
  AT_DISPATCH_FLOATING_TYPES(alpha.scalar_type(), "SourceProducts::weigh", [&] {
    const auto loop = typed_cpu_kernels<scalar_t>().weigh_products;
    const scalar_t* a = alpha.data_ptr<scalar_t>();
    const scalar_t* p = products.data_ptr<scalar_t>();
    const scalar_t* bias_p = bias.data_ptr<scalar_t>();
    scalar_t* o[2] = {xp.data_ptr<scalar_t>(), c_part.data_ptr<scalar_t>()};
    // column chunks of 256 split among threads; each writes its own columns, summed in the same order
    constexpr int64_t kTask = 256;
    at::parallel_for(0, (N + kTask - 1) / kTask, 1, [&](int64_t c0, int64_t c1) {
      for (int part = 0; part < 2; ++part) {
        const int64_t lo = part == 0 ? 0 : N_ih, hi = part == 0 ? N_ih : N;
        const int64_t n0 = std::max(lo, c0 * kTask), n1 = std::min(hi, c1 * kTask);
        if (n0 < n1) loop(a, n, width, row_block.data(), p, N, bias_p, o[part] + (n0 - lo), hi - lo, n0, n1);
      }
    });
  });
  return {xp, c_part};
}

std::vector<Tensor> TokenProducts::rows(const std::vector<int64_t>& prev, int64_t t, StepScratch* scratch) const {
  const int64_t n = static_cast<int64_t>(prev.size()), V = tokens.size(0), N = tokens.size(1);
  for (int64_t w : prev) TORCH_CHECK(w >= 0 && w < V, "dtmt._C.rnmt_beam_search: token ", w, " has no embedding");
  Tensor cell = step_tensor(scratch, {n, N_q}, tokens.options());
  Tensor readout = step_tensor(scratch, {n, N - N_q}, tokens.options());
  AT_DISPATCH_FLOATING_TYPES(tokens.scalar_type(), "TokenProducts::rows", [&] {
    typed_cpu_kernels<scalar_t>().token_rows(tokens.data_ptr<scalar_t>(),
                                             positions.defined() ? positions.data_ptr<scalar_t>() + t * N : nullptr,
                                             bias.data_ptr<scalar_t>(), N, N_q, prev.data(), n,
                                             cell.data_ptr<scalar_t>(), readout.data_ptr<scalar_t>());
  });
  return {cell, readout};
}

std::optional<TokenProducts> token_products_cpu(const Tensor& tokens, const Tensor& positions, int64_t steps,
                                                const TransitionWeights& query_cell, const ReadoutWeights& readout) {
  if (!present(tokens)) return std::nullopt;
  const auto st = tokens.scalar_type();
  const int64_t N_q = query_cell.w_ih.size(0), R = readout.w_y.size(0);
  const auto fits = [&](const Tensor& w) { return w.defined() && w.dim() == 2 && w.scalar_type() == st; };
  // float weights of the tables' dtype (not int8 rows), tables of their widths, positions for every step
  if ((st != at::kFloat && st != at::kDouble) || !fits(query_cell.w_ih) || !fits(readout.w_y) ||
      tokens.dim() != 2 || tokens.size(1) != N_q + R || !tokens.device().is_cpu() ||
      (present(positions) && (positions.dim() != 2 || positions.size(0) < steps || positions.size(1) != N_q + R ||
                              positions.scalar_type() != st)))
    return std::nullopt;
  TokenProducts tp;
  tp.tokens = tokens.contiguous();
  tp.positions = present(positions) ? positions.contiguous() : Tensor();
  tp.bias = at::cat({present(query_cell.b_ih) ? query_cell.b_ih : at::zeros({N_q}, tokens.options()),
                     present(readout.b_y) ? readout.b_y : at::zeros({R}, tokens.options())});
  tp.N_q = N_q;
  return tp;
}

bool source_products_pay(const Tensor& annotations, int64_t NH, const TransitionWeights& decoder_cell,
                         const AttentionWeights& attention, const ReadoutWeights& readout) {
  const auto st = annotations.scalar_type();
  const auto plain = [&](const Tensor& w) {   // a float matrix [., C] of the annotations' dtype (not int8 rows)
    return w.defined() && w.dim() == 2 && w.scalar_type() == st && w.size(1) == annotations.size(2) &&
           w.device().is_cpu();
  };
  const int64_t B = annotations.size(0), S = annotations.size(1), C = annotations.size(2);
  return !present(attention.w_o) && NH >= 1 && C % NH == 0 && (st == at::kFloat || st == at::kDouble) &&
         plain(decoder_cell.w_ih) && plain(readout.w_c) && B * NH * S * 2 <= C;
}

SourceProducts source_products_cpu(const Tensor& annotations, int64_t NH, const Tensor& w_ih, const Tensor& b_ih,
                                   const Tensor& w_c, const Tensor& b_c, const Tensor& heads) {
  const int64_t B = annotations.size(0), S = annotations.size(1), C = annotations.size(2), Dc = C / NH;
  const int64_t N_ih = w_ih.size(0), R = w_c.size(0), N = N_ih + R;
  // per head h: the head's slices of all positions [B * S, Dc] times W[:, h]^T [Dc, N]
  const Tensor a = annotations.contiguous().view({B * S, NH, Dc}).permute({1, 0, 2});
  TORCH_CHECK(!heads.defined() || (heads.dim() == 3 && heads.size(0) == NH && heads.size(1) == Dc &&
                                    heads.size(2) == N && heads.is_contiguous() &&
                                    heads.scalar_type() == annotations.scalar_type()),
              "dtmt._C.rnmt_beam_search: context_heads must be a contiguous [", NH, ", ", Dc, ", ", N,
              "] of the annotations' dtype (dtmt_models.engine.ops.context_heads of these weights), got ",
              heads.sizes(), " ", heads.scalar_type());
  const Tensor w = heads.defined() ? heads : at::cat({w_ih, w_c}, 0).view({N, NH, Dc}).permute({1, 2, 0});
  SourceProducts sp;
  sp.products = at::bmm(a, w).view({NH, B, S, N}).permute({1, 0, 2, 3}).contiguous().view({B * NH * S, N});
  sp.bias = at::cat({present(b_ih) ? b_ih : at::zeros({N_ih}, w_ih.options()),
                     present(b_c) ? b_c : at::zeros({R}, w_c.options())});
  sp.NH = NH;
  sp.S = S;
  sp.N_ih = N_ih;
  sp.block.resize(B);
  for (int64_t b = 0; b < B; ++b) sp.block[b] = b;
  return sp;
}

Tensor key_exps_cpu(const Tensor& keys) {
  TORCH_CHECK(keys.dim() == 4 && keys.device().is_cpu(), "dtmt::key_exps: CPU keys [B, S, NH, D] expected");
  const auto st = keys.scalar_type();
  if ((st != at::kFloat && st != at::kDouble) || keys.numel() == 0) return Tensor();
  const Tensor k = keys.contiguous();
  if (!within_exp_score_bound(k)) return Tensor();
  const int64_t B = keys.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3), Sp = (S + 15) / 16 * 16;
  Tensor out = at::ones({B, NH, D, Sp}, keys.options());
  out.narrow(3, 0, S).copy_(k.permute({0, 2, 3, 1}).mul(2).exp());
  return out;
}

std::vector<Tensor> attention_step_cpu(const Tensor& query, const Tensor& keys, const Tensor& annotations,
                                       const Tensor& src_mask, const AttentionWeights& w, int64_t group,
                                       bool with_context, const Tensor& key_exps, StepScratch* scratch) {
  const Tensor &w_q = w.w_q, &v = w.v, &ln_w = w.ln_w, &ln_b = w.ln_b;
  const double ln_eps = w.ln_eps;
  check_cpu({&query, &w_q, &keys, &v, &annotations, &src_mask, &w.w_o, &w.b_o, &ln_w, &ln_b}, "attention_step");
  TORCH_CHECK(query.dim() == 2 && keys.dim() == 4 && src_mask.dim() == 2 && src_mask.scalar_type() == at::kBool,
              "dtmt._C.attention_step: query [B, Q], keys [B, S, NH, D] and a bool src_mask [B, S] expected");
  TORCH_CHECK(group >= 1, "dtmt._C.attention_step: group must be >= 1, got ", group);
  const int64_t B = query.size(0), S = keys.size(1), NH = keys.size(2), D = keys.size(3);
  TORCH_CHECK(B == keys.size(0) * group && src_mask.size(0) == keys.size(0) && src_mask.size(1) == S &&
                  w_q.size(0) == NH * D,
              "dtmt._C.attention_step: sizes of query, keys, w_q and src_mask do not match");
  TORCH_CHECK(present(ln_w) == present(ln_b), "dtmt._C.attention_step: give both ln_w and ln_b, or neither");
  TORCH_CHECK(!present(ln_w) || (ln_w.numel() == NH * D && ln_b.numel() == NH * D && ln_w.is_contiguous() &&
                                  ln_b.is_contiguous() && ln_w.scalar_type() == query.scalar_type() &&
                                  ln_b.scalar_type() == query.scalar_type()),
              "dtmt._C.attention_step: ln_w and ln_b must be contiguous [NH*D = ", NH * D, "] of the query's dtype "
              "(or both empty: no layer norm), got ", ln_w.sizes(), " and ", ln_b.sizes());
  DTMT_PHASE_START(query_phase, query_product);
  Tensor q = linear(query, w_q, Tensor(), scratch);
  DTMT_PHASE_END(query_phase);
  DTMT_PHASE_START(scores_phase, scores);
  if (present(ln_w)) {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_step_ln", [&] {
      for (int64_t b = 0; b < B; ++b)
        layer_norm_inplace<scalar_t>(q.data_ptr<scalar_t>() + b * NH * D, ln_w.data_ptr<scalar_t>(),
                                     ln_b.data_ptr<scalar_t>(), ln_eps, NH * D);
    });
  }
  Tensor scores;   // (q stays [B, NH * D]: a view would be a dispatched op, its code out of the caches by now)
  if (key_exps.defined() && within_exp_score_bound(q)) {
    TORCH_CHECK(key_exps.dim() == 4 && key_exps.size(0) * group == B && key_exps.size(1) == NH &&
                    key_exps.size(2) == D && key_exps.size(3) >= S && key_exps.size(3) % 16 == 0 &&
                    key_exps.is_contiguous() && key_exps.scalar_type() == q.scalar_type() && v.is_contiguous(),
                "dtmt._C.attention_step: key_exps must be key_exps_cpu(keys)");
    scores = step_tensor(scratch, {B, NH, S}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_scores_from_exps", [&] {
      const auto loop = typed_cpu_kernels<scalar_t>().scores_from_exps;
      const scalar_t* ek = key_exps.data_ptr<scalar_t>();
      const scalar_t* qq = q.data_ptr<scalar_t>();
      const scalar_t* vv = v.data_ptr<scalar_t>();
      scalar_t* o = scores.data_ptr<scalar_t>();
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        loop(ek, qq, vv, o, S, key_exps.size(3), NH, D, group, b0, b1);
      });
    });
  } else {
    scores = additive_scores_forward_cpu(keys.contiguous(), q.view({B, NH, D}), v.contiguous(), group);
  }
  DTMT_PHASE_END(scores_phase);
  DTMT_PHASE_START(softmax_phase, attention_softmax);
  Tensor alpha = step_tensor(scratch, scores.sizes(), scores.options());
  Tensor mask = src_mask.contiguous();
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "attention_step_cpu", [&] {
    typed_cpu_kernels<scalar_t>().masked_softmax_rows(scores.data_ptr<scalar_t>(), mask.data_ptr<bool>(),
                                                      alpha.data_ptr<scalar_t>(), NH, S, group, 0, B);
  });
  if (!with_context) {
    DTMT_PHASE_END(softmax_phase);
    return {Tensor(), alpha};
  }
  Tensor context = attention_context_forward_cpu(alpha, annotations, group);
  if (present(w.w_o)) context = linear(context, w.w_o, w.b_o);
  DTMT_PHASE_END(softmax_phase);
  return {context, alpha};
}

Tensor readout_features_cpu(const Tensor& y, const Tensor& s, const Tensor& c, const ReadoutWeights& w,
                            const Tensor& c_part, const Tensor& y_part, StepScratch* scratch) {
  const Tensor &w_y = w.w_y, &b_y = w.b_y, &w_s = w.w_s, &b_s = w.b_s, &w_c = w.w_c, &b_c = w.b_c, &ln_w = w.ln_w,
               &ln_b = w.ln_b;
  const double eps = w.eps;
  const Tensor& c_in = c_part.defined() ? c_part : c;
  const Tensor& y_in = y_part.defined() ? y_part : y;
  check_cpu({&y_in, &s, &c_in, &w_y, &b_y, &w_s, &b_s, &w_c, &b_c, &ln_w, &ln_b}, "readout_features");
  TORCH_CHECK(y_in.dim() == 2 && s.dim() == 2 && c_in.dim() == 2 && y_in.size(0) == s.size(0) &&
                  y_in.size(0) == c_in.size(0),
              "dtmt._C.readout_features: y, s and c must be [N, ·] with the same N");
  const int64_t N = s.size(0), R = w_y.size(0);
  TORCH_CHECK(!c_part.defined() || (c_part.size(1) == R && c_part.is_contiguous()),
              "dtmt._C.readout_features: c_part must be a contiguous [N, ", R, "]");
  TORCH_CHECK(!y_part.defined() || (y_part.size(1) == R && y_part.is_contiguous()),
              "dtmt._C.readout_features: y_part must be a contiguous [N, ", R, "]");
  TORCH_CHECK(w_s.size(0) == R && w_c.size(0) == R, "dtmt._C.readout_features: the three weights need R rows");
  const bool ln = present(ln_w);
  TORCH_CHECK(!ln || (ln_w.sizes() == at::IntArrayRef{3, R} && ln_b.sizes() == at::IntArrayRef{3, R} &&
                      ln_w.is_contiguous() && ln_b.is_contiguous()),
              "dtmt._C.readout_features: ln_w and ln_b must be contiguous [3, R]");
  const Tensor parts[3] = {y_part.defined() ? y_part : linear(y, w_y, b_y, scratch), linear(s, w_s, b_s, scratch),
                           c_part.defined() ? c_part : linear(c, w_c, b_c, scratch)};   // (LN works in place)
  const auto st = s.scalar_type();
  if ((st != at::kFloat && st != at::kDouble) || parts[0].scalar_type() != st || parts[2].scalar_type() != st) {
    if (!ln) return parts[0].add_(parts[1]).add_(parts[2]).tanh_();
    TORCH_CHECK(false, "dtmt._C.readout_features: the layer norms take float or double, got ", st);
  }
  Tensor out = step_tensor(scratch, {N, R}, s.options());
  AT_DISPATCH_FLOATING_TYPES(st, "readout_features_cpu", [&] {
    scalar_t* p[3] = {parts[0].data_ptr<scalar_t>(), parts[1].data_ptr<scalar_t>(), parts[2].data_ptr<scalar_t>()};
    typed_cpu_kernels<scalar_t>().readout_rows(p, ln ? ln_w.data_ptr<scalar_t>() : nullptr,
                                               ln ? ln_b.data_ptr<scalar_t>() : nullptr, static_cast<scalar_t>(eps),
                                               R, out.data_ptr<scalar_t>(), 0, N);
  });
  return out;
}

std::vector<Tensor> rnmt_step_cpu(const Tensor& y, const Tensor& s, const Tensor& keys, const Tensor& annotations,
                                  const Tensor& src_mask, const TransitionWeights& query_cell,
                                  const TransitionWeights& decoder_cell, double cell_eps,
                                  const AttentionWeights& attention, const ReadoutWeights& readout, int64_t group,
                                  const StepTables* tables, bool with_attention, StepBuffers* buffers) {
  check_cpu({&s, &readout.w_out, &readout.b_out}, "rnmt_step");
  const SourceProducts* source = tables != nullptr ? tables->source : nullptr;
  StepScratch* scratch = buffers != nullptr ? &buffers->scratch : nullptr;
  const bool y_given = tables != nullptr && tables->y_cell.defined();   // y's products from TokenProducts
  DTMT_PHASE_START(query_cell_phase, query_cell);
  const Tensor s_q = y_given ? cell_step_from_products_cpu(tables->y_cell, s, query_cell, cell_eps, scratch)
                             : cell_step_cpu(y, s, query_cell, cell_eps, scratch);
  DTMT_PHASE_END(query_cell_phase);
  const Tensor y_part = y_given ? tables->y_readout : Tensor();
  DTMT_PHASE_START(attention_phase, attention);
  auto ca = attention_step_cpu(s_q, keys, annotations, src_mask, attention, group, source == nullptr,
                               tables != nullptr ? tables->key_exps : Tensor(), scratch);
  DTMT_PHASE_END(attention_phase);
  Tensor features, s_new;
  if (source != nullptr) {   // c W^T + b as the per-position products weighed by alpha (SourceProducts)
    DTMT_PHASE_START(weigh_phase, weigh);
    const std::vector<Tensor> both = source->weigh(ca[1], group, scratch);
    DTMT_PHASE_END(weigh_phase);
    DTMT_PHASE_START(decoder_cell_phase, decoder_cell);
    s_new = cell_step_from_products_cpu(both[0], s_q, decoder_cell, cell_eps, scratch);
    DTMT_PHASE_END(decoder_cell_phase);
    DTMT_PHASE_START(readout_phase, readout);
    features = readout_features_cpu(y, s_new, Tensor(), readout, both[1], y_part, scratch);
    DTMT_PHASE_END(readout_phase);
  } else {
    const Tensor& context = ca[0];
    DTMT_PHASE_START(decoder_cell_phase, decoder_cell);
    s_new = cell_step_cpu(context, s_q, decoder_cell, cell_eps, scratch);
    DTMT_PHASE_END(decoder_cell_phase);
    DTMT_PHASE_START(readout_phase, readout);
    features = readout_features_cpu(y, s_new, context, readout, Tensor(), y_part, scratch);
    DTMT_PHASE_END(readout_phase);
  }
  // log-probabilities in the model's precision, float32 at least (as Projection.forward)
  const at::ScalarType lp_type = at::promoteTypes(features.scalar_type(), at::kFloat);
  StepBuffers fresh;   // no buffers given: the step's own, new tensors
  StepBuffers& out = buffers != nullptr ? *buffers : fresh;
  const auto fit = [&](Tensor& t, at::ScalarType type) {   // [N, V] of `type`, its storage kept where it can be
    const int64_t N = features.size(0), V = readout.w_out.size(0);
    if (t.defined() && t.scalar_type() == type && t.dim() == 2 && t.size(0) == N && t.size(1) == V) return;
    if (!t.defined() || t.scalar_type() != type) t = at::empty({0}, features.options().dtype(type));
    t.resize_({N, V});
  };
  fit(out.logits, features.scalar_type());
  fit(out.log_probs, lp_type);
  DTMT_PHASE_START(output_phase, output_product);
  linear_into(out.logits, readout.b_out, features, readout.w_out);
  DTMT_PHASE_END(output_phase);
  DTMT_PHASE_START(log_softmax_phase, log_softmax);
  if (lp_type == features.scalar_type()) {   // float / double: the row loop of this CPU's copy
    AT_DISPATCH_FLOATING_TYPES(lp_type, "rnmt_step_log_softmax", [&] {
      typed_cpu_kernels<scalar_t>().log_softmax_rows(out.logits.data_ptr<scalar_t>(),
                                                     out.log_probs.data_ptr<scalar_t>(), out.logits.size(1), 0,
                                                     out.logits.size(0));
    });
  } else {
    at::log_softmax_out(out.log_probs, out.logits.to(lp_type), -1);
  }
  DTMT_PHASE_END(log_softmax_phase);
  const Tensor log_probs = out.log_probs;
  const Tensor& alpha = ca[1];  // [B, NH, S]: the decoder state keeps the head average
  if (!with_attention) return {log_probs, s_new, Tensor()};
  return {log_probs, s_new, alpha.size(1) == 1 ? alpha.squeeze(1) : alpha.mean(1)};
}

std::vector<Tensor> memory_encoder_cpu(const Tensor& x, const Tensor& memory0, const Tensor& src_mask, bool reverse,
                                       const TransitionWeights& cell, double cell_eps, const MemoryWeights& a) {
  TORCH_CHECK(x.dim() == 3 && memory0.dim() == 3 && src_mask.dim() == 2 && src_mask.scalar_type() == at::kBool &&
                  x.size(0) == memory0.size(0) && x.size(1) == memory0.size(1) &&
                  src_mask.size(0) == x.size(0) && src_mask.size(1) == x.size(1),
              "dtmt._C.memory_encoder: x [B, S, E], memory [B, S, H] and a bool src_mask [B, S] expected");
  check_cpu({&a.w_state, &a.w_memory, &a.b_memory, &a.v, &a.w_read, &a.b_read, &a.w_write, &a.b_write},
            "memory_encoder");
  check_cpu({&x, &memory0, &src_mask}, "memory_encoder");
  const int64_t B = x.size(0), S = x.size(1), H = memory0.size(2);
  const Tensor &w_state = a.w_state, &w_memory = a.w_memory, &b_memory = a.b_memory, &v = a.v, &w_read = a.w_read,
               &b_read = a.b_read, &w_write = a.w_write, &b_write = a.b_write;
  Tensor memory = memory0.contiguous();
  Tensor s = at::zeros({B, H}, x.options());
  Tensor states = at::zeros({B, S, H}, x.options());
  const Tensor invalid = src_mask.logical_not();
  const Tensor neg_inf = at::full({}, -std::numeric_limits<double>::infinity(), x.options());
  for (int64_t step = 0; step < S; ++step) {
    const int64_t t = reverse ? S - 1 - step : step;
    // w_t = softmax_i v . tanh(U_a s + W_a M[i] + b) over the real positions
    const Tensor keys = linear(memory.view({B * S, H}), w_memory, b_memory).view({B, S, H});
    const Tensor e = linear(at::tanh(keys + linear(s, w_state, Tensor()).unsqueeze(1)).view({B * S, H}), v,
                            Tensor()).view({B, S});
    const Tensor w = at::softmax(at::where(invalid, neg_inf, e), -1);
    const Tensor read = memory * at::sigmoid(linear(s, w_read, b_read)).unsqueeze(1);   // M~_t = R_t (.) M
    const Tensor c = at::bmm(w.unsqueeze(1), read).squeeze(1);
    const Tensor s_new = cell_step_cpu(at::cat({x.select(1, t), c}, -1), s, cell, cell_eps);
    const Tensor written = read + w.unsqueeze(-1) * at::sigmoid(linear(s_new, w_write, b_write)).unsqueeze(1);
    const Tensor valid = src_mask.select(1, t).view({B, 1});
    s = at::where(valid, s_new, s);
    memory = at::where(valid.unsqueeze(-1), written, memory).contiguous();
    states.select(1, t).copy_(at::where(valid, s_new, at::zeros_like(s_new)));
  }
  return {states, memory};
}

}  // namespace dtmt
