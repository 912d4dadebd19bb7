// pybind11 module dtmt_kernels._C: what is not an op. Importing it loads the library, whose static initialisers
// register the ops (csrc/registration.cpp, torch.ops.dtmt.*); the module itself holds the constants the Python side
// is tested against (cell kinds, the inference ops' weight fields, the small-row limit) and the choice of the CPU
// instruction set.
#include <torch/extension.h>

#include "cell_math.h"
#include "cpu_dispatch.h"
#include "engine/decode_step.h"
#include "persistent_plan.h"
#ifdef DTMT_WITH_CUDA
#include "transition.h"
#endif
#include "phase_timers.h"
#include "small_gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dtmt fused kernels: constants and CPU instruction-set choice (the ops are torch.ops.dtmt.*)";
  {  // the row layout as compiled (cell_layout.inc), which tests hold equal to dtmt_kernels/ops/transition/layout.py
    py::dict rows;
#define DTMT_ROW(K) \
  rows[py::int_(static_cast<int>(dtmt::K))] =                                                                       \
      py::make_tuple(dtmt::cell_input_rows(dtmt::K), dtmt::cell_hidden_rows(dtmt::K), dtmt::cell_ln_groups(dtmt::K));
    DTMT_FOR_EACH_CELL_KIND(DTMT_ROW)
#undef DTMT_ROW
    m.attr("CELL_ROWS") = rows;
  }
  m.attr("ATTENTION_WEIGHT_FIELDS") = std::string(dtmt::kAttentionWeightFields);
  m.attr("READOUT_WEIGHT_FIELDS") = std::string(dtmt::kReadoutWeightFields);
  m.attr("MEMORY_WEIGHT_FIELDS") = std::string(dtmt::kMemoryWeightFields);
  m.attr("SMALL_ROWS_MAX") = dtmt::kSmallRowsMax;
  m.attr("PANEL_WIDTH") = dtmt::kPanelWidth;
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
  m.attr("PHASE_TIMERS") = dtmt::kPhaseTimers;
  m.def("phase_times", &dtmt::phase_times,
        "(phase, seconds, calls) of each phase of csrc/phase_timers.h since the last reset, all zero unless the "
        "extension was built with DTMT_PHASE_TIMERS=1 (benchmarks/bench_step_phases.py)");
  m.def("reset_phase_times", &dtmt::reset_phase_times, "Sets every phase's seconds and calls to zero");
  m.attr("PERSISTENT_THREADS") = dtmt::cuda::kPersistentThreads;
  m.attr("PERSISTENT_SPILL_L2_SHARE") = dtmt::cuda::kSpillL2Share;
  m.def(
      "persistent_plan",
      [](int kind, int depth, int batch, int hidden, int storage_bytes, int accumulation_bytes, int multiprocessors,
         int64_t shared_memory, bool tensor_cores, int threads, int64_t l2_bytes, int cluster_blocks,
         int multicast) {
        // (the plan divides by them: 0 was a SIGFPE)
        TORCH_CHECK(storage_bytes == 2 || storage_bytes == 4 || storage_bytes == 8,
                    "persistent_plan: storage_bytes must be 2, 4 or 8, got ", storage_bytes);
        TORCH_CHECK(accumulation_bytes == 4 || accumulation_bytes == 8,
                    "persistent_plan: accumulation_bytes must be 4 or 8, got ", accumulation_bytes);
        const auto p = dtmt::cuda::persistent_plan(kind, depth, batch, hidden, storage_bytes, accumulation_bytes,
                                                   multiprocessors, static_cast<size_t>(shared_memory), tensor_cores,
                                                   threads, static_cast<size_t>(l2_bytes), cluster_blocks, multicast);
        return py::make_tuple(p.grid, p.slice, p.forward_bytes, p.backward_bytes, p.fits, p.forward_resident,
                              p.backward_resident, p.forward_spill, p.backward_spill, p.cluster, p.forward_stage,
                              p.backward_stage, p.multicast, p.groups);
      },
      "(grid, slice, forward bytes, backward bytes, fits, forward resident, backward resident, forward spill bytes, "
      "backward spill bytes, cluster, forward stage columns, backward stage columns, multicast, groups) of the "
      "persistent launches (csrc/persistent_plan.h: the CUDA driver's own arithmetic; cluster_blocks > 0: the cluster "
      "form, in `groups` clusters each its own batch rows; multicast > 1: the grid form in clusters of that many "
      "blocks sharing the stage); dtmt_kernels.persistent_plan is the Python face");
  m.attr("PERSISTENT_CLUSTER_MAX_BLOCKS") = dtmt::cuda::kClusterMaxBlocks;
  m.attr("PERSISTENT_PLAN_MAX_DEPTH") = dtmt::cuda::kPlanMaxDepth;
  m.attr("PERSISTENT_PLAN_MAX_HIDDEN") = dtmt::cuda::kPlanMaxHidden;
  m.attr("PERSISTENT_PLAN_MAX_ROWS") = dtmt::cuda::kPlanMaxRows;
  m.def(
      "persistent_tensor_cores",
      [](int storage_bytes, int capability_major) {
        return dtmt::cuda::persistent_tensor_cores(storage_bytes, at::globalContext().allowTF32CuBLAS(),
                                                   capability_major);
      },
      "Whether the persistent products of storage_bytes values run on tensor cores on a device of that compute "
      "capability, now (torch's TF32 flag for float32): the driver's rule");
#ifdef DTMT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def(
      "persistent_launches",
      [] {
        const auto c = dtmt::persistent_launch_counts();
        return py::make_tuple(c.grid, c.cluster, c.refused, c.multicast, c.tensor_cores, c.steps);
      },
      "(grid, cluster, refused, multicast, tensor_cores, steps): the cuda backend's forwards and backwards run as "
      "persistent launches in this process, in the grid form, in the cluster form and in the grid form's clusters "
      "sharing the stage, the persistent launches the device refused, of those run the ones with tensor-core "
      "products, and the per-step runs where the persistent launches were asked for (csrc/transition.h)");
#else
  m.attr("has_cuda") = false;
#endif
}
