// Declarations of the fused recurrent ops (deep transition block and ATR), shared by their registration
// (registration.cpp) and the device-specific implementations. See transition_cpu.cpp for the algorithm and the
// saved tensors.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "step_scratch.h"

namespace dtmt {

// Parameters of one direction of a deep transition block: the base cell (GRU / L-GRU / LAU / ATR) and
// `depth` stacked T-GRUs. Biases are full width (one entry per row of the weight); with layer norm the
// gate rows of the biases are zero and ln_w / ln_b hold the per-gate gains and offsets. Empty tensors
// stand for "absent" (no layer norm, depth 0, no candidate dropout, no mask).
struct TransitionWeights {
  int64_t kind;
  at::Tensor w_ih, b_ih, w_hh, b_hh, ln_w, ln_b;  // base cell
  at::Tensor t_w, t_b, t_ln_w, t_ln_b;            // T-GRUs: [D,3H,H], [D,3H], [D,2H], [D,2H]
  // t_w[k] and t_b[k] as tensors of their own, made once for a decoder's steps (with_tgru_slices, which cell_weights
  // applies; a step slicing them itself would run a dispatched op each, its code pushed out of the caches by the
  // step's weight stream); the cell steps need them, the sequence kernels do not read them
  std::vector<at::Tensor> t_w_k, t_b_k;
  // w_hh and the T-GRUs' t_w in the row-panel layout (small_gemm.h; [P, H, kPanelWidth] and [D, P', H,
  // kPanelWidth]), or empty: transition_encode's products at batch 1 read them instead (float32 weights only)
  at::Tensor w_hh_panels, t_w_panels;
};

// The backward's inputs besides the weights: the gradients reaching the forward's outputs (grad_out [T,B,H],
// grad_hn [B,H]) and the forward's own inputs (x, and mask and drop, empty where absent).
struct BackwardInputs {
  at::Tensor grad_out, grad_hn, x, mask, drop;
};

// What the forward keeps for the backward: its outputs after out and h_n (see transition_forward_cpu).
struct SavedForward {
  at::Tensor xp, hs, hs_lp, hp, hpt;
};

// w with t_w_k / t_b_k filled.
TransitionWeights with_tgru_slices(TransitionWeights w);

// Forward over a whole sequence. x [T,B,I], h0 [B,H], mask [T,B] (1 valid, 0 padded) or empty,
// drop [D+1,B,H] candidate-dropout multipliers or empty.
// Inputs in one dtype (float, double, bfloat16, half), except h0, which may also be in the accumulation dtype
// (float for 16-bit inputs: the state kept in float between calls); h_n comes back in h0's dtype.
// Returns {out [T,B,H], h_n [B,H], xp, hs, hs_lp, hp, hpt}: the last five are saved for backward. hs is in the
// accumulation dtype (double for double, else float), hs_lp the same states in the input dtype for 16-bit
// inputs (empty otherwise); xp, hp, hpt and out are in the input dtype.
std::vector<at::Tensor> transition_forward_cpu(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& mask,
                                               const at::Tensor& drop, const TransitionWeights& w, bool reverse,
                                               double eps);

// One step of a cell (inference) from its input products xp = x W_ih^T + b_ih [B, n_in*H] (contiguous, float or
// double) instead of x: the new state [B, H], as transition_forward_cpu's h_n over that one step. scratch: where its
// tensors come from (a search's StepScratch), or nullptr: new ones.
at::Tensor cell_step_from_products_cpu(const at::Tensor& xp, const at::Tensor& h, const TransitionWeights& w,
                                      double eps, StepScratch* scratch = nullptr);

// One step of a cell for decoding: the new state [B, H] from x [B, I] and h [B, H], as transition_forward_cpu's h_n
// over that one unmasked step (the same arithmetic), without the tensors it keeps for training.
at::Tensor cell_step_cpu(const at::Tensor& x, const at::Tensor& h, const TransitionWeights& w, double eps,
                         StepScratch* scratch = nullptr);

// Inference over both directions of a layer at once (FrozenTransitionLayer): x [T,B,I], h0 [D,B,H], mask [T,B] or
// empty, dirs: D = 1 or 2 directions' weights; direction d reads right to left when d == 1 or `reverse`. At batch 1
// a float32 direction whose weights carry row panels (w_hh_panels, t_w_panels) multiplies its states by those: the
// same products summed in another order (k by k), so the same outputs up to rounding. Returns
// {out [T,B,D*H] (direction d in features d*H..), h_n [D,B,H]}, each direction as transition_forward_cpu computes it
// (float / double: the same arithmetic without the sequence tensors it keeps for backward, one step's rows reused).
// With two directions on two threads (and not already inside a parallel region) each direction runs on a thread of
// its own, its products and row passes on that thread alone: at batch 1 a step's work is too small to share.
std::vector<at::Tensor> transition_encode_cpu(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& mask,
                                              const std::vector<TransitionWeights>& dirs, bool reverse, double eps);

// transition_encode_cpu with each position's input products read from tables instead of computed from x: tokens
// [T, B] (int64), table [V, D * n_in*H] (row v: token v's products with every direction's w_ih, no bias; direction d
// in columns d*n_in*H..), position_table [>= T, D * n_in*H] (position t's products, added to its tokens' rows) or
// empty; position t of sentence b reads table[tokens[t, b]] + position_table[t] + b_ih. Float or double tables, h0 of
// their dtype; a token outside the table is an error. Where the table holds the products of the embedding that x
// would be (and position_table those of the positions added to it), the same outputs up to rounding.
std::vector<at::Tensor> transition_encode_tokens_cpu(const at::Tensor& tokens, const at::Tensor& table,
                                                     const at::Tensor& position_table, const at::Tensor& h0,
                                                     const at::Tensor& mask, const std::vector<TransitionWeights>& dirs,
                                                     bool reverse, double eps);

// Backward (dh0 in grad_hn's dtype, the rest in the input dtype). Returns {dx, dh0, dw_ih, db_ih, dw_hh, db_hh, dln_w, dln_b, dt_w, dt_b, dt_ln_w, dt_ln_b};
// gradients of absent tensors are empty. With weight_grads false the weight and bias gradients are not formed:
// their slots hold the pre-activation gradients they are made of instead, {dx, dh0, dxp [T*B, n_in*H], -,
// dhp [T*B, n_h*H], -, dln_w, dln_b, dhpt [D, T*B, 3H], -, dt_ln_w, dt_ln_b} (dW_ih = dxp^T x, db_ih = the column
// sums of dxp, dW_hh = dhp^T hs[0], dt_w[k] = dhpt[k]^T hs[k+1]), for a caller that runs a cell one step per
// call and forms the weight gradients of all its steps in one GEMM each (dtmt_kernels.nn.unrolled).
std::vector<at::Tensor> transition_backward_cpu(const BackwardInputs& in, const TransitionWeights& w,
                                                const SavedForward& saved, bool reverse, double eps,
                                                bool weight_grads = true);

// The CUDA kernels (csrc/transition_cuda.cu, built with a CUDA torch): the same contract, weight_grads=false
// included.
std::vector<at::Tensor> transition_forward_cuda(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& mask,
                                                const at::Tensor& drop, const TransitionWeights& w, bool reverse,
                                                double eps);
std::vector<at::Tensor> transition_backward_cuda(const BackwardInputs& in, const TransitionWeights& w,
                                                 const SavedForward& saved, bool reverse, double eps,
                                                 bool weight_grads = true);

// How many of this process's cuda-backend forwards and backwards ran as persistent launches, in the grid form, in
// the cluster form and in the grid form's clusters sharing the stage (multicast), and how many persistent launches
// the device refused (the grid form or the per-step path ran instead); of those that ran, how many had their products
// on tensor cores; and how many ran the per-step path although DTMT_CUDA_RECURRENCE asked for the persistent launches
// (`steps`: the layer past the plan or refused; csrc/transition_cuda.cu): which form and products ran, for the GPU
// tests and benchmarks/bench_persistent.py.
struct PersistentLaunchCounts {
  int64_t grid = 0, cluster = 0, refused = 0, multicast = 0, tensor_cores = 0, steps = 0;
};
PersistentLaunchCounts persistent_launch_counts();

// The epilogue of every backward (CPU and CUDA): the weight and bias gradients of one direction from its
// pre-activation gradients over N = T*B rows, dW_ih = dxp^T x, db_ih = dxp's column sums, dW_hh = dhp^T states[0],
// db_hh, dt_w[k] = dhpt[k]^T states[k+1], dt_b[k]. x [N, I] and states [D+1, N, H] (the state entering each
// sub-cell) in the GEMMs' dtype, dxp [N, n_in*H], dhp [N, n_h*H], dhpt [D, N, 3H]; the column sums accumulate in
// `acc`. Returns {dw_ih, db_ih, dw_hh, db_hh, dt_w, dt_b}. (Python's twin: dtmt_kernels/ops/transition/grads.py.)
inline std::vector<at::Tensor> transition_weight_grads(const at::Tensor& x, const at::Tensor& states,
                                                       const at::Tensor& dxp, const at::Tensor& dhp,
                                                       const at::Tensor& dhpt, at::ScalarType acc) {
  const auto st = dxp.scalar_type();
  const std::vector<int64_t> rows{0}, steps{1};
  const int64_t D = dhpt.size(0);
  return {dxp.t().mm(x),
          dxp.sum(rows, false, acc).to(st),
          dhp.t().mm(states[0]),
          dhp.sum(rows, false, acc).to(st),
          at::bmm(dhpt.transpose(1, 2), states.narrow(0, 1, D)),
          dhpt.sum(steps, false, acc).to(st)};
}

}  // namespace dtmt
