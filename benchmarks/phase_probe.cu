// Where a persistent launch's time goes (issue 72; docs/design/persistent_recurrence.md, "Where a step's time goes"):
// the persistent forward and backward kernels of csrc/persistent_cuda_kernels.cuh built with DTMT_PERSISTENT_PHASES,
// so that each block's thread 0 adds the SM clock between marks to the phase it names: products (the recurrent
// products: FMA by block_dots, or tensor cores by block_mma, its staging included), stage (block_dots' copies of
// the state or the gradients into shared memory, which decide between overlapping them and wider loads: design
// note, "Tiles of the FMA products"), elements (pre-activations, the cell's update, the
// backward's gate gradients, and the stores), norm (layer norm's partials and joins) and barrier
// (persistent_barrier's wait, the slowest block's lag included). The launches are planned as the driver plans them
// (persistent_plan for this device: blocks, slice, sub-cells read from L2, the products' stage), with 1 KB less
// shared memory, kept for the clock's few static bytes (so where a plan is at the limit, its stage or the sub-cells
// read from L2 may differ from the driver's); 256 threads a block, one cooperative launch each; the backward runs on
// the forward's saved tensors. The marks add a block barrier each, which the extension's kernels do not
// have: the probe's launches are a little slower than theirs (bench_persistent.py times those).
//
//   nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90a -DDTMT_SM90A -DDTMT_PERSISTENT_PHASES -Icsrc \
//     benchmarks/phase_probe.cu -o /tmp/phase_probe && /tmp/phase_probe
//
// Prints a markdown table: per layer (GRU, ATR, the deep transition L-GRU + 4 T-GRUs with layer norm; H = 512,
// T = 50, no mask, no dropout), batch (1, 8, 64), storage and products (float with FMA = strict fp32, through the
// products' stage as the driver runs them, and through whole rows copied at once where the driver chunks them; float
// on tensor cores = TF32; bf16 with FMA through the stage, and on tensor cores; last, fp32 FMA through the stage with
// the grid in clusters of 2 blocks that read it once a cluster, in code for sm_90a (DTMT_SM90A: the bulk
// copies' multicast; "The stage read once a cluster")) and direction: the launch's time (CUDA
// events, median of 5 after a warm-up), then µs a step in each phase (the mean over blocks; cycles turned into µs by
// the blocks' clock over the launch's time), the barriers a step and µs each, and the slowest block's work a step
// (all but the barrier). Needs a CUDA device of compute capability 8.0 or later (gpu_session.sh's persistent stage
// runs it).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "persistent_cuda_kernels.cuh"

#ifndef DTMT_PERSISTENT_PHASES
#error "build the probe with -DDTMT_PERSISTENT_PHASES (the kernels' phase clock)"
#endif

namespace {

using dtmt::cuda::kPhaseCount;
constexpr int kSteps = 50, kHidden = 512, kThreads = dtmt::cuda::kPersistentThreads, kRuns = 5;

bool check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::printf("%s: %s\n", what, cudaGetErrorString(err));
  return false;
}

struct Device {
  int sms = 0, major = 0;
  size_t smem_optin = 0, l2 = 0;
};

// A device buffer of n values of V, filled with uniform values in [-scale, scale) (or zero with scale 0); freed at
// the end of the case.
struct Buffers {
  std::vector<void*> held;
  uint32_t seed = 12345u;
  template <typename V> V* make(size_t n, float scale) {
    std::vector<V> host(n);
    for (auto& v : host) {
      seed = seed * 1664525u + 1013904223u;
      const float u = static_cast<float>(seed >> 8) / 16777216.0f;
      v = static_cast<V>(scale * (2.0f * u - 1.0f));
    }
    void* p = nullptr;
    if (!check(cudaMalloc(&p, n * sizeof(V) + 16), "cudaMalloc")) return nullptr;
    held.push_back(p);
    cudaMemcpy(p, host.data(), n * sizeof(V), cudaMemcpyHostToDevice);
    return static_cast<V*>(p);
  }
  ~Buffers() {
    for (void* p : held) cudaFree(p);
  }
};

struct Timing {
  float ms = -1.0f;
  double phase_us[kPhaseCount] = {};   // a step (setup: the launch's), mean over blocks
  double slowest_work_us = 0.0;        // a step, the slowest block's non-barrier phases
};

// Times launch() (median of kRuns after a warm-up) and reads the phase clock of its last run over `grid` blocks.
template <typename Launch> Timing time_launch(Launch launch, int grid) {
  Timing out;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int run = 0; run <= kRuns; ++run) {
    cudaEventRecord(start);
    if (!check(launch(), "launch")) return out;
    cudaEventRecord(stop);
    if (!check(cudaEventSynchronize(stop), "run")) return out;
    float t = 0.0f;
    cudaEventElapsedTime(&t, start, stop);
    if (run > 0) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const float last = ms.back();
  std::sort(ms.begin(), ms.end());
  out.ms = ms[ms.size() / 2];
  std::vector<long long> cycles(static_cast<size_t>(grid) * kPhaseCount);
  if (!check(cudaMemcpyFromSymbol(cycles.data(), dtmt::cuda::dtmt_phase_cycles, cycles.size() * sizeof(long long)),
             "phase clock"))
    return out;
  double total = 0.0;   // cycles of all phases, summed over blocks
  for (long long c : cycles) total += static_cast<double>(c);
  const double per_us = total / grid / (last * 1000.0);   // the blocks' clock: cycles a µs over the last run
  double slowest = 0.0;
  for (int b = 0; b < grid; ++b) {
    double work = 0.0;
    for (int ph = 0; ph < kPhaseCount; ++ph) {
      const double c = static_cast<double>(cycles[static_cast<size_t>(b) * kPhaseCount + ph]);
      out.phase_us[ph] += c / grid / per_us / (ph == dtmt::cuda::kPhaseSetup ? 1 : kSteps);
      if (ph != dtmt::cuda::kPhaseSetup && ph != dtmt::cuda::kPhaseBarrier) work += c;
    }
    slowest = std::max(slowest, work);
  }
  out.slowest_work_us = slowest / per_us / kSteps;
  return out;
}

void print_row(const char* layer, int B, const char* products, const char* dir, const Timing& t, int barriers) {
  if (t.ms < 0) {
    std::printf("| %s | %d | %s | %s | (failed) ||||||||||\n", layer, B, products, dir);
    return;
  }
  const double step = t.ms * 1000.0 / kSteps;
  std::printf("| %s | %d | %s | %s | %.3f | %.2f |", layer, B, products, dir, t.ms, step);
  for (int ph = dtmt::cuda::kPhaseProducts; ph < kPhaseCount; ++ph) std::printf(" %.2f |", t.phase_us[ph]);
  std::printf(" %d × %.2f | %.2f | %.1f |\n", barriers, t.phase_us[dtmt::cuda::kPhaseBarrier] / barriers,
              t.slowest_work_us, t.phase_us[dtmt::cuda::kPhaseSetup]);
}

// One layer at batch B in storage T (A = float) with products on tensor cores or FMA (through the plan's stage, or
// through whole rows staged at once: `staging`; with `multicast` > 1 the grid in clusters of that many blocks that
// read the stage once a cluster, where the code has the bulk copies: sm_90a): forward, then backward on its saved
// tensors. kWhole: the stage takes all K columns of every row in one copy, waited for once, where the block's shared
// memory allows it and the plan chunks them (two buffers, the next chunk copied while one is summed): what the
// overlap gains.
enum class Stage { kPlan, kWhole };

template <int KIND, typename T>
void run_case(const Device& dev, const char* layer, int D, bool ln, int B, bool mma, Stage staging,
              const char* products, int multicast) {
  using A = float;
  using namespace dtmt::cuda;
  constexpr int NIN = Rows<KIND>::in, NH = Rows<KIND>::hid, NG = Rows<KIND>::groups;
  const int H = kHidden, Tn = kSteps;
  const PersistentPlan plan = persistent_plan(KIND, D, B, H, sizeof(T), sizeof(A), dev.sms, dev.smem_optin, mma,
                                              kThreads, dev.l2, 0, multicast);
  if (!plan.fits || plan.multicast != multicast) {
    std::printf("| %s | %d | %s | | (%s) ||||||||||\n", layer, B, products,
                plan.fits ? "no grid of whole clusters" : "does not fit this device");
    return;
  }
  const int G = plan.grid;
  int forward_stage = plan.forward_stage;
  int backward_stage = plan.backward_stage;
  if (staging == Stage::kWhole) {   // (rows only where it differs from the plan's)
    const int R = backward_u_path_length(KIND, D, H);
    if (persistent_forward_bytes(KIND, D, B, H, plan.slice, sizeof(T), sizeof(A), mma, kThreads,
                                 plan.forward_resident, H) <= dev.smem_optin)
      forward_stage = H;
    if (persistent_backward_bytes(KIND, D, B, H, plan.slice, sizeof(T), sizeof(A), mma, kThreads,
                                  plan.backward_resident, R) <= dev.smem_optin)
      backward_stage = R;
    if (forward_stage == plan.forward_stage && backward_stage == plan.backward_stage) return;
  }
  const size_t BH = static_cast<size_t>(B) * H, TBH = static_cast<size_t>(Tn) * BH;
  const bool low = sizeof(T) != sizeof(A);
  Buffers buf;
  const float ws = 1.0f / 32.0f;   // weights about 1 / sqrt(H)
  PersistentForwardArgs<T, A> f{};
  f.xp = buf.make<T>(TBH * NIN, 1.0f);
  f.w_hh = buf.make<T>(static_cast<size_t>(NH) * H * H, ws);
  f.b_hh = buf.make<T>(static_cast<size_t>(NH) * H, 0.1f);
  if (ln) {
    f.ln_w = buf.make<T>(static_cast<size_t>(NG) * H, 0.0f);
    f.ln_b = buf.make<T>(static_cast<size_t>(NG) * H, 0.1f);
    f.t_ln_w = D ? buf.make<T>(static_cast<size_t>(D) * 2 * H, 0.0f) : nullptr;
    f.t_ln_b = D ? buf.make<T>(static_cast<size_t>(D) * 2 * H, 0.1f) : nullptr;
    std::vector<T> ones(static_cast<size_t>(std::max(NG, 2 * std::max(D, 1))) * H, static_cast<T>(1.0f));
    cudaMemcpy(const_cast<T*>(f.ln_w), ones.data(), static_cast<size_t>(NG) * H * sizeof(T), cudaMemcpyHostToDevice);
    for (int k = 0; k < D; ++k)
      cudaMemcpy(const_cast<T*>(f.t_ln_w) + static_cast<size_t>(k) * 2 * H, ones.data(), 2 * H * sizeof(T),
                 cudaMemcpyHostToDevice);
  }
  f.t_w = D ? buf.make<T>(static_cast<size_t>(D) * 3 * H * H, ws) : nullptr;
  f.t_b = D ? buf.make<T>(static_cast<size_t>(D) * 3 * H, 0.1f) : nullptr;
  f.hs = buf.make<A>((D + 1) * TBH, 0.0f);   // h0 = 0
  f.hs_lp = low ? buf.make<T>((D + 1) * TBH, 0.0f) : nullptr;
  f.hp = buf.make<T>(TBH * NH, 0.0f);
  f.hpt = buf.make<T>(std::max<size_t>(D, 1) * TBH * 3, 0.0f);
  f.out = buf.make<T>(TBH, 0.0f);
  f.h_last = buf.make<A>(BH, 0.0f);
  f.partials = buf.make<A>(2 * (static_cast<size_t>(G) + 1) * B * 3 * 2, 0.0f);   // (the backward's two regions)
  f.spill = plan.forward_spill ? buf.make<T>(plan.forward_spill / sizeof(T), 0.0f) : nullptr;
  auto sizes = [&](auto& a, int resident, int stage) {   // (what the forward's and backward's arguments share)
    a.steps = Tn;
    a.B = B;
    a.H = H;
    a.D = D;
    a.slice = plan.slice;
    a.resident = resident;
    a.mma = mma;
    a.stage_cols = stage;
    a.multicast = plan.multicast;
    a.eps = 1e-5f;
  };
  sizes(f, plan.forward_resident, forward_stage);
  if (f.xp == nullptr || f.out == nullptr) return;
  const Timing fwd = time_launch(
      [&] {
        return launch_persistent_kind<KIND, false, T, A>(persistent_forward_kernel<KIND, T, A>, f, G, kThreads,
                                                         nullptr);
      },
      G);
  print_row(layer, B, products, "forward", fwd, (D + 1) * (ln ? 2 : 1));

  PersistentBackwardArgs<T, A> g{};
  g.xp = f.xp;
  g.hp = f.hp;
  g.hpt = f.hpt;
  g.hs = f.hs;
  g.w_hh = f.w_hh;
  g.b_hh = f.b_hh;
  g.ln_w = f.ln_w;
  g.ln_b = f.ln_b;
  g.t_w = f.t_w;
  g.t_b = f.t_b;
  g.t_ln_w = f.t_ln_w;
  g.t_ln_b = f.t_ln_b;
  g.grad_out = buf.make<T>(TBH, 1.0f);
  g.grad_hn = buf.make<A>(BH, 0.0f);
  g.dh0 = buf.make<A>(BH, 0.0f);
  g.dxp = buf.make<T>(TBH * NIN, 0.0f);
  g.dhp = buf.make<T>(TBH * NH, 0.0f);
  g.dhpt = buf.make<T>(std::max<size_t>(D, 1) * TBH * 3, 0.0f);
  if (ln) {
    g.dln_rows = buf.make<A>(BH * NG, 0.0f);
    g.dlnb_rows = buf.make<A>(BH * NG, 0.0f);
    g.dtln_rows = D ? buf.make<A>(static_cast<size_t>(D) * BH * 2, 0.0f) : nullptr;
    g.dtlnb_rows = D ? buf.make<A>(static_cast<size_t>(D) * BH * 2, 0.0f) : nullptr;
  }
  g.partials = f.partials;
  g.spill = plan.backward_spill ? buf.make<T>(plan.backward_spill / sizeof(T), 0.0f) : nullptr;
  sizes(g, plan.backward_resident, backward_stage);
  g.step_lo = 0;   // the whole sequence in one launch (the driver launches chunks of it: GradientChunks)
  g.step_hi = Tn;
  g.chunk_t0 = 0;
  g.chunk_steps = Tn;
  if (g.dhp == nullptr) return;
  const Timing bwd = time_launch(
      [&] {
        return launch_persistent_kind<KIND, true, T, A>(persistent_backward_kernel<KIND, T, A>, g, G, kThreads,
                                                        nullptr);
      },
      G);
  print_row(layer, B, products, "backward", bwd, (D + 1) * (ln ? 3 : 1));
}

template <typename T>
void run_storage(const Device& dev, bool mma, Stage staging, const char* products, int multicast = 1) {
  for (int B : {1, 8, 64}) {
    run_case<dtmt::kGRU, T>(dev, "GRU", 0, false, B, mma, staging, products, multicast);
    run_case<dtmt::kATR, T>(dev, "ATR", 0, false, B, mma, staging, products, multicast);
    run_case<dtmt::kLGRU, T>(dev, "DT d4 LN", 4, true, B, mma, staging, products, multicast);
  }
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);   // (a row at a time through gpu_session.sh's tee: a timeout keeps them)
  int device = 0, smem = 0, l2 = 0;
  cudaDeviceProp prop{};
  Device dev;
  if (!check(cudaGetDevice(&device), "device")) return 1;
  cudaGetDeviceProperties(&prop, device);
  cudaDeviceGetAttribute(&dev.sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&dev.major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  dev.smem_optin = static_cast<size_t>(smem) - 1024;   // (room for the phase clock's static shared memory)
  dev.l2 = static_cast<size_t>(l2);
  if (dev.sms > dtmt::cuda::kPhaseMaxBlocks) dev.sms = dtmt::cuda::kPhaseMaxBlocks;
  std::printf("# %s, %d SMs: the persistent launches' phases, H = %d, T = %d, %d threads a block; µs a step (mean "
              "over blocks), launch time median of %d\n",
              prop.name, dev.sms, kHidden, kSteps, kThreads, kRuns);
  std::printf("| layer | B | products | direction | ms | µs a step | products | stage | elements | norm | barrier | "
              "barriers a step × µs | slowest block's work | setup µs |\n");
  std::printf("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  run_storage<float>(dev, false, Stage::kPlan, "fp32 FMA, staged (strict)");
  run_storage<float>(dev, false, Stage::kWhole, "fp32 FMA, whole rows staged at once (strict)");
  if (dev.major >= 8) {
    run_storage<float>(dev, true, Stage::kPlan, "TF32 tensor cores");
    run_storage<__nv_bfloat16>(dev, false, Stage::kPlan, "bf16 FMA, staged");
    run_storage<__nv_bfloat16>(dev, true, Stage::kPlan, "bf16 tensor cores");
  } else {
    std::printf("(compute capability %d: no tensor-core rows)\n", dev.major);
  }
  // the grid in clusters of 2 (the driver's kStageMulticastBlocks); in clusters of 4 an H200 refused the cooperative
  // launch of 132 blocks ("too many blocks in cooperative launch", 2026-12-04)
#if defined(DTMT_SM90A)
  if (dev.major == 9) {   // (code for sm_90a: the bulk copies multicast to a cluster)
    run_storage<float>(dev, false, Stage::kPlan, "fp32 FMA, staged once a cluster of 2 (strict)", 2);
  }
#else
  std::printf("(built without -DDTMT_SM90A -arch=sm_90a: no rows of the stage read once a cluster)\n");
#endif
  return 0;
}
