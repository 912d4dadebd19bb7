// The inference engine's ops as PyTorch custom ops in the `dtmt` namespace (torch.ops.dtmt.*), with the conventions
// of csrc/registration.cpp (one schema each, CPU kernels, checks before any kernel reads a tensor; fresh results,
// absent results as empty tensors). Their fakes and the Python functions that call them are
// dtmt_models/engine/ops.py's; the kernels are decode_step_cpu.cpp and beam_search_cpu.cpp (decode_step.h).
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <utility>

#include "decode_step.h"
#include "op_args.h"
#include "op_checks.h"

namespace {

using at::Tensor;
using dtmt::args::dense;
using dtmt::args::given;
using dtmt::args::last_dim_dense;
using OptTensor = std::optional<Tensor>;

// The three epsilons of a decoder step (its cells', the attention's and the readout's layer norms).
void check_step_eps(const char* op, double cell_eps, double att_eps, double readout_eps) {
  for (const auto& [eps, name] : {std::pair<double, const char*>{cell_eps, "cell_eps"}, {att_eps, "att_eps"},
                                  {readout_eps, "readout_eps"}})
    dtmt::check_eps(eps, op, name);
}

// Every floating tensor of an op in the dtype of its activation `of` (the matrices may be int8 rows): mixed dtypes
// had reached ATen's products, whose "self and mat2 must have the same dtype" names no op or argument.
void check_dtypes(const char* op, const Tensor& like, const char* of,
                  std::initializer_list<std::pair<const Tensor*, const char*>> tensors,
                  std::initializer_list<std::pair<at::TensorList, const char*>> lists) {
  dtmt::check_floating(like, op, of);
  const at::ScalarType type = like.scalar_type();
  for (const auto& [t, name] : tensors) dtmt::check_dtype(*t, type, op, name, of);
  for (const auto& [ts, name] : lists) dtmt::check_list_dtype(ts, type, op, name, of);
}

const Tensor& or_undefined(const OptTensor& t) {
  static const Tensor undefined;
  return t.has_value() ? *t : undefined;
}

std::tuple<Tensor, Tensor> attention_step(const Tensor& query, const Tensor& keys, const Tensor& annotations,
                                          const Tensor& src_mask, at::TensorList weights, double ln_eps,
                                          const OptTensor& key_exps) {
  dtmt::check_eps(ln_eps, "attention_step", "ln_eps");
  check_dtypes("attention_step", query, "query",
               {{&keys, "keys"}, {&annotations, "annotations"}, {&or_undefined(key_exps), "key_exps"}},
               {{weights, "weights"}});
  auto r = dtmt::attention_step_cpu(dense(query), keys, last_dim_dense(annotations), src_mask,
                                    dtmt::AttentionWeights::from_list(dense(weights), ln_eps), 1, true,
                                    key_exps.has_value() && key_exps->numel() ? *key_exps : Tensor());
  return {r[0], r[1]};
}

// (an empty tensor where key_exps_cpu gives none)
Tensor key_exps(const Tensor& keys) {
  Tensor r = dtmt::key_exps_cpu(dense(keys));
  return r.defined() ? r : at::empty({0}, keys.options());
}

Tensor readout_features(const Tensor& y, const Tensor& s, const Tensor& c, at::TensorList weights, double eps) {
  dtmt::check_eps(eps, "readout_features", "eps");
  check_dtypes("readout_features", s, "s", {{&y, "y"}, {&c, "c"}}, {{weights, "weights"}});
  return dtmt::readout_features_cpu(dense(y), dense(s), dense(c),
                                    dtmt::ReadoutWeights::from_list(dense(weights), eps, /*with_output=*/false));
}

std::tuple<Tensor, Tensor, Tensor> rnmt_step(const Tensor& y, const Tensor& s, const Tensor& keys,
                                             const Tensor& annotations, const Tensor& src_mask, int64_t q_kind,
                                             at::TensorList q_params, int64_t d_kind, at::TensorList d_params,
                                             double cell_eps, at::TensorList attention, double att_eps,
                                             at::TensorList readout, double readout_eps) {
  check_step_eps("rnmt_step", cell_eps, att_eps, readout_eps);
  check_dtypes("rnmt_step", s, "s", {{&y, "y"}, {&keys, "keys"}, {&annotations, "annotations"}},
               {{q_params, "q_params"}, {d_params, "d_params"}, {attention, "attention"}, {readout, "readout"}});
  auto r = dtmt::rnmt_step_cpu(dense(y), dense(s), keys, last_dim_dense(annotations), src_mask,
                               dtmt::cell_weights(q_kind, dense(q_params), "rnmt_step", "q_params"),
                               dtmt::cell_weights(d_kind, dense(d_params), "rnmt_step", "d_params"), cell_eps,
                               dtmt::AttentionWeights::from_list(dense(attention), att_eps),
                               dtmt::ReadoutWeights::from_list(dense(readout), readout_eps));
  return {r[0], r[1], r[2]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> rnmt_beam_search(
    const Tensor& annotations, const Tensor& keys, const Tensor& src_mask, const Tensor& s, const Tensor& embed,
    const OptTensor& positions, int64_t q_kind, at::TensorList q_params, int64_t d_kind, at::TensorList d_params,
    double cell_eps, at::TensorList attention, double att_eps, at::TensorList readout, double readout_eps,
    int64_t beam, double alpha, const Tensor& max_len, int64_t bos, int64_t eos, bool step_tables,
    bool early_stop, const OptTensor& token_products, const OptTensor& position_products,
    const OptTensor& context_heads, std::optional<int64_t> nbest, at::OptionalIntArrayRef banned,
    c10::string_view length_penalty) {
  check_step_eps("rnmt_beam_search", cell_eps, att_eps, readout_eps);
  check_dtypes("rnmt_beam_search", s, "s",
               {{&annotations, "annotations"}, {&keys, "keys"}, {&embed, "embed"},
                {&or_undefined(positions), "positions"}, {&or_undefined(token_products), "token_products"},
                {&or_undefined(position_products), "position_products"},
                {&or_undefined(context_heads), "context_heads"}},
               {{q_params, "q_params"}, {d_params, "d_params"}, {attention, "attention"}, {readout, "readout"}});
  TORCH_CHECK_VALUE(std::abs(alpha) <= dtmt::kMaxAlpha,   // (NaN fails this too)
                    "dtmt::rnmt_beam_search: alpha must be within [-", dtmt::kMaxAlpha, ", ", dtmt::kMaxAlpha,
                    "] (larger powers overflow float64 at long searches), got ", alpha);
  const dtmt::SearchSource source{last_dim_dense(annotations), dense(keys), dense(src_mask), dense(s), max_len};
  const dtmt::SearchModel model{dtmt::cell_weights(q_kind, dense(q_params), "rnmt_beam_search", "q_params"),
                                dtmt::cell_weights(d_kind, dense(d_params), "rnmt_beam_search", "d_params"),
                                cell_eps,
                                dtmt::AttentionWeights::from_list(dense(attention), att_eps),
                                dtmt::ReadoutWeights::from_list(dense(readout), readout_eps),
                                dense(embed),
                                dense(positions, embed),
                                dense(token_products, embed),
                                dense(position_products, embed),
                                given(context_heads) ? context_heads->contiguous() : Tensor()};
  TORCH_CHECK_VALUE(length_penalty == "gnmt" || length_penalty == "average",
                    "dtmt._C.rnmt_beam_search: length_penalty must be gnmt or average, got ", length_penalty);
  const int64_t penalty = length_penalty == "average" ? dtmt::kLengthAverage : dtmt::kLengthGnmt;
  const dtmt::SearchSettings settings{beam, alpha, penalty, bos, eos, step_tables, early_stop, nbest,
                                      banned.has_value() ? banned->vec() : std::vector<int64_t>()};
  auto r = dtmt::rnmt_beam_search_cpu(source, model, settings);
  return {r[0], r[1], r[2], r[3], r[4]};
}

std::tuple<Tensor, Tensor> memory_encoder(const Tensor& x, const Tensor& memory, const Tensor& src_mask, bool reverse,
                                          int64_t cell_kind, at::TensorList cell, double cell_eps,
                                          at::TensorList addressing) {
  dtmt::check_eps(cell_eps, "memory_encoder", "cell_eps");
  check_dtypes("memory_encoder", x, "x", {{&memory, "memory"}}, {{cell, "cell"}, {addressing, "addressing"}});
  auto r = dtmt::memory_encoder_cpu(dense(x), memory, src_mask, reverse,
                                    dtmt::cell_weights(cell_kind, dense(cell), "memory_encoder", "cell"), cell_eps,
                                    dtmt::MemoryWeights::from_list(dense(addressing)));
  // an empty source leaves the memory as it came in: never return the input itself
  if (r[1].is_same(memory) || r[1].data_ptr() == memory.data_ptr()) r[1] = r[1].clone();
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dtmt, m) {
  m.def("attention_step(Tensor query, Tensor keys, Tensor annotations, Tensor src_mask, Tensor[] weights, "
        "float ln_eps, Tensor? key_exps=None) -> (Tensor context, Tensor alpha)");
  m.def("key_exps(Tensor keys) -> Tensor");
  m.def("readout_features(Tensor y, Tensor s, Tensor c, Tensor[] weights, float eps) -> Tensor");
  m.def("rnmt_step(Tensor y, Tensor s, Tensor keys, Tensor annotations, Tensor src_mask, int q_kind, "
        "Tensor[] q_params, int d_kind, Tensor[] d_params, float cell_eps, Tensor[] attention, float att_eps, "
        "Tensor[] readout, float readout_eps) -> (Tensor log_probs, Tensor s, Tensor alpha)");
  m.def("rnmt_beam_search(Tensor annotations, Tensor keys, Tensor src_mask, Tensor s, Tensor embed, "
        "Tensor? positions, int q_kind, Tensor[] q_params, int d_kind, Tensor[] d_params, float cell_eps, "
        "Tensor[] attention, float att_eps, Tensor[] readout, float readout_eps, int beam, float alpha, "
        "Tensor max_len, int bos, int eos, bool step_tables=False, bool early_stop=False, "
        "Tensor? token_products=None, Tensor? position_products=None, Tensor? context_heads=None, int? nbest=None, "
        "int[]? banned=None, str length_penalty=\"gnmt\") -> "
        "(Tensor counts, Tensor lengths, Tensor tokens, Tensor scores, Tensor log_probs)");
  m.def("memory_encoder(Tensor x, Tensor memory, Tensor src_mask, bool reverse, int cell_kind, Tensor[] cell, "
        "float cell_eps, Tensor[] addressing) -> (Tensor states, Tensor memory_out)");
}

TORCH_LIBRARY_IMPL(dtmt, CPU, m) {
  m.impl("attention_step", &attention_step);
  m.impl("key_exps", &key_exps);
  m.impl("readout_features", &readout_features);
  m.impl("rnmt_step", &rnmt_step);
  m.impl("rnmt_beam_search", &rnmt_beam_search);
  m.impl("memory_encoder", &memory_encoder);
}

// no backward (inference): a gradient through them is an error naming the op (csrc/registration.cpp)
TORCH_LIBRARY_IMPL(dtmt, Autograd, m) {
  for (const char* op : {"attention_step", "readout_features", "rnmt_step", "rnmt_beam_search", "memory_encoder"})
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
}
