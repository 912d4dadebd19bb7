// Inference-only fused pieces of a decoder step (beam search: no autograd, one call instead of a dozen small
// PyTorch ops, whose dispatch costs more than their arithmetic at batch 1). See decode_step_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace dtmt {

// One step of (multi-head) additive attention, MultiHeadAdditiveAttention.forward / AdditiveAttention.forward:
//   q = query W_q^T [B, NH*D], then layer-normalised over all NH*D (gain ln_w, offset ln_b, ln_eps) when ln_w is
//   not empty (Nematus' AdditiveAttention, one head);  scores[b,h,s] = v[h] . tanh(keys[b,s,h] + q[b,h]);
//   alpha = softmax over the source positions with src_mask (padded positions get exactly 0);
//   context = the per-head weighted sum of the annotations, then context W_o^T + b_o when w_o is not empty.
// query [B, Q], w_q [NH*D, Q], keys [B, S, NH, D], v [NH, D], annotations [B, S, C] (last dim contiguous),
// src_mask [B, S] bool, w_o [C', C] / b_o [C'] or empty, ln_w / ln_b [NH*D] or empty. Returns
// {context, alpha [B, NH, S]}.
std::vector<at::Tensor> attention_step_cpu(const at::Tensor& query, const at::Tensor& w_q, const at::Tensor& keys,
                                           const at::Tensor& v, const at::Tensor& annotations,
                                           const at::Tensor& src_mask, const at::Tensor& w_o, const at::Tensor& b_o,
                                           const at::Tensor& ln_w, const at::Tensor& ln_b, double ln_eps);

// The readout features of Readout.features: tanh(LN_y(y W_y^T + b_y) + LN_s(s W_s^T + b_s) + LN_c(c W_c^T + b_c)).
// y [N, E], s [N, Hs], c [N, C]; biases may be empty; ln_w / ln_b [3, R] (the three layer norms' gains and
// offsets) or empty for no layer norm. Returns [N, R].
at::Tensor readout_features_cpu(const at::Tensor& y, const at::Tensor& s, const at::Tensor& c, const at::Tensor& w_y,
                                const at::Tensor& b_y, const at::Tensor& w_s, const at::Tensor& b_s,
                                const at::Tensor& w_c, const at::Tensor& b_c, const at::Tensor& ln_w,
                                const at::Tensor& ln_b, double eps);

// One whole step of the attentional RNMT decoder (dtmt_models/rnmt.py, fused_step: AttentionalRNMT.step and
// Nematus.step in eval mode):
//   s_q = query_cell(y, s); (c, alpha) = attention_step(s_q, ...); s' = decoder_cell(c, s_q);
//   log_probs = log_softmax(readout_features(y, s', c) W_out^T + b_out) (float32, as Projection returns).
// y [B, E] (the embedded previous tokens), s [B, H]; q_params / d_params: a cell's ten flat kernel parameters
// (dtmt_kernels.autograd.flat_params order) with its kind; q_drop / d_drop [D+1, B, H] or empty;
// att: {w_q, keys, v, annotations, src_mask, w_o, b_o, ln_w, ln_b} (att_eps: the query layer norm's eps);
// readout: {w_y, b_y, w_s, b_s, w_c, b_c, ln_w, ln_b, w_out, b_out}.
// Returns {log_probs [B, V], s' [B, H], the attention weights averaged over the heads [B, S]}.
std::vector<at::Tensor> rnmt_step_cpu(const at::Tensor& y, const at::Tensor& s, int64_t q_kind,
                                      const std::vector<at::Tensor>& q_params, const at::Tensor& q_drop,
                                      int64_t d_kind, const std::vector<at::Tensor>& d_params,
                                      const at::Tensor& d_drop, const std::vector<at::Tensor>& att,
                                      const std::vector<at::Tensor>& readout, double cell_eps, double att_eps,
                                      double readout_eps);

// One direction of mce's read-write-memory GRU encoder (dtmt_models/systems/mce.py,
// MemoryGRUEncoderDirection.forward), the whole loop over the source in one call, the same ATen arithmetic per
// step as the module without its Python dispatch. x [B, S, E], memory [B, S, H] (initial), src_mask [B, S] bool;
// cell: a GRU cell's ten flat kernel parameters; addressing: {w_state [H, H], w_memory [H, H], b_memory [H],
// v [1, H], w_read [H, H], b_read [H], w_write [H, H], b_write [H]}. Returns {states [B, S, H], final memory}.
std::vector<at::Tensor> memory_encoder_cpu(const at::Tensor& x, const at::Tensor& memory, const at::Tensor& src_mask,
                                           bool reverse, int64_t cell_kind, const std::vector<at::Tensor>& cell,
                                           double cell_eps, const std::vector<at::Tensor>& addressing);

}  // namespace dtmt
