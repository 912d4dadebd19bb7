// The functions of one copy of csrc/isa/ (one instruction set), gathered into its table by kernel_table.cpp.
// Every file here is compiled once per instruction set by setup.py with -DDTMT_ISA=<name> and that set's
// -march, so each copy's functions live in their own namespace dtmt::<name> (cell_math.h puts its inline
// functions there too) and no copy's code can stand in for another's at link time. Include no torch header here.
#pragma once

#ifndef DTMT_ISA
#error "csrc/isa/ is compiled once per instruction set by setup.py, with -DDTMT_ISA=<name>"
#endif

#include <cstdint>

#include "cell_math.h"
#include "cpu_kernels.h"

namespace dtmt {
namespace DTMT_ISA {

// transition_rows.cpp
template <typename T> void cell_forward_rows(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch);
template <typename T> void cell_backward_rows(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch);

// attention_loops.cpp
template <typename T>
void scores_forward(const T* keys, const T* q, const T* v, T* out, int64_t S, int64_t NH, int64_t D, int64_t group,
                    int64_t b0, int64_t b1);
template <typename T>
void scores_from_exps(const T* ek, const T* q, const T* v, T* out, int64_t S, int64_t Sp, int64_t NH, int64_t D,
                      int64_t group, int64_t b0, int64_t b1);
template <typename T>
void scores_backward(const T* grad, const T* keys, const T* q, const T* v, T* dkeys, T* dq, T* dv_rows, int64_t S,
                     int64_t NH, int64_t D, int64_t b0, int64_t b1);
template <typename T>
void weigh_products(const T* alpha, int64_t M, int64_t W, const int64_t* block, const T* P, int64_t ldp,
                    const T* bias, T* out, int64_t ldo, int64_t n0, int64_t n1);
template <typename T>
void context_forward(const T* alpha, const T* values, T* out, int64_t S, int64_t NH, int64_t Dc, int64_t vsb,
                     int64_t vss, int64_t group, int64_t b0, int64_t b1);
template <typename T>
void context_backward(const T* grad, const T* alpha, const T* values, T* dalpha, T* dvalues, int64_t S, int64_t NH,
                      int64_t Dc, int64_t vsb, int64_t vss, int64_t dsb, int64_t dss, int64_t b0, int64_t b1);

// decode_rows.cpp
template <typename T> void log_softmax_rows(const T* x, T* out, int64_t V, int64_t r0, int64_t r1);
template <typename T>
void masked_softmax_rows(const T* scores, const bool* mask, T* alpha, int64_t NH, int64_t S, int64_t group,
                         int64_t b0, int64_t b1);

template <typename T> bool within_bound(const T* x, int64_t n, T bound);
template <typename T>
void readout_rows(T* const* parts, const T* ln_w, const T* ln_b, T eps, int64_t R, T* out, int64_t r0, int64_t r1);
template <typename T>
void token_rows(const T* tokens, const T* positions, const T* bias, int64_t N, int64_t N_q, const int64_t* prev,
                int64_t n, T* cell, T* readout);
bool top_candidates(const float* scores, const float* lp, int64_t beam, int64_t V, int64_t K, float* top_scores,
                    int64_t* top_idx);

// loss_rows.cpp
template <typename T>
void smoothed_ce_rows(const T* logits, const int64_t* target, int64_t V, int64_t ignore, T smoothing, T* grad,
                      double* loss, double* nll, int64_t r0, int64_t r1);

// small_gemm_rows.cpp
void small_rows(int M, const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                int64_t ldo, int64_t n0, int64_t n1);
void row_panels(const float* x, const float* panels, int64_t K, const float* bias, float* out, int64_t N,
                int64_t p0, int64_t p1);
void quantize_activations_int8(int64_t M, const float* x, int64_t ldx, int64_t K, int8_t* xq, float* x_scale,
                               char* finite);
void small_rows_int8(int M, const int8_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, int64_t K,
                     int64_t ldw, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1);
int64_t int8_panel_rows();
void pack_int8_panel(int64_t M, const int8_t* xq, const char* finite, int64_t K, uint8_t* panel, int64_t t0,
                     int64_t t1);
void int8_panel(const uint8_t* panel, int64_t M, int64_t K, const float* x_scale, const int8_t* w, int64_t ldw,
                const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1);

}  // namespace DTMT_ISA
}  // namespace dtmt
