// The small-row linear kernel (see small_gemm.h for why): the checks, the fallback to ATen's GEMM and the split of
// the output columns among threads. The loop is in csrc/isa/small_gemm_rows.cpp (the copy for this CPU's
// instruction set, cpu_dispatch.h): each weight row is read once, in address order, for all M rows of x. Each
// output element is written by one thread and summed in a fixed order, so results do not depend on the thread
// count.
#include "small_gemm.h"

#include <ATen/Parallel.h>

#include <cstring>

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

// rows [n0, n1) of an int8 weight (rows ldw bytes apart) as floats scale * q, into out [n1 - n0, K]
void dequantize_int8_rows(const int8_t* w, int64_t K, int64_t ldw, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * ldw;
    float scale;
    std::memcpy(&scale, row + K, sizeof scale);
    float* o = out + (n - n0) * K;
    for (int64_t k = 0; k < K; ++k) o[k] = scale * static_cast<float>(row[k]);
  }
}

void linear_int8_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x_in, const at::Tensor& w) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) > kInt8RowTail,
              "dtmt: an int8 weight is a contiguous int8 [N, K + 4] tensor (K values and a float32 scale a row), "
              "got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1) - kInt8RowTail;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && out.dim() == 2 && out.size(0) == x_in.size(0) &&
                  out.size(1) == N,
              "dtmt: int8 weight rows of ", K, " values take x [M, ", K, "], got x ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  (!has_bias || bias.scalar_type() == at::kFloat),
              "dtmt: int8 weights multiply float32 activations, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu() &&
                  (!has_bias || bias.device().is_cpu()),
              "dtmt: int8 weights are for the CPU");
  TORCH_CHECK(!has_bias || (bias.dim() == 1 && bias.size(0) == N),
              "dtmt: the bias of an int8 weight of ", N, " rows must be [", N, "], got ", bias.sizes());
  const at::Tensor x = K > 1 && x_in.stride(1) != 1 ? x_in.contiguous() : x_in;
  const at::Tensor b = has_bias ? bias.contiguous() : at::Tensor();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t ldw = K + kInt8RowTail;
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return;
  if (M <= kSmallRowsMax && (N == 1 || out.stride(1) == 1)) {
    const auto loop = cpu_kernels().small_rows_int8;
    const float* xp = x.data_ptr<float>();
    const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    const int64_t ldx = x.stride(0), ldo = out.stride(0);
    // at least 64 KiB of int8 weights per task (the float kernel's grain in rows: the same arithmetic per task)
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(K, 1));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      loop(static_cast<int>(M), xp, ldx, wp, K, ldw, bp, op, ldo, n0, n1);
    });
    return;
  }
  // More rows: the weights are reused across them, so GEMM it is, over blocks of rows dequantized into a buffer
  // that stays in cache (~512 KiB).
  const int64_t block = std::min<int64_t>(N, std::max<int64_t>(16, (128 * 1024) / std::max<int64_t>(K, 1)));
  at::Tensor wf = at::empty({block, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += block) {
    const int64_t nb = std::min(block, N - n0);
    at::Tensor wb = wf.narrow(0, 0, nb);
    float* wbp = wb.data_ptr<float>();
    at::parallel_for(n0, n0 + nb, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t a, int64_t z) {
      dequantize_int8_rows(wp, K, ldw, a, z, wbp + (a - n0) * K);
    });
    at::Tensor o = out.narrow(1, n0, nb);
    if (has_bias) {
      at::addmm_out(o, b.narrow(0, n0, nb), x, wb.t());
    } else {
      at::mm_out(o, x, wb.t());
    }
  }
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
    // at least 256 KiB of weights per task: smaller tasks run on one thread (a second thread's start-up would
    // outweigh them)
    const int64_t grain = std::max<int64_t>(1, (256 * 1024 / 4) / std::max<int64_t>(K, 1));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { loop(M, xp, ldx, wp, K, bp, op, ldo, n0, n1); });
    return;
  }
  if (has_bias) {
    at::addmm_out(out, bias, x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == weight_in_features(w), "dtmt._C.small_rows_linear: x "
              "[M, K] and w [N, K] (or int8 rows [N, K + 4]) expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && (!bias.defined() || bias.device().is_cpu()),
              "dtmt._C.small_rows_linear takes CPU tensors");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_into(out, bias, x, w.is_contiguous() ? w : w.contiguous());
  return out;
}

}  // namespace dtmt
