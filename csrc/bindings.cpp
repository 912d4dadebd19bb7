// pybind11 module dtmt_kernels._C: thin wrappers that check devices and dispatch to the CPU (and, when
// built with CUDA, the GPU) implementations. Shapes and dtypes are validated in Python
// (dtmt_kernels/functional.py); the TORCH_CHECKs here only guard against misuse of the raw op.
#include <torch/extension.h>

#include "attention.h"
#include "cell_math.h"
#include "cpu_dispatch.h"
#include "decode_step.h"
#include "small_gemm.h"
#include "transition.h"

#ifdef DTMT_WITH_CUDA
namespace dtmt {  // csrc/transition_cuda.cu
std::vector<at::Tensor> transition_forward_cuda(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& mask,
                                                const at::Tensor& drop, const TransitionWeights& w, bool reverse,
                                                double eps);
std::vector<at::Tensor> transition_backward_cuda(const at::Tensor& grad_out, const at::Tensor& grad_hn,
                                                 const at::Tensor& x, const at::Tensor& mask, const at::Tensor& drop,
                                                 const TransitionWeights& w, const at::Tensor& xp,
                                                 const at::Tensor& hs, const at::Tensor& hs_lp, const at::Tensor& hp,
                                                 const at::Tensor& hpt, bool reverse, double eps);
}  // namespace dtmt
#endif

namespace {

using at::Tensor;

dtmt::TransitionWeights make_weights(int64_t kind, const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh,
                                     const Tensor& b_hh, const Tensor& ln_w, const Tensor& ln_b, const Tensor& t_w,
                                     const Tensor& t_b, const Tensor& t_ln_w, const Tensor& t_ln_b) {
  return dtmt::TransitionWeights{kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b};
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(!t.defined() || t.numel() == 0 || (t.device().is_cpu() && t.is_contiguous()), "dtmt._C: ", name,
              " must be a contiguous CPU tensor");
}

std::vector<Tensor> transition_forward(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                       int64_t kind, const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh,
                                       const Tensor& b_hh, const Tensor& ln_w, const Tensor& ln_b,
                                       const Tensor& t_w, const Tensor& t_b, const Tensor& t_ln_w,
                                       const Tensor& t_ln_b, bool reverse, double eps) {
  for (auto& p : {std::make_pair(&x, "x"), {&h0, "h0"}, {&mask, "mask"}, {&drop, "drop"}, {&w_ih, "w_ih"},
                  {&b_ih, "b_ih"}, {&w_hh, "w_hh"}, {&b_hh, "b_hh"}, {&ln_w, "ln_w"}, {&ln_b, "ln_b"},
                  {&t_w, "t_w"}, {&t_b, "t_b"}, {&t_ln_w, "t_ln_w"}, {&t_ln_b, "t_ln_b"}})
    check_cpu(*p.first, p.second);
  auto w = make_weights(kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
  return dtmt::transition_forward_cpu(x, h0, mask, drop, w, reverse, eps);
}

std::vector<Tensor> transition_backward(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                        const Tensor& mask, const Tensor& drop, int64_t kind, const Tensor& w_ih,
                                        const Tensor& b_ih, const Tensor& w_hh, const Tensor& b_hh,
                                        const Tensor& ln_w, const Tensor& ln_b, const Tensor& t_w,
                                        const Tensor& t_b, const Tensor& t_ln_w, const Tensor& t_ln_b,
                                        const Tensor& xp, const Tensor& hs, const Tensor& hp, const Tensor& hpt,
                                        bool reverse, double eps, bool weight_grads) {
  for (auto& p : {std::make_pair(&grad_out, "grad_out"), {&grad_hn, "grad_hn"}, {&xp, "xp"}, {&hs, "hs"},
                  {&hp, "hp"}, {&hpt, "hpt"}})
    check_cpu(*p.first, p.second);
  auto w = make_weights(kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
  return dtmt::transition_backward_cpu(grad_out, grad_hn, x, mask, drop, w, xp, hs, hp, hpt, reverse, eps,
                                       weight_grads);
}

#ifdef DTMT_WITH_CUDA
void check_cuda(const Tensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK(!t.defined() || t.numel() == 0 || (t.device() == x.device() && t.is_contiguous()), "dtmt._C: ", name,
              " must be a contiguous tensor on ", x.device());
}

std::vector<Tensor> transition_forward_cuda(const Tensor& x, const Tensor& h0, const Tensor& mask, const Tensor& drop,
                                            int64_t kind, const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh,
                                            const Tensor& b_hh, const Tensor& ln_w, const Tensor& ln_b,
                                            const Tensor& t_w, const Tensor& t_b, const Tensor& t_ln_w,
                                            const Tensor& t_ln_b, bool reverse, double eps) {
  TORCH_CHECK(x.is_cuda(), "dtmt._C: transition_forward_cuda takes CUDA tensors");
  for (auto& p : {std::make_pair(&x, "x"), {&h0, "h0"}, {&mask, "mask"}, {&drop, "drop"}, {&w_ih, "w_ih"},
                  {&b_ih, "b_ih"}, {&w_hh, "w_hh"}, {&b_hh, "b_hh"}, {&ln_w, "ln_w"}, {&ln_b, "ln_b"},
                  {&t_w, "t_w"}, {&t_b, "t_b"}, {&t_ln_w, "t_ln_w"}, {&t_ln_b, "t_ln_b"}})
    check_cuda(*p.first, x, p.second);
  auto w = make_weights(kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
  return dtmt::transition_forward_cuda(x, h0, mask, drop, w, reverse, eps);
}

std::vector<Tensor> transition_backward_cuda(const Tensor& grad_out, const Tensor& grad_hn, const Tensor& x,
                                             const Tensor& mask, const Tensor& drop, int64_t kind,
                                             const Tensor& w_ih, const Tensor& b_ih, const Tensor& w_hh,
                                             const Tensor& b_hh, const Tensor& ln_w, const Tensor& ln_b,
                                             const Tensor& t_w, const Tensor& t_b, const Tensor& t_ln_w,
                                             const Tensor& t_ln_b, const Tensor& xp, const Tensor& hs,
                                             const Tensor& hs_lp, const Tensor& hp, const Tensor& hpt, bool reverse,
                                             double eps) {
  for (auto& p : {std::make_pair(&grad_out, "grad_out"), {&grad_hn, "grad_hn"}, {&xp, "xp"}, {&hs, "hs"},
                  {&hs_lp, "hs_lp"}, {&hp, "hp"}, {&hpt, "hpt"}})
    check_cuda(*p.first, x, p.second);
  auto w = make_weights(kind, w_ih, b_ih, w_hh, b_hh, ln_w, ln_b, t_w, t_b, t_ln_w, t_ln_b);
  return dtmt::transition_backward_cuda(grad_out, grad_hn, x, mask, drop, w, xp, hs, hs_lp, hp, hpt, reverse, eps);
}
#endif  // DTMT_WITH_CUDA

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dtmt fused kernels (deep transition block, ATR, additive attention scores and context)";
  m.attr("KIND_GRU") = static_cast<int>(dtmt::kGRU);
  m.attr("KIND_LGRU") = static_cast<int>(dtmt::kLGRU);
  m.attr("KIND_LAU") = static_cast<int>(dtmt::kLAU);
  m.attr("KIND_ATR") = static_cast<int>(dtmt::kATR);
  m.def("transition_forward", &transition_forward,
        "Deep transition / ATR forward over a sequence; returns [out, h_n, xp, hs, hp, hpt]");
  m.def("transition_backward", &transition_backward,
        "Deep transition / ATR backward; returns gradients [dx, dh0, dw_ih, db_ih, dw_hh, db_hh, dln_w, dln_b, "
        "dt_w, dt_b, dt_ln_w, dt_ln_b]; with weight_grads=False the pre-activation gradients dxp, dhp and dhpt "
        "stand in the slots of dw_ih, dw_hh and dt_w, and the bias slots are None (csrc/transition.h)",
        py::arg("grad_out"), py::arg("grad_hn"), py::arg("x"), py::arg("mask"), py::arg("drop"), py::arg("kind"),
        py::arg("w_ih"), py::arg("b_ih"), py::arg("w_hh"), py::arg("b_hh"), py::arg("ln_w"), py::arg("ln_b"),
        py::arg("t_w"), py::arg("t_b"), py::arg("t_ln_w"), py::arg("t_ln_b"), py::arg("xp"), py::arg("hs"),
        py::arg("hp"), py::arg("hpt"), py::arg("reverse"), py::arg("eps"), py::arg("weight_grads") = true);
  m.def("additive_scores_forward", &dtmt::additive_scores_forward_cpu,
        "Additive attention scores sum_d v[h,d] tanh(keys[b,s,h,d] + q[b,h,d]) -> [B, NH, S]");
  m.def("additive_scores_backward", &dtmt::additive_scores_backward_cpu,
        "Additive attention scores backward; returns [dkeys, dq, dv]");
  m.def("attention_context_forward", &dtmt::attention_context_forward_cpu,
        "Attention context sum_s alpha[b,h,s] values[b,s,h*Dc:(h+1)*Dc] -> [B, C]");
  m.def("attention_context_backward", &dtmt::attention_context_backward_cpu,
        "Attention context backward; returns [dalpha, dvalues] (dvalues empty when values_grad is false)",
        py::arg("grad"), py::arg("alpha"), py::arg("values"), py::arg("values_grad") = true);
  // the inference ops take their named weights (decode_step.h) as tensor lists in the fields' order
  m.def(
      "attention_step",
      [](const Tensor& query, const Tensor& keys, const Tensor& annotations, const Tensor& src_mask,
         const std::vector<Tensor>& weights, double ln_eps) {
        return dtmt::attention_step_cpu(query, keys, annotations, src_mask,
                                        dtmt::AttentionWeights::from_list(weights, ln_eps));
      },
      "Inference: one (multi-head) additive attention step, query projection to output projection; returns "
      "[context, alpha]",
      py::arg("query"), py::arg("keys"), py::arg("annotations"), py::arg("src_mask"), py::arg("weights"),
      py::arg("ln_eps"));
  m.def(
      "readout_features",
      [](const Tensor& y, const Tensor& s, const Tensor& c, const std::vector<Tensor>& weights, double eps) {
        return dtmt::readout_features_cpu(y, s, c, dtmt::ReadoutWeights::from_list(weights, eps));
      },
      "Inference: tanh(LN(y W_y^T + b_y) + LN(s W_s^T + b_s) + LN(c W_c^T + b_c)) in one call",
      py::arg("y"), py::arg("s"), py::arg("c"), py::arg("weights"), py::arg("eps"));
  m.def(
      "rnmt_step",
      [](const Tensor& y, const Tensor& s, const Tensor& keys, const Tensor& annotations, const Tensor& src_mask,
         int64_t q_kind, const std::vector<Tensor>& q_params, int64_t d_kind, const std::vector<Tensor>& d_params,
         double cell_eps, const std::vector<Tensor>& attention, double att_eps, const std::vector<Tensor>& readout,
         double readout_eps) {
        return dtmt::rnmt_step_cpu(y, s, keys, annotations, src_mask, dtmt::cell_weights(q_kind, q_params),
                                   dtmt::cell_weights(d_kind, d_params), cell_eps,
                                   dtmt::AttentionWeights::from_list(attention, att_eps),
                                   dtmt::ReadoutWeights::from_list(readout, readout_eps));
      },
      "Inference: one attentional RNMT decoder step (query cell, attention, decoder cell, readout, log-softmax); "
      "returns [log_probs, s, alpha averaged over the heads [B, S]]",
      py::arg("y"), py::arg("s"), py::arg("keys"), py::arg("annotations"), py::arg("src_mask"), py::arg("q_kind"),
      py::arg("q_params"), py::arg("d_kind"), py::arg("d_params"), py::arg("cell_eps"), py::arg("attention"),
      py::arg("att_eps"), py::arg("readout"), py::arg("readout_eps"));
  m.def(
      "memory_encoder",
      [](const Tensor& x, const Tensor& memory, const Tensor& src_mask, bool reverse, int64_t cell_kind,
         const std::vector<Tensor>& cell, double cell_eps, const std::vector<Tensor>& addressing) {
        return dtmt::memory_encoder_cpu(x, memory, src_mask, reverse, dtmt::cell_weights(cell_kind, cell), cell_eps,
                                        dtmt::MemoryWeights::from_list(addressing));
      },
      "Inference: one direction of mce's read-write-memory GRU encoder over the whole source; returns "
      "[states, memory]",
      py::arg("x"), py::arg("memory"), py::arg("src_mask"), py::arg("reverse"), py::arg("cell_kind"),
      py::arg("cell"), py::arg("cell_eps"), py::arg("addressing"));
  m.attr("ATTENTION_WEIGHT_FIELDS") = std::string(dtmt::kAttentionWeightFields);
  m.attr("READOUT_WEIGHT_FIELDS") = std::string(dtmt::kReadoutWeightFields);
  m.attr("MEMORY_WEIGHT_FIELDS") = std::string(dtmt::kMemoryWeightFields);
  m.def("small_rows_linear", &dtmt::small_rows_linear,
        "x [M, K] @ w[N, K]^T + bias: the weight-streaming kernel for M <= SMALL_ROWS_MAX float32 rows, ATen's "
        "GEMM otherwise");
  m.attr("SMALL_ROWS_MAX") = dtmt::kSmallRowsMax;
  m.def("cpu_isa", [] { return std::string(dtmt::cpu_kernels().isa); },
        "The instruction set whose copy of the CPU loops runs (csrc/cpu_dispatch.h): 'avx512', 'avx2', 'baseline' "
        "or 'native'");
  m.def("compiled_cpu_isas", &dtmt::compiled_cpu_isas, "The instruction sets compiled in, best first");
  m.def("supported_cpu_isas", &dtmt::supported_cpu_isas, "Those of them this machine can run, best first");
  m.def("set_cpu_isa", &dtmt::set_cpu_isa, py::arg("name"),
        "Run the copy of the CPU loops for `name` from now on (tests, benchmarks); ValueError when this build or "
        "machine has none. The environment variable DTMT_CPU_ISA does the same when the module loads.");
  if (!dtmt::cpu_isa_environment_note().empty() &&
      PyErr_WarnEx(PyExc_RuntimeWarning, dtmt::cpu_isa_environment_note().c_str(), 1) != 0)
    throw py::error_already_set();
#ifdef DTMT_WITH_CUDA
  m.def("transition_forward_cuda", &transition_forward_cuda,
        "CUDA deep transition / ATR forward; returns [out, h_n, xp, hs, hs_lp, hp, hpt] (hs_lp empty for "
        "float32/float64)");
  m.def("transition_backward_cuda", &transition_backward_cuda,
        "CUDA deep transition / ATR backward; same gradients as transition_backward");
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
