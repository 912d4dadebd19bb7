// C++ CPU kernel of the label-smoothed cross-entropy of a training update (paper 000's label smoothing, contract §4):
// for each row of logits z [V] with target y (rows whose target is ignore_index are left out),
//
//   log p_j = z_j - log sum_k exp(z_k)
//   nll     = -log p_y
//   loss    = (1 - eps) * nll + eps * (-mean_j log p_j)
//   dloss/dz_j = p_j - eps / V - (1 - eps) [j = y]
//
// and returns the sums of loss and NLL over the rows with the gradient of the loss sum, formed in the forward:
// the backward only scales it by the incoming gradient. Per row that is one read of the logits from memory and
// one write of the gradient (the row's other passes hit the cache), where eager PyTorch runs log_softmax, the
// mean, exp, subtract and multiply as passes of their own over the whole [N, V] tensor. The rows' sums are added
// in row order in double, so the results do not depend on the number of threads.
//
// The row loop is in csrc/isa/loss_rows.cpp (the copy for this CPU's instruction set, cpu_dispatch.h).
#include "loss.h"

#include <ATen/Parallel.h>

#include "cpu_dispatch.h"

namespace dtmt {

std::vector<at::Tensor> smoothed_cross_entropy_cpu(const at::Tensor& logits, const at::Tensor& target,
                                                   double smoothing, int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 2 && target.dim() == 1 && target.size(0) == logits.size(0) && logits.size(1) > 0,
              "dtmt._C: smoothed_cross_entropy takes logits [N, V] and target [N]");
  TORCH_CHECK(logits.device().is_cpu() && target.device().is_cpu() && logits.is_contiguous() &&
                  target.is_contiguous() && target.scalar_type() == at::kLong,
              "dtmt._C: smoothed_cross_entropy takes contiguous CPU tensors, the target int64");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
              "dtmt._C: smoothed_cross_entropy takes float32 or float64 logits");
  TORCH_CHECK(smoothing >= 0 && smoothing < 1,   // (NaN fails this too)
              "dtmt._C: smoothed_cross_entropy takes 0 <= smoothing < 1, got ", smoothing);
  const int64_t N = logits.size(0), V = logits.size(1);
  const int64_t* y = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(y[r] == ignore_index || (y[r] >= 0 && y[r] < V), "dtmt._C: smoothed_cross_entropy: target ", y[r],
                " is outside [0, ", V, ")");
  at::Tensor grad = at::empty_like(logits);
  std::vector<double> loss(N), nll(N);
  // at least ~64 K logits per task
  const int64_t grain = std::max<int64_t>(1, 65536 / V);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "dtmt_smoothed_cross_entropy", [&] {
    const auto rows = typed_cpu_kernels<scalar_t>().smoothed_ce_rows;
    const scalar_t* z = logits.data_ptr<scalar_t>();
    scalar_t* g = grad.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
      rows(z, y, V, ignore_index, scalar_t(smoothing), g, loss.data(), nll.data(), r0, r1);
    });
  });
  double loss_sum = 0, nll_sum = 0;
  for (int64_t r = 0; r < N; ++r) {
    loss_sum += loss[r];
    nll_sum += nll[r];
  }
  const auto opts = logits.options();
  return {at::scalar_tensor(loss_sum, opts), at::scalar_tensor(nll_sum, opts), grad};
}

}  // namespace dtmt
