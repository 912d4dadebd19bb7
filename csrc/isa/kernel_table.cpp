// This instruction set's table of loops (cpu_kernels.h), read by cpu_dispatch.cpp. A constant of function
// addresses: nothing of this copy runs when the library is loaded, only once the dispatcher has chosen it.
#include "kernels.h"

// Stringify the namespace name (DTMT_ISA is a bare word such as avx2).
#define DTMT_STR2(x) #x
#define DTMT_STR(x) DTMT_STR2(x)

namespace dtmt {
namespace DTMT_ISA {

template <typename T> constexpr TypedCpuKernels<T> typed_kernels() {
  return {cell_forward_rows<T>, cell_backward_rows<T>, scores_forward<T>, scores_from_exps<T>, scores_backward<T>,
          context_forward<T>, context_backward<T>, smoothed_ce_rows<T>, log_softmax_rows<T>, masked_softmax_rows<T>,
          within_bound<T>, readout_rows<T>, token_rows<T>, weigh_products<T>};
}

extern const CpuKernels kCpuKernels;
const CpuKernels kCpuKernels = {DTMT_STR(DTMT_ISA), typed_kernels<float>(), typed_kernels<double>(), small_rows,
                                row_panels,
                                quantize_activations_int8, small_rows_int8, int8_panel_rows, pack_int8_panel,
                                int8_panel, top_candidates};

}  // namespace DTMT_ISA
}  // namespace dtmt
