// The small-row linear kernel (see small_gemm.h for why): the checks, the fallback to ATen's GEMM and the split of
// the output columns among threads. The loop is in csrc/isa/small_gemm_rows.cpp (the copy for this CPU's
// instruction set, cpu_dispatch.h): each weight row is read once, in address order, for all M rows of x. Each
// output element is written by one thread and summed in a fixed order, so results do not depend on the thread
// count.
#include "small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_dispatch.h"

namespace dtmt {

bool small_rows_applicable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& out) {
  const auto f32 = at::kFloat;
  if (x.dim() != 2 || w.dim() != 2 || out.dim() != 2) return false;
  if (!x.device().is_cpu() || !w.device().is_cpu() || !out.device().is_cpu() || x.scalar_type() != f32 ||
      w.scalar_type() != f32 || out.scalar_type() != f32)
    return false;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M < 1 || M > kSmallRowsMax || w.size(1) != K || out.size(0) != M || out.size(1) != N) return false;
  if ((K > 1 && x.stride(1) != 1) || !w.is_contiguous() || (N > 1 && out.stride(1) != 1)) return false;
  if (bias.defined() && bias.numel() > 0 &&
      (!bias.device().is_cpu() || bias.scalar_type() != f32 || bias.dim() != 1 || bias.size(0) != N ||
       !bias.is_contiguous()))
    return false;
  return true;
}

namespace {

void linear_int8_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x_in, const at::Tensor& w) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) > kInt8RowTail,
              "dtmt: an int8 weight is a contiguous int8 [N, K + 4] tensor (K values and a float32 scale a row), "
              "got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1) - kInt8RowTail;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && out.dim() == 2 && out.size(0) == x_in.size(0) &&
                  out.size(1) == N,
              "dtmt: int8 weight rows of ", K, " values take x [M, ", K, "], got x ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "dtmt: int8 weights multiply float32 activations, got x ", x_in.scalar_type());
  TORCH_CHECK(!has_bias || bias.scalar_type() == at::kFloat,
              "dtmt: the bias of an int8 weight is float32, got ", bias.scalar_type());
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu() &&
                  (!has_bias || bias.device().is_cpu()),
              "dtmt: int8 weights are for the CPU");
  TORCH_CHECK(!has_bias || (bias.dim() == 1 && bias.size(0) == N),
              "dtmt: the bias of an int8 weight of ", N, " rows must be [", N, "], got ", bias.sizes());
  // (a crafted weight of -128 against an activation of 127: 128 * 127 a product, so 132,104 values a row at most)
  TORCH_CHECK(K <= (int64_t{1} << 31) / (128 * 127), "dtmt: int8 rows of ", K, " values would overflow int32 sums");
  const int64_t M = x_in.size(0);
  if (M == 0 || N == 0) return;
  const at::Tensor x = K > 1 && x_in.stride(1) != 1 ? x_in.contiguous() : x_in;
  const at::Tensor b = has_bias ? bias.contiguous() : at::Tensor();
  // every row of x quantized once, for all the weight rows (buffers kept per thread: no allocation per call)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> x_scale;
  thread_local std::vector<char> finite;
  xq.resize(static_cast<size_t>(M * K));
  x_scale.resize(static_cast<size_t>(M));
  finite.resize(static_cast<size_t>(M));
  const CpuKernels& kernels = cpu_kernels();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  // the output through a contiguous buffer unless it is one already (out may be a strided view)
  const bool direct = out.is_contiguous();
  at::Tensor dst = direct ? out : at::empty({M, N}, out.options());
  float* op = dst.data_ptr<float>();
  // (plain pointers into this thread's buffers: inside a lambda, on a worker thread, the names would be its own)
  int8_t* xqp = xq.data();
  float* xsp = x_scale.data();
  char* fp = finite.data();
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t panel_rows = kernels.int8_panel_rows();
  if (panel_rows > 0 && M >= panel_rows) {
    // many rows: quantized and packed a tile of rows at a time, then each thread multiplies the whole panel by
    // its blocks of weight rows (int8_panel)
    constexpr int64_t kTile = kInt8PanelRows, kColumns = kInt8PanelColumns;
    const int64_t tiles = (M + kTile - 1) / kTile, tile_bytes = (K + 3) / 4 * 64;
    thread_local std::vector<uint8_t> panel;
    panel.resize(static_cast<size_t>(tiles * tile_bytes));
    uint8_t* pp = panel.data();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t r0 = t0 * kTile, r1 = std::min(M, t1 * kTile);
      kernels.quantize_activations_int8(r1 - r0, xp + r0 * ldx, ldx, K, xqp + r0 * K, xsp + r0, fp + r0);
      kernels.pack_int8_panel(M, xqp, fp, K, pp, t0, t1);
    });
    at::parallel_for(0, (N + kColumns - 1) / kColumns, 1, [&](int64_t c0, int64_t c1) {
      kernels.int8_panel(pp, M, K, xsp, wp, K + kInt8RowTail, bp, op, N, c0 * kColumns,
                         std::min(N, c1 * kColumns));
    });
  } else {
    kernels.quantize_activations_int8(M, xp, ldx, K, xqp, xsp, fp);
    const auto loop = kernels.small_rows_int8;
    // Tasks of at least 64 KiB of int8 weight rows (smaller ones run on one thread). A task runs its weight rows
    // against each group of up to kSmallRowsMax rows of x (the loop's registers) in turn: after the first group
    // they are read from the core's cache.
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(K, 1));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t m0 = 0; m0 < M; m0 += kSmallRowsMax) {
        const int rows = static_cast<int>(std::min(kSmallRowsMax, M - m0));
        loop(rows, xqp + m0 * K, K, xsp + m0, wp, K, K + kInt8RowTail, bp, op + m0 * N, N, n0, n1);
      }
    });
  }
  for (int64_t m = 0; m < M; ++m)   // a row with NaN or infinity: NaN out, as a float product would give
    if (!finite[m]) dst[m].fill_(std::numeric_limits<float>::quiet_NaN());
  if (!direct) out.copy_(dst);
}

}  // namespace

void linear_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x, const at::Tensor& w) {
  if (is_int8_rows(w)) return linear_int8_into(out, bias, x, w);
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (small_rows_applicable(x, w, bias, out)) {
    const auto loop = cpu_kernels().small_rows;
    const int M = static_cast<int>(x.size(0));
    const int64_t N = w.size(0), K = x.size(1), ldx = x.stride(0), ldo = out.stride(0);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    // at least 64 KiB of weights per task: smaller tasks run on one thread (a second thread's start-up would
    // outweigh them; docs/design/cpu_kernels.md, "Streaming the weights", for the size)
    const int64_t grain = std::max<int64_t>(1, (64 * 1024 / 4) / std::max<int64_t>(K, 1));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { loop(M, xp, ldx, wp, K, bp, op, ldo, n0, n1); });
    return;
  }
  if (has_bias) {
    at::addmm_out(out, bias, x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

bool is_row_panels(const at::Tensor& panels, int64_t N, int64_t K) {
  return panels.defined() && panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.device().is_cpu() &&
         panels.is_contiguous() && panels.size(0) == (N + kPanelWidth - 1) / kPanelWidth && panels.size(1) == K &&
         panels.size(2) == kPanelWidth;
}

void row_panels_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x, const at::Tensor& panels) {
  const int64_t N = out.size(1), K = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && out.dim() == 2 && out.size(0) == 1 && x.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat && (K <= 1 || x.stride(1) == 1) && (N <= 1 || out.stride(1) == 1),
              "dtmt: a row-panel product takes one float32 row x [1, K] into out [1, N], got ", x.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(is_row_panels(panels, N, K), "dtmt: row panels for ", N, " outputs of ", K, " inputs are a contiguous "
              "float32 [", (N + kPanelWidth - 1) / kPanelWidth, ", ", K, ", ", kPanelWidth, "] tensor, got ",
              panels.sizes());
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.dim() == 1 && bias.size(0) == N && bias.is_contiguous() &&
                            bias.scalar_type() == at::kFloat),
              "dtmt: the bias of a row-panel product must be a float32 [", N, "], got ", bias.sizes());
  const auto loop = cpu_kernels().row_panels;
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // a task of at least 64 KiB of panels, as linear_into's
  const int64_t grain = std::max<int64_t>(1, (64 * 1024 / 4) / std::max<int64_t>(K * kPanelWidth, 1));
  at::parallel_for(0, panels.size(0), grain, [&](int64_t p0, int64_t p1) { loop(xp, pp, K, bp, op, N, p0, p1); });
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == weight_in_features(w), "dtmt._C.small_rows_linear: x "
              "[M, K] and w [N, K] (or int8 rows [N, K + 4]) expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && (!bias.defined() || bias.device().is_cpu()),
              "dtmt._C.small_rows_linear takes CPU tensors");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == w.size(0)),
              "dtmt._C.small_rows_linear: bias [N = ", w.size(0), "] or none expected, got ", bias.sizes());
  if (!is_int8_rows(w)) {   // (ATen's "mat1 and mat2 must have the same dtype" named neither argument)
    TORCH_CHECK(at::isFloatingType(x.scalar_type()), "dtmt._C.small_rows_linear: x must be floating point, got ",
                x.scalar_type());
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), "dtmt._C.small_rows_linear: w is ", w.scalar_type(),
                " but x is ", x.scalar_type(), "; give them one dtype");
    TORCH_CHECK(!bias.defined() || bias.numel() == 0 || bias.scalar_type() == x.scalar_type(),
                "dtmt._C.small_rows_linear: bias is ", bias.scalar_type(), " but x is ", x.scalar_type(),
                "; give them one dtype");
  }
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_into(out, bias, x, w.is_contiguous() ? w : w.contiguous());
  return out;
}

}  // namespace dtmt
