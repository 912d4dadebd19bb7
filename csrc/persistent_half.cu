// The persistent kernels and launchers of __half storage (csrc/persistent_cuda_kernels.cuh), a unit of their own:
// setup.py's nvcc jobs compile the four storage types' units in parallel; transition_cuda.cu declares them extern.
#include "persistent_cuda_kernels.cuh"

namespace dtmt {
namespace cuda {
DTMT_PERSISTENT_LAUNCHERS(, __half, float)
}  // namespace cuda
}  // namespace dtmt
