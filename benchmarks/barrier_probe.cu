// The persistent kernels' barrier alone (issue 72; docs/design/persistent_recurrence.md, "Where a step's time goes"):
// persistent_barrier of csrc/persistent_cuda_kernels.cuh, launched by launch_persistent as the kernels are, in the grid
// form (a cooperative launch, a block per SM) and the cluster form (one cluster of 16 blocks; compute capability 9.0
// and up), 256 threads a block, with no work between two barriers; and the launch of the stage read once a cluster (a
// cooperative launch in clusters of 2: code for sm_90a, -DDTMT_SM90A; "The stage read once a cluster"), each round a
// grid barrier and a cluster barrier, the first run of that launch on a device. bench_persistent.py bounds the barrier
// from above by a GRU step of one unit a block; the difference between the two is the step's own latency (its loads of
// what other blocks wrote, its products, its stores).
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -DDTMT_SM90A -Icsrc benchmarks/barrier_probe.cu -o /tmp/barrier_probe && \
//     /tmp/barrier_probe
//
// Prints, per form, µs a barrier: (time of a launch of 20,000 barriers - time of a launch of none) / 20,000, each
// the median of 5 launches timed by CUDA events. Needs a CUDA device (gpu_session.sh's persistent stage runs it).
#include <algorithm>
#include <cstdio>
#include <vector>

#include "persistent_cuda_kernels.cuh"

struct ProbeArgs {
  int rounds;
  bool cluster;        // (read by launch_persistent: the cluster form)
  int* out;
  int multicast = 1;   // (launch_persistent's clusters of the stage read once a cluster: a cooperative launch in them)
  int blocks = 0;      // (launch_persistent's blocks a cluster: 0, the grid in one cluster)
  int B = 1, ldb = 1;  // (launch_persistent's rows a cluster and the batch's: one cluster, none to regroup)
  int stage_cols = 0;  // (launch_persistent's stage to size again where it regroups: none)
};

__global__ void probe_kernel(ProbeArgs a) {
  for (int i = 0; i < a.rounds; ++i) {
    dtmt::cuda::persistent_barrier(a.cluster);
    if (a.multicast > 1) dtmt::cuda::stage_cluster_sync();
  }
  if (threadIdx.x == 0 && blockIdx.x == 0) *a.out = a.rounds;
}

static bool check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::printf("%s: %s\n", what, cudaGetErrorString(err));
  return false;
}

static size_t no_smem(const ProbeArgs&) { return 0; }
static int no_stage(const ProbeArgs&) { return 0; }

// Median ms of 5 launches of `rounds` barriers in `grid` blocks (-1: the launch failed).
static float median_ms(ProbeArgs a, int grid) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int run = 0; run < 6; ++run) {   // (the first a warm-up)
    cudaEventRecord(start);
    if (!check(dtmt::cuda::launch_persistent(probe_kernel, a, grid, 256, no_smem, no_stage, nullptr), "launch"))
      return -1.0f;
    cudaEventRecord(stop);
    if (!check(cudaEventSynchronize(stop), "run")) return -1.0f;
    float t = 0.0f;
    cudaEventElapsedTime(&t, start, stop);
    if (run > 0) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);   // (a row at a time through gpu_session.sh's tee: a timeout keeps them)
  int device = 0, sms = 0, major = 0;
  cudaDeviceProp prop{};
  if (!check(cudaGetDevice(&device), "device")) return 1;
  cudaGetDeviceProperties(&prop, device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  int* out = nullptr;
  if (!check(cudaMalloc(&out, sizeof(int)), "cudaMalloc")) return 1;
  const int rounds = 20000;
  std::printf("# %s, %d SMs: persistent_barrier alone, 256 threads a block, %d barriers a launch, median of 5\n",
              prop.name, sms, rounds);
  std::printf("| form | blocks | µs a barrier |\n|---|---:|---:|\n");
  for (int form = 0; form < 3; ++form) {
    const bool cluster = form == 1;
    const int multicast = form == 2 ? 2 : 1;
    const char* name = form == 0 ? "grid" : form == 1 ? "cluster" : "grid in clusters of 2 (grid + cluster barrier)";
    if (form > 0 && major < 9) {
      std::printf("| %s | | (compute capability %d: no clusters) |\n", name, major);
      continue;
    }
    const int grid = cluster ? dtmt::cuda::kClusterMaxBlocks : sms / multicast * multicast;
    const float none = median_ms(ProbeArgs{0, cluster, out, multicast}, grid);
    const float all = none < 0 ? -1.0f : median_ms(ProbeArgs{rounds, cluster, out, multicast}, grid);
    if (none < 0 || all < 0) {
      if (form < 2) return 1;
      std::printf("| %s | %d | (the launch failed, above) |\n", name, grid);
      continue;
    }
    std::printf("| %s | %d | %.2f |\n", name, grid, (all - none) * 1000.0f / rounds);
  }
  cudaFree(out);
  return 0;
}
