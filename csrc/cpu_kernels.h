// The hot loops of the CPU ops, over raw pointers: the table of them that one copy of csrc/isa/ provides.
//
// setup.py compiles csrc/isa/*.cpp once per instruction set (baseline x86-64, AVX2 = x86-64-v3, AVX-512 =
// x86-64-v4; a DTMT_NATIVE=1 build makes one copy for the build machine), each copy in its own namespace
// dtmt::<isa> (the DTMT_ISA macro), and cpu_dispatch.cpp picks one table at run time. The torch-facing code
// (transition_cpu.cpp, attention_cpu.cpp, small_gemm_cpu.cpp: allocation, GEMMs, threads) is compiled once, for
// any x86-64, and calls the loops through this table, one call per range of rows or batch entries.
//
// Nothing here or in csrc/isa/ includes a torch header: an inline function of those headers compiled in an
// AVX-512 copy would have the same name as the baseline one, and the linker keeps either, so code meant for any
// CPU could end up running AVX-512 instructions.
#pragma once

#include <cstdint>

namespace dtmt {

// One sub-cell (a base cell: kGRU, kLGRU, kLAU, kATR, or a T-GRU: kTGRU) over batch rows [b0, b1) of one time
// step; the row functions of cell_math.h for each row. Row b of an array starts b times its row length in:
// xp / dxp rows hold cell_input_rows(kind) * H values, hp / dhp rows cell_hidden_rows(kind) * H, dln_w / dln_b
// rows cell_ln_groups(kind) * H (per-row accumulators), every other array H. Null stands for absent (no input
// rows for kTGRU, no layer norm, no candidate dropout).
template <typename T> struct CellRows {
  int kind;
  int H;
  T eps;                             // layer-norm epsilon
  const T* xp;                       // input pre-activations (W x + b_ih)
  const T* hp;                       // recurrent pre-activations (U h + b_hh)
  const T* h;                        // the state entering the sub-cell
  const T* ln_w;                     // layer-norm gains and offsets, shared by all rows
  const T* ln_b;
  const T* drop;                     // candidate-dropout multipliers
  T* out;                            // forward: the new state
  const T* dout;                     // backward: d(loss)/d(new state)
  T* dxp;                            // backward: d/d(xp)
  T* dhp;                            // backward: d/d(hp)
  T* dh;                             // backward: the direct path to h (the path through U h is the caller's GEMM)
  T* dln_w;                          // backward: accumulated layer-norm gain / offset gradients, per row
  T* dln_b;
};

// The loops of one instruction set for one floating type. `scratch` holds kCellScratch * H values.
template <typename T> struct TypedCpuKernels {
  void (*cell_forward_rows)(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch);
  void (*cell_backward_rows)(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch);
  // Additive attention (attention_cpu.cpp) over batch entries [b0, b1); see attention.h for the layouts. In the
  // forward loops batch entry b reads row b / group of the keys / values (group > 1: a beam's rows share them).
  void (*scores_forward)(const T* keys, const T* q, const T* v, T* out, int64_t S, int64_t NH, int64_t D,
                         int64_t group, int64_t b0, int64_t b1);
  // scores_forward's scores from exponentials (engine/decode_step.h, key_exps_cpu): ek = exp(2 keys) [., NH, D, Sp]
  // (positions last, Sp a multiple of 16 >= S), q [B, NH, D] (each within kExpScoreBound); out [B, NH, S].
  void (*scores_from_exps)(const T* ek, const T* q, const T* v, T* out, int64_t S, int64_t Sp, int64_t NH,
                           int64_t D, int64_t group, int64_t b0, int64_t b1);
  void (*scores_backward)(const T* grad, const T* keys, const T* q, const T* v, T* dkeys, T* dq, T* dv_rows,
                          int64_t S, int64_t NH, int64_t D, int64_t b0, int64_t b1);
  void (*context_forward)(const T* alpha, const T* values, T* out, int64_t S, int64_t NH, int64_t Dc, int64_t vsb,
                          int64_t vss, int64_t group, int64_t b0, int64_t b1);
  void (*context_backward)(const T* grad, const T* alpha, const T* values, T* dalpha, T* dvalues, int64_t S,
                           int64_t NH, int64_t Dc, int64_t vsb, int64_t vss, int64_t dsb, int64_t dss, int64_t b0,
                           int64_t b1);
  // The label-smoothed cross-entropy of logit rows [r0, r1) (loss_cpu.cpp): logits [N, V] and grad [N, V] rows V
  // apart, target[r] in [0, V) or `ignore`; writes each row's smoothed loss and NLL (0 for an ignored row) and the
  // gradient of the row's smoothed loss to its logits (zeros for an ignored row).
  void (*smoothed_ce_rows)(const T* logits, const int64_t* target, int64_t V, int64_t ignore, T smoothing, T* grad,
                           double* loss, double* nll, int64_t r0, int64_t r1);
  // A decoding step's distributions (isa/decode_rows.cpp), rows [r0, r1): out[r] = log_softmax(x[r]) over V
  // values ((x - max) - log sum exp(x - max)); alpha[b, h] = the softmax of scores[b, h] [S] over the positions where
  // mask[b / group] [S] is true, 0 elsewhere (NaN where none is), batch entries [b0, b1).
  void (*log_softmax_rows)(const T* x, T* out, int64_t V, int64_t r0, int64_t r1);
  void (*masked_softmax_rows)(const T* scores, const bool* mask, T* alpha, int64_t NH, int64_t S, int64_t group,
                              int64_t b0, int64_t b1);
  // Whether every x[i], i < n, is within +-bound (NaN is not).
  bool (*within_bound)(const T* x, int64_t n, T bound);
  // The readout's rows [r0, r1): out[r] = tanh(sum_k LN_k(parts[k][r]) * ln_w[k] + ln_b[k]) over the three parts
  // [., R] (each normalised in place; ln_w / ln_b [3, R]), or tanh(sum_k parts[k][r]) where ln_w is null.
  void (*readout_rows)(T* const* parts, const T* ln_w, const T* ln_b, T eps, int64_t R, T* out, int64_t r0,
                       int64_t r1);
  // TokenProducts' rows (engine/decode_step.h) for the n previous tokens prev: cell[i] = (tokens[prev[i], :N_q] +
  // positions[:N_q]) + bias[:N_q], readout[i] likewise for the last N - N_q columns (positions null: no term).
  void (*token_rows)(const T* tokens, const T* positions, const T* bias, int64_t N, int64_t N_q, const int64_t* prev,
                     int64_t n, T* cell, T* readout);
  // SourceProducts' rows weighed by the attention weights (engine/decode_step.h), output columns [n0, n1):
  // out[r, n - n0] = bias[n] + sum_{k < W} alpha[r, k] * P[block[r] * W + k, n], rows r in [0, M).
  void (*weigh_products)(const T* alpha, int64_t M, int64_t W, const int64_t* block, const T* P, int64_t ldp,
                         const T* bias, T* out, int64_t ldo, int64_t n0, int64_t n1);
};

// The most candidates a sentence's top_candidates keeps (2 x beam: beams up to 16; wider ones ask at::topk).
constexpr int64_t kMaxTopCandidates = 32;

constexpr int64_t kCellScratch = 9;  // values per hidden unit a cell row needs (3 gates x {value, norm, grad})

// The columns of one panel of a weight in the row-panel layout (CpuKernels::row_panels, small_gemm.h).
constexpr int64_t kPanelWidth = 128;

// The int8 panel loop's tile: rows of x a vector holds, and weight rows taken together (CpuKernels::int8_panel).
constexpr int kInt8PanelRows = 16;
constexpr int kInt8PanelColumns = 12;

struct CpuKernels {
  const char* isa;  // "baseline", "avx2", "avx512" or "native"
  TypedCpuKernels<float> f32;
  TypedCpuKernels<double> f64;
  // The small-row linear (small_gemm.h), float32: out[m, n] = bias[n] + x[m, :] . w[n, :] for m < M (1..8),
  // output columns [n0, n1); bias may be null.
  void (*small_rows)(int M, const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                     int64_t ldo, int64_t n0, int64_t n1);
  // One row of x [K] times a weight W [N, K] in the row-panel layout (small_gemm.h: panels of kPanelWidth columns,
  // k-major), panels [p0, p1): out[n] = bias[n] + sum_k x[k] W[n, k] for the n < N they hold, each sum taken in k
  // order (one multiply-add chain an output; then the bias); bias may be null.
  void (*row_panels)(const float* x, const float* panels, int64_t K, const float* bias, float* out, int64_t N,
                     int64_t p0, int64_t p1);
  // Rows of x [M, K] (row stride ldx) as int8 rows xq [M, K] with a scale each (small_gemm.h); finite[m] = 0 for a
  // row holding NaN or an infinity (left unwritten).
  void (*quantize_activations_int8)(int64_t M, const float* x, int64_t ldx, int64_t K, int8_t* xq, float* x_scale,
                                    char* finite);
  // The int8 product (small_gemm.h): int8 weight rows (K int8 values q, then the row's float32 scale; rows `ldw`
  // bytes apart) times int8 activation rows xq [M, K] (row stride ldx) with their scales x_scale[M]:
  // out[m, n] = bias[n] + (x_scale[m] * scale[n]) * (xq[m, :] . q[n, :]), the dot product exact in int32.
  void (*small_rows_int8)(int M, const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K,
                          int64_t ldw, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1);
  // The same product for many rows of x where this copy has a loop for them on this CPU (AVX512-VNNI):
  // int8_panel_rows() = the fewest rows of x it is for (0: none here; small_rows_int8 takes every M, 8 rows at a
  // time). pack_int8_panel lays tiles [t0, t1) of kInt8PanelRows rows of xq [M, K] (rows whose `finite` is 0 as
  // zeros) out into `panel` (tiles of ceil(K / 4) * 64 bytes, isa/small_gemm_rows.cpp); int8_panel multiplies the
  // panel by weight rows [n0, n1) (kInt8PanelColumns at a time: split them among threads in such blocks) with
  // small_rows_int8's arithmetic, to the bit: out [M, ·] (row stride ldo).
  int64_t (*int8_panel_rows)();
  void (*pack_int8_panel)(int64_t M, const int8_t* xq, const char* finite, int64_t K, uint8_t* panel, int64_t t0,
                          int64_t t1);
  void (*int8_panel)(const uint8_t* panel, int64_t M, int64_t K, const float* x_scale, const int8_t* w,
                     int64_t ldw, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1);
  // The K <= kMaxTopCandidates best candidates of one sentence of a beam search (isa/decode_rows.cpp):
  // scores[o] + lp[o, w] over its beam rows o and words w < V, as at::topk over them flattened gives them (values
  // descending, index o * V + w) into top_scores / top_idx; false (nothing written) where at::topk could order them
  // otherwise (ties at or above the K-th place, NaN, fewer than K + 1 finite candidates).
  bool (*top_candidates)(const float* scores, const float* lp, int64_t beam, int64_t V, int64_t K,
                         float* top_scores, int64_t* top_idx);
};

}  // namespace dtmt
