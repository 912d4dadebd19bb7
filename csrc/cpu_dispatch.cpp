// The choice of the copy of the CPU loops (see cpu_dispatch.h). setup.py defines DTMT_ISA_<NAME> for each copy it
// compiled into the library; this file is compiled for any x86-64 and only reads the CPU's feature bits.
#include "cpu_dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace dtmt {

// Each copy's table (csrc/isa/kernel_table.cpp, in the namespace of its instruction set).
#if DTMT_ISA_AVX512
namespace avx512 { extern const CpuKernels kCpuKernels; }
#endif
#if DTMT_ISA_AVX2
namespace avx2 { extern const CpuKernels kCpuKernels; }
#endif
#if DTMT_ISA_BASELINE
namespace baseline { extern const CpuKernels kCpuKernels; }
#endif
#if DTMT_ISA_NATIVE
namespace native { extern const CpuKernels kCpuKernels; }
#endif

namespace {

struct Isa {
  const CpuKernels* kernels;
  bool (*supported)();
};

bool always() { return true; }

#if DTMT_ISA_AVX2 || DTMT_ISA_AVX512  // x86 only
// x86-64-v3 / v4, the levels setup.py compiles the avx2 / avx512 copies for (-march=x86-64-v3 / -v4): AVX2, FMA,
// BMI1/2, F16C, LZCNT, MOVBE; v3 plus AVX-512 F, BW, CD, DQ, VL. libgcc's check also asks the OS (XGETBV) whether
// it saves the AVX / AVX-512 registers.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
bool has_v3() { return __builtin_cpu_supports("x86-64-v3"); }
bool has_v4() { return __builtin_cpu_supports("x86-64-v4"); }
#else
bool has_v3() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
         __builtin_cpu_supports("bmi2");
}
bool has_v4() {
  return has_v3() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}
#endif
#endif

// Best first.
const std::vector<Isa>& compiled() {
  static const std::vector<Isa> isas = {
#if DTMT_ISA_NATIVE
      {&native::kCpuKernels, always},  // DTMT_NATIVE=1: the one copy, built for this machine
#endif
#if DTMT_ISA_AVX512
      {&avx512::kCpuKernels, has_v4},
#endif
#if DTMT_ISA_AVX2
      {&avx2::kCpuKernels, has_v3},
#endif
#if DTMT_ISA_BASELINE
      {&baseline::kCpuKernels, always},
#endif
  };
  return isas;
}

std::string choices() {
  std::string s;
  for (const Isa& isa : compiled()) {
    if (!isa.supported()) continue;
    s += (s.empty() ? "" : ", ") + std::string(isa.kernels->isa);
  }
  return s;
}

const Isa* find(const std::string& name) {
  for (const Isa& isa : compiled())
    if (name == isa.kernels->isa) return &isa;
  return nullptr;
}

struct Choice {
  std::atomic<const CpuKernels*> kernels{nullptr};
  std::string environment_note;
};

Choice& choice() {
  static Choice* c = [] {
    auto* made = new Choice;  // never destroyed: kernels may run while the process exits
#if DTMT_ISA_AVX2 || DTMT_ISA_AVX512
    __builtin_cpu_init();
#endif
    for (const Isa& isa : compiled()) {
      if (isa.supported()) {
        made->kernels = isa.kernels;
        break;
      }
    }
    if (const char* env = std::getenv("DTMT_CPU_ISA"); env != nullptr && *env != '\0') {
      const Isa* wanted = find(env);
      if (wanted != nullptr && wanted->supported()) {
        made->kernels = wanted->kernels;
      } else {
        made->environment_note = std::string("DTMT_CPU_ISA=") + env + " ignored: " +
                                 (wanted ? "this machine cannot run it" : "not an instruction set of this build") +
                                 "; running " + made->kernels.load()->isa + " (choices here: " + choices() + ")";
      }
    }
    return made;
  }();
  return *c;
}

}  // namespace

const CpuKernels& cpu_kernels() { return *choice().kernels.load(std::memory_order_acquire); }

template <> const TypedCpuKernels<float>& typed_cpu_kernels<float>() { return cpu_kernels().f32; }
template <> const TypedCpuKernels<double>& typed_cpu_kernels<double>() { return cpu_kernels().f64; }

std::vector<std::string> compiled_cpu_isas() {
  std::vector<std::string> names;
  for (const Isa& isa : compiled()) names.push_back(isa.kernels->isa);
  return names;
}

std::vector<std::string> supported_cpu_isas() {
  choice();  // __builtin_cpu_init
  std::vector<std::string> names;
  for (const Isa& isa : compiled())
    if (isa.supported()) names.push_back(isa.kernels->isa);
  return names;
}

void set_cpu_isa(const std::string& name) {
  Choice& c = choice();
  const Isa* isa = find(name);
  if (isa == nullptr || !isa->supported())
    throw std::invalid_argument("dtmt._C.set_cpu_isa: '" + name + "' is " +
                                (isa ? "not supported by this machine" : "not compiled into this build") +
                                "; choices here: " + choices());
  c.kernels.store(isa->kernels, std::memory_order_release);
}

const std::string& cpu_isa_environment_note() { return choice().environment_note; }

}  // namespace dtmt
