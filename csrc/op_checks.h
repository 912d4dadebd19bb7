// The checks at the ops' boundary (issue 71): what every op of registration.cpp verifies before a kernel indexes
// into a tensor, so that a call from Python, C++ or a compiled graph with a weight slot short or empty, a gradient
// or saved tensor of the wrong shape, or an id out of range gets a one-line error naming the op and the argument
// instead of a crash. Shapes; the kind of dtype of what a kernel would convert (check_floating: an integer or
// complex h0, bias or layer-norm gain was cast without a word, found by a hostile-input probe, 2026-12-02); every
// floating tensor in the dtype of the op's activation (check_dtype, check_list_dtype, check_state_dtype); and the
// dispatcher keeps the devices apart. Each check is a few comparisons of sizes: nothing
// per element, except the ids a search starts from (its BOS, EOS and banned words: a handful).
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>

#include "transition.h"

namespace dtmt {

// The most steps a search may be asked for (max_len): a bound stated so that a wrong max_len is an error, not a
// search that runs until killed. The embedded corpus' longest target is ~100 subwords and the usual rule is
// 2 * source + 10; 16,384 leaves room for documents translated whole.
constexpr int64_t kMaxSearchSteps = 16384;
// The widest beam a search takes: its memory grows with beam x batch x vocabulary, and beams past a few dozen
// translate worse, not better; a bound stated so that a wrong beam is an error, not an allocation that a large
// machine may grant (beam_search.py's MAX_BEAM states the same one).
constexpr int64_t kMaxBeam = 1024;
// The largest |alpha| of the GNMT length penalty ((5 + n) / 6) ^ alpha a search takes: past about 90 the penalty
// overflowed and every hypothesis scored -0.0, ranked by nothing (hypotheses.py's MAX_ALPHA states the same one).
constexpr double kMaxAlpha = 50.0;

// The words that start the error of a search whose model scored a candidate NaN or +inf (its weights or activations
// overflow float32): the search stops with a ValueError instead of ranking garbage. Python's beam search
// (dtmt_models/decoding/beam_search.py, NON_FINITE_SCORE) raises the same words and recognises them in this op's
// error.
constexpr const char* kNonFiniteScore = "the model gave a non-finite score";

// One direction's (or one cell's) weights against its cell kind: w_hh [n_h*H, H] (int8 rows: [n_h*H, H + 4]) gives
// H; w_ih [n_in*H, I] (int8: I + 4; I unchecked where input_size < 0); b_ih [n_in*H] and b_hh [n_h*H] or empty;
// ln_w and ln_b both empty or both [g*H]; the T-GRUs' t_w [D, 3H, H] (int8: H + 4) with t_b [D, 3H], or both empty;
// t_ln_w and t_ln_b both empty or both [D, 2H] (with T-GRUs). `what` names the weights in the error ("q_params",
// "direction 1"). Returns H.
int64_t check_cell(const TransitionWeights& w, int64_t input_size, const char* op, const char* what);

// A matrix's sizes as an error gives them: "[20, 9]", or "[20, 9] int8 rows" (whose width holds 4 bytes more than
// its columns).
std::string matrix_text(const at::Tensor& t);

// An op's eps (layer-norm, cell): a finite number >= 0, as the layers take it (a NaN or negative eps gave NaN
// states without a word).
void check_eps(double eps, const char* op, const char* name);

// `t` has exactly these sizes (-1: any).
void check_sizes(const at::Tensor& t, std::initializer_list<int64_t> sizes, const char* op, const char* name);

// `t` is absent (undefined or empty) or has exactly these sizes.
void check_optional_sizes(const at::Tensor& t, std::initializer_list<int64_t> sizes, const char* op,
                          const char* name);

// Whether an optional tensor is given (defined and not empty).
inline bool given(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// `t`, where given, holds real floating-point values (float64, float32, bfloat16, float16), or, with `int8_rows`,
// int8 rows (small_gemm.h): not an integer, bool or complex tensor, which a kernel would convert. `what` (if not
// null) goes before the name in the error, as check_cell's.
void check_floating(const at::Tensor& t, const char* op, const char* name, bool int8_rows = false,
                    const char* what = nullptr);

// A step mask (1 a real step, 0 padding), where given, is bool or real floating point: a complex one had been read
// as its real part (every step padding for 1j), an integer one converted.
void check_mask(const at::Tensor& mask, const char* op);

// `t`, where given, has dtype `type`, the dtype of the argument named `of` ("x"), or is int8 rows where
// `int8_rows`. Mixed dtypes had reached ATen's products, whose "self and mat2 must have the same dtype" names no op
// or argument, or been converted by one backend where another refused them.
void check_dtype(const at::Tensor& t, at::ScalarType type, const char* op, const char* name, const char* of,
                 bool int8_rows = false);

// Every given floating-point tensor of the Tensor[] argument `list` has dtype `type` (as check_dtype); int8 tensors
// pass (the weights' rows, whose places the list's own checks know).
void check_list_dtype(at::TensorList ts, at::ScalarType type, const char* op, const char* list, const char* of);

// A state (h0, or the gradient in its place) has the dtype `type` of the argument `of`, or float32 where that is
// 16-bit: autocast runs the products in bfloat16 or float16 and keeps the state float32 (ops/_autocast.py).
void check_state_dtype(const at::Tensor& h, at::ScalarType type, const char* op, const char* name, const char* of);

}  // namespace dtmt
