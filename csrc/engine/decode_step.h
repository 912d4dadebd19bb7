// Inference-only fused pieces of a decoder step (beam search: no autograd; one call in place of a dozen small
// PyTorch ops). See decode_step_cpu.cpp.
//
// The weights of a step are named structs, mirrored on the Python side by dataclasses of the same fields in
// the same order (dtmt_models/engine/ops.py: AttentionWeights, ReadoutWeights, MemoryWeights). They cross
// the binding as a tensor list in that order (absent tensors empty) and are unpacked in one place, `from_list`;
// the field names are exported (`_C.ATTENTION_WEIGHT_FIELDS`, ...) so that a test holds the two sides equal.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "transition.h"

namespace dtmt {

// (Multi-head) additive attention: the query projection w_q [NH*D, Q], v [NH, D], the output projection
// w_o [C', C] / b_o [C'] (empty: none; multi-head attention), the query layer norm ln_w / ln_b [NH*D] (empty:
// none; Nematus' attention) and its eps.
struct AttentionWeights {
  at::Tensor w_q, v, w_o, b_o, ln_w, ln_b;
  double ln_eps;
  static AttentionWeights from_list(const std::vector<at::Tensor>& t, double ln_eps);
};
constexpr const char* kAttentionWeightFields = "w_q v w_o b_o ln_w ln_b";

// The readout tanh(LN_y(y W_y^T + b_y) + LN_s(s W_s^T + b_s) + LN_c(c W_c^T + b_c)) and the output projection
// w_out [V, R] / b_out [V]. Biases may be empty; ln_w / ln_b [3, R] are the three layer norms' gains and offsets
// (empty: no layer norm) with their one eps.
struct ReadoutWeights {
  at::Tensor w_y, b_y, w_s, b_s, w_c, b_c, ln_w, ln_b, w_out, b_out;
  double eps;
  static ReadoutWeights from_list(const std::vector<at::Tensor>& t, double eps, bool with_output = true);
};
constexpr const char* kReadoutWeightFields = "w_y b_y w_s b_s w_c b_c ln_w ln_b w_out b_out";

// mce's memory addressing: w_state [H, H], w_memory [H, H], b_memory [H], v [1, H], w_read [H, H], b_read [H],
// w_write [H, H], b_write [H].
struct MemoryWeights {
  at::Tensor w_state, w_memory, b_memory, v, w_read, b_read, w_write, b_write;
  static MemoryWeights from_list(const std::vector<at::Tensor>& t);
};
constexpr const char* kMemoryWeightFields = "w_state w_memory b_memory v w_read b_read w_write b_write";

// A recurrent cell's TransitionWeights from its kind and the ten flat kernel parameters
// (dtmt_kernels.ops.transition.flat_params order, absent ones empty), checked against the cell (op_checks.h's
// check_cell; `op` and `what` name them in an error).
TransitionWeights cell_weights(int64_t kind, const std::vector<at::Tensor>& params, const char* op,
                               const char* what);

// The products of the context made once per source (why: docs/design/decoding.md, "Tables made once per model and
// per sentence"). Where the attention has no output projection (multi-head attention after fold_context_projection,
// or single-head attention without one), a step reads the context c only through two products, the decoder cell's
// input c W_ih^T and the readout's c W_c^T.
// c is each head's weighted sum of its slice of the annotations, c[h] = sum_s alpha[h,s] A[s,h], so
//   c W^T = sum_h sum_s alpha[h,s] (A[s,h] W[:,h]^T),
// a product of each source position and head with the matrix's columns of that head, made once per sentence; a
// step then weighs those NH * S products by alpha instead of reading W. `products` [K, N_ih + R]: row
// (b * NH + h) * S + s holds sentence b's position s, head h, times both matrices (the cell's columns first);
// `bias` [N_ih + R]: b_ih and b_c (zeros where absent). `block[i]`: the sentence of the step's i-th row group (the
// search's open sentences). The same sums in another order, so equal up to rounding.
struct SourceProducts {
  at::Tensor products, bias;
  int64_t NH = 0, S = 0, N_ih = 0;
  std::vector<int64_t> block;
  // {c W_ih^T + b_ih [rows, N_ih], c W_c^T + b_c [rows, R]}: alpha [rows, NH, S] (contiguous; row r of the
  // sentence block[r / group]) times that sentence's NH * S rows of `products` (the weigh_products loop); scratch:
  // where the two tensors come from (a search's StepScratch), or nullptr: new ones
  std::vector<at::Tensor> weigh(const at::Tensor& alpha, int64_t group, StepScratch* scratch = nullptr) const;
};

// Whether SourceProducts apply to a step with these weights and source (float matrices of the annotations' dtype,
// no attention output projection) and pay: the products of all B sentences have at most half the columns of the
// matrices they stand in for (B * NH * S <= C / 2), so that a step reads fewer bytes and making them (a GEMM of
// S * C * (N_ih + R) per sentence) costs less than the steps save.
bool source_products_pay(const at::Tensor& annotations, int64_t NH, const TransitionWeights& decoder_cell,
                         const AttentionWeights& attention, const ReadoutWeights& readout);

// SourceProducts of annotations [B, S, C] with NH heads for the decoder cell's input matrix w_ih [N_ih, C] and the
// readout's context matrix w_c [R, C] and their biases b_ih, b_c (empty: none); block = 0..B-1. heads: [w_ih; w_c]
// per head, [NH, C / NH, N_ih + R] contiguous, of the annotations' dtype (dtmt_models.engine.ops.context_heads,
// made once per decoder), the GEMM's operand (another shape or dtype: an error); undefined: made here from w_ih and w_c.
SourceProducts source_products_cpu(const at::Tensor& annotations, int64_t NH, const at::Tensor& w_ih,
                                   const at::Tensor& b_ih, const at::Tensor& w_c, const at::Tensor& b_c,
                                   const at::Tensor& heads = at::Tensor());

// The attention keys [B, S, NH, D] as exponentials for the scores of a search's steps, made once per sentence:
// exp(2 keys) laid out [B, NH, D, Sp] (positions last, Sp = S rounded up to 16, the padding 1). Since
// tanh(k + q) = 1 - 2 / (exp(2k) exp(2q) + 1), a step's scores then take one exp per query feature instead of one
// per position and feature (isa: scores_from_exps; why: docs/design/decoding.md, "Tables made once per model and
// per sentence"). The same scores up to rounding.
// Undefined (the steps take the plain loop) unless the keys are float or double and every one is within
// +-kExpScoreBound, so that with a query within the same bound the products stay far inside the type's range.
constexpr double kExpScoreBound = 20.0;
at::Tensor key_exps_cpu(const at::Tensor& keys);

// One step of (multi-head) additive attention, as MultiHeadAdditiveAttention / AdditiveAttention compute it:
//   q = query W_q^T [B, NH*D], layer-normalised over all NH*D when ln_w is present;
//   scores[b,h,s] = v[h] . tanh(keys[b,s,h] + q[b,h]); alpha = softmax over the source positions with src_mask
//   (padded positions get exactly 0); context = the per-head weighted sum of the annotations, then
//   context W_o^T + b_o when w_o is present.
// query [B, Q], keys [B, S, NH, D], annotations [B, S, C] (last dim contiguous), src_mask [B, S] bool.
// Returns {context, alpha [B, NH, S]}.
// group > 1: query has B * group rows, row b attending over keys / annotations / src_mask row b / group (a
// sentence's beam rows share its source; the same arithmetic per row as with the rows repeated).
// with_context false: only alpha is formed ({undefined, alpha}), for a step that reads the context through
// SourceProducts.
// key_exps: key_exps_cpu(keys) (defined), the scores from it where every query value is within kExpScoreBound
// (else, and when undefined, the plain loop). scratch: where its tensors come from (a search's StepScratch), or
// nullptr: new ones.
std::vector<at::Tensor> attention_step_cpu(const at::Tensor& query, const at::Tensor& keys,
                                           const at::Tensor& annotations, const at::Tensor& src_mask,
                                           const AttentionWeights& w, int64_t group = 1, bool with_context = true,
                                           const at::Tensor& key_exps = at::Tensor(), StepScratch* scratch = nullptr);

// The readout features. y [N, E], s [N, Hs], c [N, C] -> [N, R] (the output projection is not applied).
// c_part: c W_c^T + b_c [N, R] already formed (SourceProducts; c is then not read), or undefined; y_part likewise
// y W_y^T + b_y (TokenProducts; y is then not read). With layer norm a given part is normalised in place.
// scratch: where its tensors come from (a search's StepScratch), or nullptr: new ones.
at::Tensor readout_features_cpu(const at::Tensor& y, const at::Tensor& s, const at::Tensor& c,
                                const ReadoutWeights& w, const at::Tensor& c_part = at::Tensor(),
                                const at::Tensor& y_part = at::Tensor(), StepScratch* scratch = nullptr);

// What a search keeps from one step to the next instead of allocating it every step: the largest tensors of a step,
// the logits and log-probabilities [rows, V] (rnmt_step_cpu writes into them, resized to the step's rows; the search
// reads them after the step), and the pool the step's other tensors come from (StepScratch; the search rewinds it at
// the start of each step).
struct StepBuffers {
  at::Tensor logits, log_probs;
  StepScratch scratch;
};

// The previous token's products made once per model (why: docs/design/decoding.md, "Tables made once per model and
// per sentence"). A step reads the embedded previous token y = embed[w] + positions[t] only through the query cell's
// input matrix and the readout's y matrix, so
//   y W^T + b = (embed W^T)[w] + (positions W^T)[t] + b,
// two rows of tables made once (`tokens` [V, N_q + R], `positions` [>= steps, N_q + R] or undefined where the
// system adds no positions; the query cell's N_q = n_in * H columns first, then the readout's R; made by the Python
// side, FusedRNMTDecoder) in place of a step's read of those matrices. The same sums in another order.
struct TokenProducts {
  at::Tensor tokens, positions, bias;   // bias [N_q + R]: b_ih of the query cell and b_y (zeros where absent)
  int64_t N_q = 0;
  // {y W_ih^T + b_ih [n, N_q], y W_y^T + b_y [n, R]} for the previous tokens prev at step t
  std::vector<at::Tensor> rows(const std::vector<int64_t>& prev, int64_t t, StepScratch* scratch = nullptr) const;
};

// TokenProducts for a search from its tables (tokens: [V, N_q + R] of the query cell's and readout's dtype; positions
// or undefined), or nullopt where they do not fit these weights (then the steps embed the previous token).
std::optional<TokenProducts> token_products_cpu(const at::Tensor& tokens, const at::Tensor& positions,
                                                int64_t steps, const TransitionWeights& query_cell,
                                                const ReadoutWeights& readout);

// What a search makes once, per sentence, for its steps, each in place of some of a step's work (absent: the step
// does that work itself); the same step up to the rounding of the sums they reorder.
struct StepTables {
  // the context's products (SourceProducts; its block names each row group's sentence), read in place of the
  // context and the two matrices that multiply it
  const SourceProducts* source = nullptr;
  // key_exps_cpu of the keys the step is given (one row a sentence): the attention scores from exponentials
  at::Tensor key_exps;
  // TokenProducts' rows for the step's previous tokens (y is then not read): the query cell's input products
  // y W_ih^T + b_ih [rows, N_q] and the readout's y W_y^T + b_y [rows, R]
  at::Tensor y_cell, y_readout;
};

// One whole step of the attentional RNMT decoder (dtmt_models/engine/rnmt.py, FusedRNMTDecoder):
//   s_q = query_cell(y, s); (c, alpha) = attention_step(s_q, ...); s' = decoder_cell(c, s_q);
//   log_probs = log_softmax(readout_features(y, s', c) W_out^T + b_out) (float32 at least, as Projection).
// y [B, E] (the embedded previous tokens), s [B, H]; keys / annotations / src_mask as attention_step's.
// Returns {log_probs [B, V], s' [B, H], the attention weights averaged over the heads [B, S]} (with_attention
// false: that last one undefined; the search does not read it).
// group > 1: y and s have B * group rows sharing the source tensors in groups (attention_step_cpu).
// tables: what the search made once for its steps (StepTables); nullptr: none. buffers: where to write the logits
// and log-probabilities (the returned log_probs is then buffers->log_probs) and where the step's other tensors come
// from (its scratch; the returned s' then lives until the scratch's next step); nullptr: new tensors.
std::vector<at::Tensor> rnmt_step_cpu(const at::Tensor& y, const at::Tensor& s, const at::Tensor& keys,
                                      const at::Tensor& annotations, const at::Tensor& src_mask,
                                      const TransitionWeights& query_cell, const TransitionWeights& decoder_cell,
                                      double cell_eps, const AttentionWeights& attention,
                                      const ReadoutWeights& readout, int64_t group = 1,
                                      const StepTables* tables = nullptr, bool with_attention = true,
                                      StepBuffers* buffers = nullptr);

// Beam search over rnmt_step_cpu, the whole loop of dtmt_models/decoding/beam_search.py (its reference: the same
// decisions in the same arithmetic) in one call: rnmt_beam_search_cpu(source, model, settings).
//
// SearchSource: the state as the decoder's `encode` made it, one row a sentence: annotations [B, S, C], keys
// [B, S, NH, D], src_mask [B, S] bool, s [B, H]; max_len [B] the steps each sentence may take (EOS included).
struct SearchSource {
  at::Tensor annotations, keys, src_mask, s, max_len;
};

// SearchModel: the step's weights (rnmt_step_cpu's) and the target embedding. The previous token is embedded as
// embed[token] + positions[t] at step t (positions [>= max(max_len), E], or empty: no positional term).
// token_products / position_products: the model's TokenProducts tables (the latter exactly where the system adds
// positions), context_heads: source_products_cpu's per-head matrices; each empty where the model has none.
struct SearchModel {
  TransitionWeights query_cell, decoder_cell;
  double cell_eps = 1e-5;
  AttentionWeights attention;
  ReadoutWeights readout;
  at::Tensor embed, positions, token_products, position_products, context_heads;
};

// SearchSettings: beam >= 1, alpha the GNMT length-penalty exponent, length_penalty kLengthGnmt (GNMT's
// ((5 + |y|) / 6) ^ alpha) or kLengthAverage (|y|: scores per word, alpha unused), bos / eos the target's ids.
// step_tables: the steps read what the search makes once per sentence (StepTables, each decided once for the whole
// search): the context's products where source_products_pay says they pay, the keys' exponentials where
// key_exps_cpu applies; the same search up to the rounding of those sums; and, given the model's token tables, the
// previous token's products from them; with context_heads, the context's products made from it. false: rnmt_step_cpu's arithmetic
// exactly. early_stop: a sentence ends as soon as it has `beam` finished hypotheses (fairseq's, CTranslate2's and
// Hugging Face's rule); false (beam_search.py's default): once no open hypothesis can still enter its `nbest` best
// finished ones (1 <= nbest <= beam; nullopt: beam), which are then exactly those a search run to max length
// returns. banned: ids never chosen (PAD, BOS), their log-probabilities -inf before the candidates are ranked.
constexpr int64_t kLengthGnmt = 0, kLengthAverage = 1;
struct SearchSettings {
  int64_t beam = 1;
  double alpha = 0.0;
  int64_t length_penalty = kLengthGnmt;
  int64_t bos = 0, eos = 0;
  bool step_tables = false, early_stop = false;
  std::optional<int64_t> nbest;
  std::vector<int64_t> banned;
};

// Returns {counts [B], lengths [N], tokens [sum lengths], scores [N], log_probs [N]}: sentence b's finished
// hypotheses, best first, are the counts[b] after those of the sentences before it; a hypothesis' tokens exclude
// BOS and EOS; scores (log_prob / lp) and log_probs in float64.
std::vector<at::Tensor> rnmt_beam_search_cpu(const SearchSource& source, const SearchModel& model,
                                             const SearchSettings& settings);

// One direction of mce's read-write-memory GRU encoder (dtmt_models/models/systems/mce.py), the whole loop over the
// source in one call, the same ATen arithmetic per step as the module without its Python dispatch.
// x [B, S, E], memory [B, S, H] (initial), src_mask [B, S] bool. Returns {states [B, S, H], final memory}.
std::vector<at::Tensor> memory_encoder_cpu(const at::Tensor& x, const at::Tensor& memory, const at::Tensor& src_mask,
                                           bool reverse, const TransitionWeights& cell, double cell_eps,
                                           const MemoryWeights& addressing);

}  // namespace dtmt
