// A linear layer for few rows (decoding): out = x W^T + b with x [M, K], M <= kSmallRowsMax, W [N, K].
//
// Why: at batch 1 a decoder step multiplies 1-8 rows (the beam) by every weight matrix of the decoder once, so
// the step is bound by reading the weights (figures: docs/design/cpu_kernels.md, "Streaming the weights"). This
// kernel streams each weight row once, from start to end, and uses it for all M rows of x while it is in registers
// (x itself stays in L1). See small_gemm_cpu.cpp and isa/small_gemm_rows.cpp.
#pragma once

#include <ATen/ATen.h>

namespace dtmt {

constexpr int64_t kSmallRowsMax = 8;  // the loop (isa/small_gemm_rows.cpp) has a case for each M up to this

// True when the small-row kernel takes (x, w, bias, out): CPU float32, x [M, K] with 1 <= M <= kSmallRowsMax and
// unit stride along K, w [N, K] contiguous, bias empty or [N] contiguous, out [M, N] with unit stride along N.
bool small_rows_applicable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& out);

// Int8 weights (int8 decoding, issue 25): W [N, K] stored as an int8 tensor [N, K + 4] whose
// row n holds q[n, 0..K) and then the four bytes (native order) of the float32 scale[n], W[n, k] ~ scale[n] * q[n, k].
// The scale sits next to its row, so an int8 weight is one tensor wherever a float one goes (the ops' weight lists,
// t_w [D, 3H, K + 4] slices). Made by dtmt_kernels/ops/linear/quantize.py (pack_int8_rows), the reference.
constexpr int64_t kInt8RowTail = 4;
inline bool is_int8_rows(const at::Tensor& w) { return w.scalar_type() == at::kChar; }
// K, the input features of a weight (float [N, K] or int8 rows [N, K + 4]).
inline int64_t weight_in_features(const at::Tensor& w) {
  return is_int8_rows(w) ? w.size(-1) - kInt8RowTail : w.size(-1);
}

// out = x W^T + bias (bias may be empty), with the small-row kernel where applicable and ATen's GEMM otherwise.
// An int8 weight (is_int8_rows) takes float32 x, out and bias: each row of x is quantized to int8 with its own scale
// (max |x| / 127), the products summed exactly in int32 by the int8 small-row loop (groups of kSmallRowsMax rows of
// x), then scaled: out[m, n] = bias[n] + x_scale[m] * scale[n] * (xq[m] . q[n]). A row of x holding NaN or an
// infinity gives NaN.
void linear_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x, const at::Tensor& w);

// The row-panel layout of a float32 weight W [N, K] for products with one row (an encoder's recurrent matrices at
// batch 1): panels [ceil(N / kPanelWidth), K, kPanelWidth] with panels[p, k, j] = W[p * kPanelWidth + j, k] (zeros
// past N); made once by dtmt_kernels/ops/linear/panels.py (row_panels), the reference. out [1, N] = x [1, K] W^T +
// bias with CpuKernels::row_panels (each output summed in k order; the panels split among threads); is_row_panels
// says whether `panels` is such a layout for N outputs and K inputs.
bool is_row_panels(const at::Tensor& panels, int64_t N, int64_t K);
void row_panels_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x, const at::Tensor& panels);

// The op exposed to Python: a new [M, N] tensor (x must be 2-D).
at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

}  // namespace dtmt
