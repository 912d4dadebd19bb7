// Which copy of the CPU loops (cpu_kernels.h, csrc/isa/) runs: the best instruction set that was compiled in and
// that this CPU and OS support, chosen once when the library loads, unless the environment variable DTMT_CPU_ISA
// names another usable one ("baseline", "avx2", "avx512"). Free of torch headers.
#pragma once

#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace dtmt {

// The table in use.
const CpuKernels& cpu_kernels();
template <typename T> const TypedCpuKernels<T>& typed_cpu_kernels();
template <> const TypedCpuKernels<float>& typed_cpu_kernels<float>();
template <> const TypedCpuKernels<double>& typed_cpu_kernels<double>();

// Names of the instruction sets compiled in, best first ("avx512", "avx2", "baseline"; "native" alone in a
// DTMT_NATIVE=1 build), and of those this machine can run.
std::vector<std::string> compiled_cpu_isas();
std::vector<std::string> supported_cpu_isas();

// Runs the copy `name` from now on (tests and benchmarks compare them); std::invalid_argument, naming the
// choices, when it was not compiled in or this machine cannot run it.
void set_cpu_isa(const std::string& name);

// Why DTMT_CPU_ISA was ignored (an unknown name, or one this machine cannot run), or empty.
const std::string& cpu_isa_environment_note();

}  // namespace dtmt
