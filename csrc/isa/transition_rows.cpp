// The cells' row passes of the deep transition block and ATR (the row functions of cell_math.h) over a range of
// batch rows: what transition_cpu.cpp runs per time step and sub-cell between its GEMMs, in parallel over rows.
// One copy per instruction set (kernels.h).
#include "kernels.h"

namespace dtmt {
namespace DTMT_ISA {
namespace {

template <int KIND, typename T> void forward_rows(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch) {
  const int H = a.H;
  const int64_t in = int64_t(cell_input_rows(KIND)) * H, hid = int64_t(cell_hidden_rows(KIND)) * H;
  for (int64_t b = b0; b < b1; ++b) {
    const T* xp = a.xp ? a.xp + b * in : nullptr;
    if constexpr (KIND == kATR) {
      atr_forward_row<T, T>(H, xp, a.hp + b * hid, a.h + b * H, a.ln_w, a.ln_b, a.eps, scratch, a.out + b * H);
    } else {
      gated_forward_row<KIND, T, T>(H, xp, a.hp + b * hid, a.h + b * H, a.ln_w, a.ln_b,
                                    a.drop ? a.drop + b * H : nullptr, a.eps, scratch, a.out + b * H);
    }
  }
}

template <int KIND, typename T> void backward_rows(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch) {
  const int H = a.H;
  const int64_t in = int64_t(cell_input_rows(KIND)) * H, hid = int64_t(cell_hidden_rows(KIND)) * H,
                ng = int64_t(cell_ln_groups(KIND)) * H;
  for (int64_t b = b0; b < b1; ++b) {
    const T* xp = a.xp ? a.xp + b * in : nullptr;
    T* dxp = a.dxp ? a.dxp + b * in : nullptr;
    T* dlw = a.dln_w ? a.dln_w + b * ng : nullptr;
    T* dlb = a.dln_b ? a.dln_b + b * ng : nullptr;
    if constexpr (KIND == kATR) {
      atr_backward_row<T, T>(H, xp, a.hp + b * hid, a.h + b * H, a.ln_w, a.ln_b, a.eps, a.dout + b * H, scratch,
                             dxp, a.dhp + b * hid, a.dh + b * H, dlw, dlb);
    } else {
      gated_backward_row<KIND, T, T>(H, xp, a.hp + b * hid, a.h + b * H, a.ln_w, a.ln_b,
                                     a.drop ? a.drop + b * H : nullptr, a.eps, a.dout + b * H, scratch, dxp,
                                     a.dhp + b * hid, a.dh + b * H, dlw, dlb);
    }
  }
}

}  // namespace

// The kind is checked by the caller (transition_cpu.cpp); an unknown one does nothing.
template <typename T> void cell_forward_rows(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch) {
#define DTMT_CASE(K) \
  case K: return forward_rows<K, T>(a, b0, b1, scratch);
  switch (a.kind) { DTMT_FOR_EACH_CELL_KIND(DTMT_CASE) }
#undef DTMT_CASE
}

template <typename T> void cell_backward_rows(const CellRows<T>& a, int64_t b0, int64_t b1, T* scratch) {
#define DTMT_CASE(K) \
  case K: return backward_rows<K, T>(a, b0, b1, scratch);
  switch (a.kind) { DTMT_FOR_EACH_CELL_KIND(DTMT_CASE) }
#undef DTMT_CASE
}

template void cell_forward_rows<float>(const CellRows<float>&, int64_t, int64_t, float*);
template void cell_forward_rows<double>(const CellRows<double>&, int64_t, int64_t, double*);
template void cell_backward_rows<float>(const CellRows<float>&, int64_t, int64_t, float*);
template void cell_backward_rows<double>(const CellRows<double>&, int64_t, int64_t, double*);

}  // namespace DTMT_ISA
}  // namespace dtmt
