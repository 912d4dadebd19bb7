// The small-row linear kernel (see small_gemm.h for why): the checks, the fallback to ATen's GEMM and the split of
// the output columns among threads. The loop is in csrc/isa/small_gemm_rows.cpp (the copy for this CPU's
// instruction set, cpu_dispatch.h): each weight row is read once, in address order, for all M rows of x. Each
// output element is written by one thread and summed in a fixed order, so results do not depend on the thread
// count.
#include "small_gemm.h"

#include <ATen/Parallel.h>

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

void linear_into(at::Tensor& out, const at::Tensor& bias, const at::Tensor& x, const at::Tensor& w) {
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
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dtmt._C.small_rows_linear: x [M, K] and "
              "w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && (!bias.defined() || bias.device().is_cpu()),
              "dtmt._C.small_rows_linear takes CPU tensors");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_into(out, bias, x, w.is_contiguous() ? w : w.contiguous());
  return out;
}

}  // namespace dtmt
