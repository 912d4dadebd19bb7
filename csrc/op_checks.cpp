// The checks at the ops' boundary (see op_checks.h).
#include "op_checks.h"

#include <limits>
#include <sstream>
#include <tuple>
#include <utility>
#include <string>

#include "cell_math.h"
#include "small_gemm.h"

namespace dtmt {
namespace {

std::string sizes_text(std::initializer_list<int64_t> sizes) {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (int64_t n : sizes) {
    s << (first ? "" : ", ");
    if (n < 0) {
      s << "*";
    } else {
      s << n;
    }
    first = false;
  }
  s << "]";
  return s.str();
}

bool has_sizes(const at::Tensor& t, std::initializer_list<int64_t> sizes) {
  if (!t.defined() || t.dim() != static_cast<int64_t>(sizes.size())) return false;
  int64_t d = 0;
  for (int64_t n : sizes) {
    if (n >= 0 && t.size(d) != n) return false;
    ++d;
  }
  return true;
}

// A matrix of `rows` rows of `cols` values: float [rows, cols], or int8 rows [rows, cols + 4] (small_gemm.h).
bool is_matrix(const at::Tensor& t, int64_t rows, int64_t cols) {
  return t.defined() && t.dim() == 2 && t.size(0) == rows && (cols < 0 || weight_in_features(t) == cols);
}

}  // namespace

// (without the word, "must be [20, 9] ..., got [20, 9]" read as a contradiction)
std::string matrix_text(const at::Tensor& t) {
  if (!t.defined()) return "[]";
  std::ostringstream s;
  s << t.sizes() << (t.scalar_type() == at::kChar ? " int8 rows" : "");
  return s.str();
}

void check_eps(double eps, const char* op, const char* name) {
  TORCH_CHECK(eps >= 0 && eps < std::numeric_limits<double>::infinity(),   // (NaN fails this too)
              "dtmt::", op, ": ", name, " must be a finite number >= 0, got ", eps);
}

void check_sizes(const at::Tensor& t, std::initializer_list<int64_t> sizes, const char* op, const char* name) {
  TORCH_CHECK(has_sizes(t, sizes), "dtmt::", op, ": ", name, " must be ", sizes_text(sizes), ", got ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
}

void check_optional_sizes(const at::Tensor& t, std::initializer_list<int64_t> sizes, const char* op,
                          const char* name) {
  TORCH_CHECK(!given(t) || has_sizes(t, sizes), "dtmt::", op, ": ", name, " must be empty or ", sizes_text(sizes),
              ", got ", t.sizes());
}

void check_floating(const at::Tensor& t, const char* op, const char* name, bool int8_rows, const char* what) {
  if (!given(t)) return;
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK(at::isFloatingType(type) || (int8_rows && type == at::kChar), "dtmt::", op, ": ", what ? what : "",
              what ? ": " : "", name, " must be a floating-point tensor", int8_rows ? " (or int8 rows)" : "", ", got ",
              type);
}

void check_mask(const at::Tensor& mask, const char* op) {
  if (!given(mask)) return;
  const at::ScalarType type = mask.scalar_type();
  TORCH_CHECK(type == at::kBool || at::isFloatingType(type), "dtmt::", op,
              ": mask must be bool or floating point (1 a real step, 0 padding), got ", type);
}

int64_t check_cell(const TransitionWeights& w, int64_t input_size, const char* op, const char* what) {
  const int64_t kind = w.kind;
  for (const auto& [t, name, rows] : {std::tuple<const at::Tensor&, const char*, bool>{w.w_ih, "w_ih", true},
                                      {w.w_hh, "w_hh", true}, {w.t_w, "t_w", true}, {w.b_ih, "b_ih", false},
                                      {w.b_hh, "b_hh", false}, {w.ln_w, "ln_w", false}, {w.ln_b, "ln_b", false},
                                      {w.t_b, "t_b", false}, {w.t_ln_w, "t_ln_w", false},
                                      {w.t_ln_b, "t_ln_b", false}})
    check_floating(t, op, name, rows, what);
  TORCH_CHECK(base_cell(kind), "dtmt::", op, ": ", what, ": unknown cell kind ", kind, " (", kBaseCellNames, ")");
  const int k = static_cast<int>(kind);
  const int64_t n_in = cell_input_rows(k), n_h = cell_hidden_rows(k), g = cell_ln_groups(k);
  TORCH_CHECK(w.w_hh.defined() && w.w_hh.dim() == 2 && w.w_hh.size(0) > 0 && w.w_hh.size(0) % n_h == 0, "dtmt::",
              op, ": ", what, ": w_hh must be [", n_h, " * H, H] for this cell, got ",
              matrix_text(w.w_hh));
  const int64_t H = w.w_hh.size(0) / n_h;
  TORCH_CHECK(is_matrix(w.w_hh, n_h * H, H), "dtmt::", op, ": ", what, ": w_hh must be [", n_h * H, ", ", H,
              "] (int8 rows: [", n_h * H, ", ", H + kInt8RowTail, "]), got ", matrix_text(w.w_hh));
  TORCH_CHECK(is_matrix(w.w_ih, n_in * H, input_size), "dtmt::", op, ": ", what, ": w_ih must be [", n_in * H, ", ",
              input_size < 0 ? std::string("input size") : std::to_string(input_size), "] (H = ", H,
              "; int8 rows: 4 bytes wider), got ", matrix_text(w.w_ih));
  TORCH_CHECK(!given(w.b_ih) || (w.b_ih.dim() == 1 && w.b_ih.size(0) == n_in * H), "dtmt::", op, ": ", what,
              ": b_ih must be empty or [", n_in * H, "], got ", w.b_ih.sizes());
  TORCH_CHECK(!given(w.b_hh) || (w.b_hh.dim() == 1 && w.b_hh.size(0) == n_h * H), "dtmt::", op, ": ", what,
              ": b_hh must be empty or [", n_h * H, "], got ", w.b_hh.sizes());
  TORCH_CHECK(given(w.ln_w) == given(w.ln_b), "dtmt::", op, ": ", what,
              ": ln_w and ln_b must both be given or both be empty, got ", w.ln_w.sizes(), " and ", w.ln_b.sizes());
  TORCH_CHECK(!given(w.ln_w) || (w.ln_w.dim() == 1 && w.ln_w.size(0) == g * H && w.ln_b.dim() == 1 &&
                                 w.ln_b.size(0) == g * H),
              "dtmt::", op, ": ", what, ": ln_w and ln_b must be [", g * H, "] (", g, " gates of H = ", H, "), got ",
              w.ln_w.sizes(), " and ", w.ln_b.sizes());
  TORCH_CHECK(given(w.t_w) == given(w.t_b), "dtmt::", op, ": ", what,
              ": t_w and t_b must both be given or both be empty, got ", w.t_w.sizes(), " and ", w.t_b.sizes());
  const int64_t D = given(w.t_w) ? w.t_w.size(0) : 0;
  if (D > 0) {
    TORCH_CHECK(w.t_w.dim() == 3 && w.t_w.size(1) == 3 * H && weight_in_features(w.t_w) == H, "dtmt::", op, ": ",
                what, ": t_w must be [D, ", 3 * H, ", ", H, "] (int8 rows: ", H + kInt8RowTail, " bytes), got ",
                matrix_text(w.t_w));
    TORCH_CHECK(w.t_b.dim() == 2 && w.t_b.size(0) == D && w.t_b.size(1) == 3 * H, "dtmt::", op, ": ", what,
                ": t_b must be [", D, ", ", 3 * H, "], got ", w.t_b.sizes());
  }
  TORCH_CHECK(given(w.t_ln_w) == given(w.t_ln_b), "dtmt::", op, ": ", what,
              ": t_ln_w and t_ln_b must both be given or both be empty, got ", w.t_ln_w.sizes(), " and ",
              w.t_ln_b.sizes());
  TORCH_CHECK(!given(w.t_ln_w) || (D > 0 && w.t_ln_w.dim() == 2 && w.t_ln_w.size(0) == D &&
                                   w.t_ln_w.size(1) == 2 * H && w.t_ln_b.dim() == 2 && w.t_ln_b.size(0) == D &&
                                   w.t_ln_b.size(1) == 2 * H),
              "dtmt::", op, ": ", what, ": t_ln_w and t_ln_b must be [D = ", D, ", ", 2 * H,
              "] (and given only with T-GRUs), got ", w.t_ln_w.sizes(), " and ", w.t_ln_b.sizes());
  return H;
}

void check_dtype(const at::Tensor& t, at::ScalarType type, const char* op, const char* name, const char* of,
                 bool int8_rows) {
  if (!given(t)) return;
  const at::ScalarType got = t.scalar_type();
  TORCH_CHECK(got == type || (int8_rows && got == at::kChar), "dtmt::", op, ": ", name, " must have ", of,
              "'s dtype ", type, int8_rows ? " (or be int8 rows)" : "", ", got ", got);
}

void check_list_dtype(at::TensorList ts, at::ScalarType type, const char* op, const char* list, const char* of) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    if (!given(t) || !at::isFloatingType(t.scalar_type())) continue;
    TORCH_CHECK(t.scalar_type() == type, "dtmt::", op, ": ", list, "[", i, "] must have ", of, "'s dtype ", type,
                ", got ", t.scalar_type());
  }
}

void check_state_dtype(const at::Tensor& h, at::ScalarType type, const char* op, const char* name, const char* of) {
  if (!given(h)) return;
  const bool half = type == at::kHalf || type == at::kBFloat16;
  TORCH_CHECK(h.scalar_type() == type || (half && h.scalar_type() == at::kFloat), "dtmt::", op, ": ", name,
              " must have ", of, "'s dtype ", type, half ? " (or float32, the state under autocast)" : "", ", got ",
              h.scalar_type());
}

}  // namespace dtmt
