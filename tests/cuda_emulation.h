// Test-only host emulation of the few CUDA features csrc/transition_cuda_kernels.cuh uses, so its kernels
// (and the ATen driver csrc/transition_cuda.cu) can be compiled by a host C++ compiler and checked against
// the reference on a machine without a GPU (tests/test_cuda_sources.py::test_cuda_kernels_emulated).
//
// A launch runs the grid's blocks one after another; each block's blockDim.x threads are fibers (ucontext)
// on the calling thread that share the block's dynamic shared memory. A fiber runs until it reaches
// __syncthreads, then hands over to the next one; once every fiber of the block has reached the barrier (or
// returned) they all go on, so a barrier orders memory as CUDA's does. __shfl_xor_sync exchanges through a
// per-block buffer between two barriers (every use in the kernels is reached by all threads of the block, as
// CUDA requires for full-mask shuffles and barriers); in a cooperative launch between two rendezvous of the warp's
// lanes only, which order nothing for the block's other warps. Fibers instead of OS threads: a barrier costs a context
// switch in user space, not a round of 32 kernel wake-ups on a 2-core machine. Not a general CUDA emulator:
// one dimension, no atomics, no streams.
//
// Warp matrix products (nvcuda::wmma, for the persistent kernels' tensor-core products): every thread of a warp
// holds the whole tile in its fragment and does the whole load, product and store itself (the fibers of a warp
// write the same values), so no warp-wide exchange is needed. The product sums each output in k order, in float,
// as an FMA loop would; a GPU's MMA sums in an order of its own. TF32 (float in memory) and bf16 are emulated; loads
// and stores check the API's alignment (32 bytes) and leading dimension (a multiple of 16 bytes).
//
// Asynchronous copies into shared memory (__pipeline_memcpy_async, commit, wait_prior: cp.async on a GPU) are made
// when the thread that issued them waits for them, so a read before the wait (or, by another thread, before the
// block barrier after it) reads the old values.
//
// Cooperative launches (launch_cooperative, for the persistent kernels of csrc/persistent_cuda_kernels.cuh): every
// thread of every block is a fiber, each block has its own dynamic shared memory (dynamic_smem()), and
// grid_sync() is the grid-wide barrier. Between two grid barriers the blocks run one after another, each until all
// its threads reach the next grid barrier (its __syncthreads are block barriers only), in an order that alternates
// with the phase: a block that reads what another writes in the same phase, without a grid barrier between, reads
// stale values in one of the two orders. Threads of one block that meet different barriers (some a __syncthreads,
// some the grid barrier), or blocks of which some end while others wait at the grid barrier, throw. The emulated
// device has 4 SMs with an H100's limits a SM (cooperative_blocks): launch_persistent refuses a cooperative launch
// of more blocks than it holds at once, or of more shared memory a block than the opt-in, as a GPU does.
//
// Cluster launches (launch_clusters: the persistent kernels' cluster form, thread-block clusters of at most 16
// blocks, each its own batch rows; launch_cluster: one of the whole grid) run the same way with cluster_sync() as the
// barrier of a cluster's blocks, the clusters in turn, each from one of its barriers to the next (in an order that
// alternates), so that clusters that share what they should not (a buffer, a row) meet. Cooperative launches in
// clusters (launch_cooperative_clusters: the stage read once a cluster) have both barriers, cluster_sync() a
// cluster's, and mbarriers with bulk copies multicast to a cluster's blocks (below); a grid_sync() in a cluster
// launch, a cluster_sync() in a cooperative one without clusters and a cluster of more than 16 blocks throw, as none
// of them is valid on a GPU.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)  // the shared arrays below are 128-byte aligned themselves

typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorLaunchOutOfResources = 701;   // (the runtime's values; none is returned here)
constexpr cudaError_t cudaErrorInvalidConfiguration = 9;
constexpr cudaError_t cudaErrorCooperativeLaunchTooLarge = 720;
constexpr cudaError_t cudaErrorNotSupported = 801;
constexpr cudaError_t cudaErrorInvalidClusterSize = 912;
typedef void* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t err) {   // (the runtime's words for the errors returned here)
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorInvalidClusterSize: return "invalid cluster size";
    default: return "emulated error";
  }
}
template <typename F> inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int) { return cudaSuccess; }

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;   // set by the scheduler for the running fiber

namespace dtmt_emu {

// One launch's fibers, on the thread that launched it.
struct Scheduler {
  ucontext_t main;
  std::vector<ucontext_t> contexts;
  std::vector<char> done;
  std::vector<double> exchange;
  int current = 0;
  // cooperative launches: fiber b * threads + t is thread t of block b; each block's shared memory
  bool cooperative = false;
  bool cluster = false;   // a cluster launch (clusters of cluster_blocks, their barrier cluster_sync; no grid_sync),
                          // else a cooperative one (grid_sync)
  int cluster_blocks = 1; // a cooperative launch's clusters (launch_cooperative_clusters): cluster_sync their barrier
  // cooperative launches: where each fiber waits (kRunning: it runs at its next resume; kSpinning: it polls, as an
  // mbarrier wait does, and runs again at each round; kAtWarp: at a shuffle, until every lane of its warp is)
  enum Wait : char { kRunning, kAtBlock, kAtCluster, kAtGrid, kSpinning, kAtWarp };
  std::vector<char> wait;
  long events = 0;        // a fiber that went on, a barrier released, an mbarrier's phase completed
  // mbarriers (mbar_init) by (block, offset in its shared memory): arrivals left in the phase, the bytes it still
  // expects (negative while copies are ahead of their expect_tx), its phase, and the copies not landed yet (they land
  // at a wait that sees their phase complete)
  struct Mbar {
    unsigned count = 0, pending = 0, phase = 0;
    long long tx = 0;
    struct Landing {
      void* dst;
      const void* src;
      size_t bytes;
      unsigned phase;   // the barrier's phase when the copy was issued
    };
    std::vector<Landing> landings;
  };
  std::vector<std::vector<std::pair<size_t, Mbar>>> mbars;   // [block] -> (offset, barrier)
  size_t smem_bytes = 0;  // a cooperative launch's dynamic shared memory a block
  std::vector<std::unique_ptr<unsigned char[]>> block_smem;   // 128-byte aligned, zeroed
  void (*body)(const void*) = nullptr;   // runs the kernel with the launch's argument
  const void* arg = nullptr;
  std::string error;   // a check that failed inside the kernel (fiber_fail), thrown by the launch
  // asynchronous copies (__pipeline_memcpy_async) of each fiber not yet waited for: done at the wait that covers them
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    long group;   // the commit that closed it, -1 while open
  };
  std::vector<std::vector<Copy>> copies;
  std::vector<long> commits;
};
inline thread_local Scheduler* scheduler = nullptr;

// Stacks, kept across launches (a kernel's locals are small; 256 KiB each is ample).
constexpr size_t kStackBytes = 256 * 1024;
inline thread_local std::vector<std::unique_ptr<char[]>> stacks;

inline void fiber_entry() {
  Scheduler& s = *scheduler;
  s.body(s.arg);
  // an asynchronous copy never waited for (on a GPU it may land after the kernel read the stage) fails the launch
  if (static_cast<size_t>(s.current) < s.copies.size() && !s.copies[s.current].empty() && s.error.empty())
    s.error = "emulated kernel ended with an asynchronous copy not waited for";
  s.done[s.current] = 1;   // returning resumes uc_link: the scheduler
}

inline void yield_to_scheduler() {
  Scheduler& s = *scheduler;
  if (swapcontext(&s.contexts[s.current], &s.main) != 0) throw std::runtime_error("emulated barrier: swapcontext");
}

// A check that fails inside a kernel: an exception cannot leave a fiber (its stack has no caller to unwind into: it
// would end the process), so the fiber keeps the message and parks for good, and the launch, back on the launching
// thread's own stack, throws it (resume_fiber).
[[noreturn]] inline void fiber_fail(const std::string& message) {
  Scheduler& s = *scheduler;
  if (s.error.empty()) s.error = message;
  for (;;) yield_to_scheduler();
}

}  // namespace dtmt_emu

inline void __syncthreads() {
  dtmt_emu::Scheduler& s = *dtmt_emu::scheduler;
  if (s.cooperative) s.wait[s.current] = dtmt_emu::Scheduler::kAtBlock;
  dtmt_emu::yield_to_scheduler();
}

namespace dtmt_emu {
// The running fiber's copies and commits, made on its first use.
inline void pipeline_of_fiber(Scheduler& s) {
  if (s.copies.size() <= static_cast<size_t>(s.current)) {
    s.copies.resize(s.current + 1);
    s.commits.resize(s.current + 1, 0);
  }
}
}  // namespace dtmt_emu

// Asynchronous copies into shared memory (cuda_pipeline.h's primitives, cp.async on a GPU): a copy is made only when
// its thread waits for it (__pipeline_wait_prior, once at most `prior` later commits are left), so a read of the
// destination before that wait, or by another thread before the block barrier after it, reads what was there before.
// (The emulation cannot tell that src is global memory and dst shared, as cp.async requires.)
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes, size_t zfill = 0) {
  auto& s = *dtmt_emu::scheduler;
  if (zfill != 0) dtmt_emu::fiber_fail("emulated __pipeline_memcpy_async: zero fill is not emulated");
  if (bytes != 4 && bytes != 8 && bytes != 16)
    dtmt_emu::fiber_fail("emulated __pipeline_memcpy_async: 4, 8 or 16 bytes");
  if (reinterpret_cast<uintptr_t>(dst) % bytes || reinterpret_cast<uintptr_t>(src) % bytes)
    dtmt_emu::fiber_fail("emulated __pipeline_memcpy_async: a misaligned copy");
  dtmt_emu::pipeline_of_fiber(s);
  s.copies[s.current].push_back({dst, src, bytes, -1});
}
inline void __pipeline_commit() {   // (a commit of no copies is a group too, as on a GPU)
  auto& s = *dtmt_emu::scheduler;
  dtmt_emu::pipeline_of_fiber(s);
  for (auto& c : s.copies[s.current])
    if (c.group < 0) c.group = s.commits[s.current];
  ++s.commits[s.current];
}
inline void __pipeline_wait_prior(size_t prior) {
  auto& s = *dtmt_emu::scheduler;
  if (s.copies.size() <= static_cast<size_t>(s.current)) return;
  auto& mine = s.copies[s.current];
  const long done_below = s.commits[s.current] - static_cast<long>(prior);
  std::vector<dtmt_emu::Scheduler::Copy> left;
  for (const auto& c : mine) {
    if (c.group >= 0 && c.group < done_below) {
      std::memcpy(c.dst, c.src, c.bytes);
    } else {
      left.push_back(c);
    }
  }
  mine.swap(left);
}

// In a cooperative launch, a rendezvous of the warp's lanes only (the scheduler opens it once every lane of the warp
// that has not ended waits at it), as on a GPU: a shuffle orders nothing for the block's other warps (a block-wide
// barrier here had hidden a missing __syncthreads between warps). In a plain launch, between two block barriers.
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int offset) {
  dtmt_emu::Scheduler& s = *dtmt_emu::scheduler;
  auto& ex = s.exchange;
  const unsigned i = threadIdx.x, from = (i & ~31u) | ((i & 31u) ^ static_cast<unsigned>(offset));
  if (s.cooperative) {
    const int f = s.current, base = f - static_cast<int>(i);
    ex[f] = static_cast<double>(v);
    s.wait[f] = dtmt_emu::Scheduler::kAtWarp;   // (every lane has written its value)
    dtmt_emu::yield_to_scheduler();
    const T r = static_cast<T>(ex[base + from]);
    s.wait[s.current] = dtmt_emu::Scheduler::kAtWarp;   // (every lane has read, before any writes again)
    dtmt_emu::yield_to_scheduler();
    return r;
  }
  ex[i] = static_cast<double>(v);
  __syncthreads();
  const T r = static_cast<T>(ex[from]);
  __syncthreads();
  return r;
}

namespace dtmt_emu {

// The grid-wide barrier of a cooperative launch.
inline void grid_sync() {
  Scheduler& s = *scheduler;
  if (!s.cooperative || s.cluster)
    fiber_fail(s.cluster ? "emulated grid_sync in a cluster launch (its barrier is cluster_sync)"
                         : "emulated grid_sync outside a cooperative launch");
  s.wait[s.current] = Scheduler::kAtGrid;
  yield_to_scheduler();
}

// The barrier of a cluster: of a cluster launch's one cluster (all its blocks), or of the blocks of this block's
// cluster in a cooperative launch of clusters (launch_cooperative_clusters).
inline void cluster_sync() {
  Scheduler& s = *scheduler;
  if (!s.cluster && s.cluster_blocks < 2) fiber_fail("emulated cluster_sync outside a cluster launch");
  s.wait[s.current] = Scheduler::kAtCluster;
  yield_to_scheduler();
}

// This block's rank in its cluster, and the cluster's blocks (1 outside clusters).
inline int cluster_blocks() { return scheduler->cluster_blocks; }
inline int cluster_rank() { return static_cast<int>(blockIdx.x) % cluster_blocks(); }

// The most blocks of one cluster (Hopper's, with the non-portable attribute).
constexpr int kMaxClusterBlocks = 16;

// This block's dynamic shared memory: its own in a cooperative launch, else the one array below.
inline unsigned char* dynamic_smem();
// A cooperative launch's block: its shared memory at the first 128-byte boundary of its allocation, then a guard of
// kSmemGuard bytes of kGuardByte, checked after the launch (a write past the launch's shared memory throws).
inline unsigned char* smem_base(unsigned char* p) {
  return p + (128 - reinterpret_cast<uintptr_t>(p) % 128) % 128;
}
constexpr size_t kSmemGuard = 4096;
constexpr unsigned char kGuardByte = 0xA5;

}  // namespace dtmt_emu

// `extern __shared__ __align__(16) unsigned char smem_raw[]` inside the kernels (namespace dtmt::cuda) names
// this array.
namespace dtmt {
namespace cuda {
alignas(128) inline unsigned char smem_raw[1 << 20];
}  // namespace cuda
}  // namespace dtmt

inline unsigned char* dtmt_emu::dynamic_smem() {
  Scheduler& s = *scheduler;
  return s.cooperative ? smem_base(s.block_smem[blockIdx.x].get()) : dtmt::cuda::smem_raw;
}

// ------------------------------------------------------------------------------ mbarriers and bulk copies
// A cooperative launch's mbarriers (mbarrier.* on a GPU: a phase completes once its arrivals are in and the bytes it
// was told to expect have landed) and bulk copies from global into shared memory multicast to blocks of the cluster
// (cp.async.bulk ... multicast::cluster: the same offset in each destination block's shared memory, each one's
// mbarrier at the offset of the issuer's told of the bytes). A copy toward an odd phase of its destination's mbarrier
// lands when it is issued, toward an even one when a thread of the destination block first sees that phase complete
// (try_wait): a copy into a buffer its block still reads (a cluster barrier missing; the scheduler runs one block of a
// cluster as far as it goes) overwrites it in the one, and a read before the wait (by its thread, or by another
// before a block barrier after it) sees the old values in the other; each buffer's mbarrier takes both in turn. A
// copy to a block whose mbarrier is not initialized, a misaligned one and a wait that can never end throw; so does a
// block that ends with copies into it not waited for.
namespace dtmt_emu {
inline size_t smem_offset(const void* p, const char* what) {
  Scheduler& s = *scheduler;
  const unsigned char* base = dynamic_smem();
  const auto* q = static_cast<const unsigned char*>(p);
  if (!s.cooperative || q < base || q >= base + s.smem_bytes)
    fiber_fail(std::string("emulated ") + what + ": not in this block's dynamic shared memory");
  return static_cast<size_t>(q - base);
}
inline Scheduler::Mbar* find_mbar(int block, size_t offset) {
  for (auto& [off, m] : scheduler->mbars[block])
    if (off == offset) return &m;
  return nullptr;
}
inline void mbar_settle(Scheduler::Mbar& m) {   // the phase completes, the next one begins
  if (m.pending != 0 || m.tx != 0) return;
  ++m.phase;
  m.pending = m.count;
  ++scheduler->events;
}
inline Scheduler::Mbar& own_mbar(const void* bar, const char* what) {
  const size_t off = smem_offset(bar, what);
  if (off % 8) fiber_fail(std::string("emulated ") + what + ": an mbarrier not 8-byte aligned");
  Scheduler::Mbar* m = find_mbar(static_cast<int>(blockIdx.x), off);
  if (m == nullptr) fiber_fail(std::string("emulated ") + what + ": an mbarrier never initialized");
  return *m;
}
inline void mbar_init(uint64_t* bar, unsigned count) {
  Scheduler& s = *scheduler;
  const size_t off = smem_offset(bar, "mbarrier.init");
  if (off % 8 || count == 0) fiber_fail("emulated mbarrier.init: misaligned, or no arrivals");
  Scheduler::Mbar* m = find_mbar(static_cast<int>(blockIdx.x), off);
  if (m == nullptr) m = &s.mbars[blockIdx.x].emplace_back(off, Scheduler::Mbar{}).second;
  if (!m->landings.empty() || m->tx != 0) fiber_fail("emulated mbarrier.init: a barrier with copies in flight");
  *m = Scheduler::Mbar{};
  m->count = m->pending = count;
}
inline void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  Scheduler::Mbar& m = own_mbar(bar, "mbarrier.arrive.expect_tx");
  if (m.pending == 0) fiber_fail("emulated mbarrier.arrive.expect_tx: more arrivals than the phase takes");
  m.tx += bytes;
  --m.pending;
  mbar_settle(m);
}
// Whether the phase of this parity has completed (try_wait.parity: the current phase is of the other parity); where
// it has, the copies of the completed phases that have not landed yet land now, as the waiting thread sees them.
inline bool mbar_try_wait_parity(uint64_t* bar, unsigned parity) {
  Scheduler::Mbar& m = own_mbar(bar, "mbarrier.try_wait.parity");
  if ((m.phase & 1u) == (parity & 1u)) return false;
  std::vector<Scheduler::Mbar::Landing> later;
  for (const auto& l : m.landings) {
    if (l.phase < m.phase) {
      std::memcpy(l.dst, l.src, l.bytes);
    } else {
      later.push_back(l);
    }
  }
  m.landings.swap(later);
  return true;
}
inline void mbar_wait_parity(uint64_t* bar, unsigned parity) {
  Scheduler& s = *scheduler;
  while (!mbar_try_wait_parity(bar, parity)) {
    s.wait[s.current] = Scheduler::kSpinning;
    yield_to_scheduler();
  }
}
// Clusters the emulated device holds at once (cudaOccupancyMaxActiveClusters; 0: every cluster launched): a test
// sets it so that launch_persistent's regrouping into fewer clusters of more batch rows runs on the CPU.
inline int clusters_held = 0;
// The shared memory a block of the emulated device may opt into (an H100's / H200's; the driver's device_limits and
// the persistent launches read it): a test lowers it so that the stages' rule meets a limit at small sizes.
inline size_t smem_optin = 232448;
// The emulated device: 4 SMs (the driver's device_limits; a test of a wider launch sets more), each with an H100's
// limits on the blocks it holds at once (2,048 threads, 32 blocks, 233,472 bytes of shared memory of which 1,024
// reserved a block; registers aside).
inline int multiprocessors = 4;
constexpr int kThreadsPerMultiprocessor = 2048, kBlocksPerMultiprocessor = 32;
constexpr size_t kSmemPerMultiprocessor = 233472, kSmemReservedPerBlock = 1024;
// Blocks the device holds at once where other work holds some of its SMs (0: none held; cf. clusters_held): a test
// sets it so that the driver's fallback from a refused cooperative launch runs on the CPU.
inline int blocks_held = 0;
// The shuffles a warp may open between two of its block's barriers in the emulation (far past any kernel's: a warp
// that would go on without end, polling with shuffles, fails the launch rather than hang it).
constexpr long kMaxShufflesARound = 1L << 24;
// The blocks of `threads` threads and `smem` bytes of dynamic shared memory a cooperative launch may have on the
// emulated device (cudaOccupancyMaxActiveBlocksPerMultiprocessor times the SMs, or blocks_held): a GPU refuses a
// cooperative launch of more (cudaErrorCooperativeLaunchTooLarge), since its blocks must all be resident at once.
inline int cooperative_blocks(int threads, size_t smem) {
  if (threads < 1) return 0;
  const size_t by_smem = kSmemPerMultiprocessor / (smem + kSmemReservedPerBlock);
  const int per = static_cast<int>(std::min<size_t>({static_cast<size_t>(kBlocksPerMultiprocessor),
                                                     static_cast<size_t>(kThreadsPerMultiprocessor / threads),
                                                     by_smem}));
  return blocks_held > 0 ? std::min(blocks_held, per * multiprocessors) : per * multiprocessors;
}
inline long cluster_launches = 0, clusters_launched = 0;   // launch_clusters' launches and their clusters
inline long bulk_copies = 0;   // bulk copies issued in this process (a test's check that the multicast path ran)
inline void bulk_copy_multicast(void* dst, const void* src, unsigned bytes, uint64_t* bar, uint16_t mask) {
  Scheduler& s = *scheduler;
  ++bulk_copies;
  const size_t dst_off = smem_offset(dst, "cp.async.bulk"), bar_off = smem_offset(bar, "cp.async.bulk");
  if (bytes == 0 || bytes % 16 || dst_off % 16 || reinterpret_cast<uintptr_t>(src) % 16 ||
      dst_off + bytes > s.smem_bytes)
    fiber_fail("emulated cp.async.bulk: 16-byte aligned addresses and sizes, inside shared memory");
  const int first = static_cast<int>(blockIdx.x) - cluster_rank(), blocks = cluster_blocks();
  if (mask == 0 || mask >> blocks) fiber_fail("emulated cp.async.bulk: a multicast mask past the cluster");
  for (int r = 0; r < blocks; ++r) {
    if (!(mask >> r & 1u)) continue;
    Scheduler::Mbar* m = find_mbar(first + r, bar_off);
    if (m == nullptr) fiber_fail("emulated cp.async.bulk: to a block whose mbarrier is not initialized");
    unsigned char* to = smem_base(s.block_smem[first + r].get()) + dst_off;
    if (m->phase & 1) {   // (odd phases of the destination's mbarrier: at the issue; even ones: at the wait)
      std::memcpy(to, src, bytes);
    } else {
      m->landings.push_back({to, src, bytes, m->phase});
    }
    m->tx -= bytes;
    mbar_settle(*m);
  }
}
}  // namespace dtmt_emu

namespace dtmt_emu {

// A launch's kernel and argument, run by every fiber of it (both outlive the launch: locals of the launching call).
template <typename Kernel, typename Arg> struct Call {
  Kernel* kernel;
  const Arg* arg;
  static void run(const void* c) {
    const Call& call = *static_cast<const Call*>(c);
    call.kernel(*call.arg);
  }
};

// Fiber f of the launch in `s` set to start the kernel on stack f.
inline void start_fiber(Scheduler& s, int f) {
  ucontext_t& c = s.contexts[f];
  if (getcontext(&c) != 0) throw std::runtime_error("emulated launch: getcontext");
  c.uc_stack.ss_sp = stacks[f].get();
  c.uc_stack.ss_size = kStackBytes;
  c.uc_link = &s.main;
  makecontext(&c, fiber_entry, 0);
}

// Runs fiber f of the launch in `s` until its next barrier or its end; a check that failed in it (fiber_fail) throws
// here, on the launching thread's stack (the launch's SchedulerScope puts the enclosing scheduler back).
inline void resume_fiber(Scheduler& s, int f) {
  if (swapcontext(&s.main, &s.contexts[f]) != 0) throw std::runtime_error("emulated launch: swapcontext");
  if (!s.error.empty()) throw std::runtime_error(s.error);
}

// A launch's scheduler in place for its lifetime; the enclosing one back however the launch ends (a throw too).
struct SchedulerScope {
  Scheduler* outer;
  explicit SchedulerScope(Scheduler* s) : outer(scheduler) { scheduler = s; }
  ~SchedulerScope() { scheduler = outer; }
  SchedulerScope(const SchedulerScope&) = delete;
  SchedulerScope& operator=(const SchedulerScope&) = delete;
};

// A launch of no blocks or no threads: a GPU refuses it (cudaErrorInvalidConfiguration), so the emulation does too.
inline void check_launch_shape(int grid, int threads) {
  if (grid < 1 || threads < 1)
    throw std::runtime_error("emulated launch: " + std::to_string(grid) + " blocks of " + std::to_string(threads) +
                             " threads (a GPU refuses it: invalid configuration argument)");
}

template <typename Kernel, typename Arg>
inline void launch(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg) {
  check_launch_shape(grid, threads);
  if (smem > sizeof(dtmt::cuda::smem_raw)) throw std::runtime_error("emulated launch: too much shared memory");
  const Call<Kernel, Arg> call{kernel, &arg};
  Scheduler s;
  s.body = &Call<Kernel, Arg>::run;
  s.arg = &call;
  s.contexts.resize(threads);
  s.done.resize(threads);
  s.exchange.resize(threads);
  while (stacks.size() < static_cast<size_t>(threads)) stacks.emplace_back(new char[kStackBytes]);
  const SchedulerScope scope(&s);
  blockDim.x = threads;
  gridDim.x = grid;
  for (int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    // each block's shared memory starts as 0xFF bytes (NaN in every float type), as a GPU's holds whatever was there:
    // not the zeros of the first block, nor the last block's values
    std::memset(dtmt::cuda::smem_raw, 0xFF, smem);
    for (int t = 0; t < threads; ++t) {
      start_fiber(s, t);
      s.done[t] = 0;
    }
    // rounds: every fiber still running goes on to its next barrier (or its end). The order alternates
    // (ascending, descending) with the round and the block, so a missing barrier shows whichever thread was
    // meant to write first: a reader that runs before its writer reads stale shared memory.
    for (int round = 0, running = 1; running; ++round) {
      running = 0;
      const bool descending = (round + b) & 1;
      for (int i = 0; i < threads; ++i) {
        const int t = descending ? threads - 1 - i : i;
        if (s.done[t]) continue;
        s.current = t;
        threadIdx.x = t;
        resume_fiber(s, t);
        running = running || !s.done[t];
      }
    }
  }
}

// A launch whose blocks wait at a barrier of them all: cooperative (grid_sync); with `cluster`, clusters of
// `cluster_blocks` and no grid barrier (cluster_sync the barrier of a cluster's blocks); a cooperative one in clusters
// of `cluster_blocks` (both barriers). Between two grid barriers the clusters run one after another (a block is a
// cluster of one), in an order that alternates with the phase; in a cluster launch of several clusters, each cluster
// from one of its barriers to the next, in an order that alternates too; a cluster's threads in rounds, each running
// thread going on to its next barrier or wait, a polling one (an mbarrier's wait) again each round, in an order that
// alternates with the round, the block and the phase (a cluster's blocks one at a time, each until it waits on the
// others); a block barrier opens once every thread of the block that has not ended waits at it, a cluster's once all of
// the cluster's do.
template <typename Kernel, typename Arg>
inline void launch_all_blocks(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg, bool cluster,
                              int cluster_blocks = 1) {
  check_launch_shape(grid, threads);
  if (smem > sizeof(dtmt::cuda::smem_raw)) throw std::runtime_error("emulated launch: too much shared memory");
  const Call<Kernel, Arg> call{kernel, &arg};
  Scheduler s;
  s.body = &Call<Kernel, Arg>::run;
  s.arg = &call;
  s.cooperative = true;
  s.cluster = cluster;
  s.cluster_blocks = cluster_blocks;
  s.smem_bytes = smem;
  const int fibers = grid * threads;
  s.contexts.resize(fibers);
  s.done.assign(fibers, 0);
  s.wait.assign(fibers, Scheduler::kRunning);
  s.exchange.resize(fibers);
  s.mbars.assign(grid, {});
  s.block_smem.clear();
  for (int b = 0; b < grid; ++b) {   // (aligned in dynamic_smem), then kSmemGuard bytes of a pattern
    s.block_smem.emplace_back(new unsigned char[smem + 128 + kSmemGuard]());
    // the block's shared memory starts as 0xFF bytes, NaN in every float type, as a GPU's holds whatever the last
    // launch left: zeros had hidden a read of what no thread wrote (a tile's padding past K left unwritten passed;
    // a review's mutant, 2026-12-07)
    std::memset(smem_base(s.block_smem.back().get()), 0xFF, smem);
    std::memset(smem_base(s.block_smem.back().get()) + smem, kGuardByte, kSmemGuard);
  }
  while (stacks.size() < static_cast<size_t>(fibers)) stacks.emplace_back(new char[kStackBytes]);
  const SchedulerScope scope(&s);
  blockDim.x = threads;
  gridDim.x = grid;
  for (int f = 0; f < fibers; ++f) start_fiber(s, f);
  const int per = cluster_blocks, clusters = grid / per;
  for (int phase = 0;; ++phase) {
    for (int i = 0; i < clusters; ++i) {
      const int c = (phase & 1) ? clusters - 1 - i : i;
      // this cluster's threads, round after round, until each has ended or waits at the grid barrier; one block of a
      // cluster at a time, as far as it goes (until it waits on the others), so that a block runs ahead of the
      // others as far as its barriers allow
      const bool greedy = per > 1;
      int current = (phase / 2) % per, idle = 0;
      for (int round = 0;; ++round) {
        const long before = s.events;
        int polling = 0;
        for (int j = 0; j < per; ++j) {
          const int b = c * per + (((round + phase) & 1) ? per - 1 - j : j);
          if (greedy && b != c * per + current) continue;
          blockIdx.x = b;
          const bool descending = (round + b + phase) & 1;
          const int warps = (threads + 31) / 32;
          for (int v = 0; v < warps; ++v) {
            const int w0 = 32 * (descending ? warps - 1 - v : v), lanes = std::min(32, threads - w0);
            long openings = 0;
            // this warp's lanes, then again each time its shuffle opens (every lane waits at it): the warp runs
            // ahead of the block's other warps as far as its block barriers let it, as it may on a GPU
            for (;;) {
              for (int k = 0; k < lanes; ++k) {
                const int t = w0 + (descending ? lanes - 1 - k : k);
                const int f = b * threads + t;
                const char w = s.wait[f];
                if (s.done[f] || (w != Scheduler::kRunning && w != Scheduler::kSpinning)) continue;
                s.current = f;
                threadIdx.x = t;
                s.wait[f] = Scheduler::kRunning;
                resume_fiber(s, f);
                if (s.done[f] || s.wait[f] != w) ++s.events;
                polling += !s.done[f] && s.wait[f] == Scheduler::kSpinning;
              }
              int live = 0, at_warp = 0;
              for (int t = w0; t < w0 + lanes; ++t) {
                live += !s.done[b * threads + t];
                at_warp += !s.done[b * threads + t] && s.wait[b * threads + t] == Scheduler::kAtWarp;
              }
              if (at_warp == 0 || at_warp < live) break;   // (no shuffle, or not every lane at it yet)
              if (live < lanes)   // (a full-mask shuffle needs every lane: undefined on a GPU)
                throw std::runtime_error("emulated launch: a shuffle of a warp whose other lanes have ended");
              if (++openings > kMaxShufflesARound)
                throw std::runtime_error("emulated launch: a warp shuffles without end (no barrier between)");
              for (int t = w0; t < w0 + lanes; ++t) s.wait[b * threads + t] = Scheduler::kRunning;
              ++s.events;
            }
          }
        }
        // the barriers that open: a block's, where all its threads left wait at it; the cluster's likewise
        int at_cluster = 0, at_grid = 0, left = 0;
        for (int j = 0; j < per; ++j) {
          const int b = c * per + j;
          int in_block = 0, at_block = 0, busy = 0;
          for (int t = 0; t < threads; ++t) {
            const int f = b * threads + t;
            if (s.done[f]) continue;
            ++in_block;
            const char w = s.wait[f];
            at_block += w == Scheduler::kAtBlock;
            at_cluster += w == Scheduler::kAtCluster;
            at_grid += w == Scheduler::kAtGrid;
            busy += w == Scheduler::kRunning || w == Scheduler::kSpinning || w == Scheduler::kAtWarp;
          }
          left += in_block;
          if (busy == 0 && at_block > 0) {
            if (at_block != in_block)
              throw std::runtime_error("emulated launch: threads of one block met different barriers");
            for (int t = 0; t < threads; ++t)
              if (!s.done[b * threads + t]) s.wait[b * threads + t] = Scheduler::kRunning;
            ++s.events;
          }
        }
        if (at_cluster > 0 && at_cluster == left) {
          for (int f = c * per * threads; f < (c + 1) * per * threads; ++f)
            if (!s.done[f]) s.wait[f] = Scheduler::kRunning;
          ++s.events;
          if (s.cluster && clusters > 1) break;   // (the next cluster runs to its next barrier: clusters interleave)
        } else if (at_cluster > 0 && at_grid > 0 && at_cluster + at_grid == left) {
          throw std::runtime_error("emulated launch: threads of one cluster met different barriers");
        }
        if (at_grid == left) break;   // (all ended, or at the grid barrier)
        if (s.events != before) {
          idle = 0;
        } else if (greedy && ++idle < per) {   // (this block waits on the others: the next one)
          current = (current + 1) % per;
        } else {
          throw std::runtime_error(polling ? "emulated launch: an mbarrier wait that can never end"
                                           : "emulated launch: threads wait at barriers that can never open");
        }
      }
    }
    int ended = 0, waiting = 0;
    for (int f = 0; f < fibers; ++f) {
      ended += s.done[f];
      waiting += !s.done[f] && s.wait[f] == Scheduler::kAtGrid;
    }
    if (ended == fibers) break;
    if (s.cluster) continue;   // (a cluster launch's clusters, interleaved at their barriers: no grid barrier)
    if (waiting + ended != fibers || ended)
      throw std::runtime_error("emulated launch: some threads ended while others wait at the grid barrier");
    std::fill(s.wait.begin(), s.wait.end(), Scheduler::kRunning);
  }
  for (int b = 0; b < grid; ++b) {   // a write past the launch's shared memory would overrun it on a GPU
    const unsigned char* guard = smem_base(s.block_smem[b].get()) + smem;
    for (size_t i = 0; i < kSmemGuard; ++i)
      if (guard[i] != kGuardByte)
        throw std::runtime_error("emulated launch: block " + std::to_string(b) + " wrote past its " +
                                 std::to_string(smem) + " bytes of shared memory");
    for (const auto& [off, m] : s.mbars[b])   // a block that ended with copies into it in flight
      if (!m.landings.empty() || m.tx != 0)
        throw std::runtime_error("emulated launch: block " + std::to_string(b) + " ended with bulk copies into it "
                                 "not waited for");
  }
}

template <typename Kernel, typename Arg>
inline void launch_cooperative(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg) {
  launch_all_blocks(kernel, grid, threads, smem, arg, false);
}

// A cluster launch's shape as the device takes it: clusters of 1 to kMaxClusterBlocks blocks that divide the grid.
inline void check_cluster_blocks(int grid, int cluster_blocks) {
  if (cluster_blocks < 1 || cluster_blocks > kMaxClusterBlocks || grid % cluster_blocks != 0)
    throw std::runtime_error("emulated launch: clusters of " + std::to_string(cluster_blocks) +
                             " blocks in a grid of " + std::to_string(grid) + " (at most " +
                             std::to_string(kMaxClusterBlocks) + ", dividing the grid)");
}

// A cooperative launch in thread-block clusters of `cluster_blocks` consecutive blocks (cudaLaunchKernelEx with both
// the cooperative and the cluster-dimension attributes): grid_sync the grid's barrier, cluster_sync a cluster's.
template <typename Kernel, typename Arg>
inline void launch_cooperative_clusters(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg,
                                        int cluster_blocks) {
  check_cluster_blocks(grid, cluster_blocks);
  launch_all_blocks(kernel, grid, threads, smem, arg, false, cluster_blocks);
}

// Thread-block clusters of `cluster_blocks` consecutive blocks (cudaLaunchKernelEx with
// cudaLaunchAttributeClusterDimension, not cooperative): cluster_sync a cluster's barrier, no grid barrier.
template <typename Kernel, typename Arg>
inline void launch_clusters(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg, int cluster_blocks) {
  check_cluster_blocks(grid, cluster_blocks);
  ++cluster_launches;
  clusters_launched += grid / cluster_blocks;
  launch_all_blocks(kernel, grid, threads, smem, arg, true, cluster_blocks);
}

// One thread-block cluster of `grid` blocks.
template <typename Kernel, typename Arg>
inline void launch_cluster(Kernel* kernel, int grid, int threads, size_t smem, const Arg& arg) {
  launch_clusters(kernel, grid, threads, smem, arg, grid);
}

}  // namespace dtmt_emu

// ------------------------------------------------------------------------------------------ bfloat16 storage
// The kernels only convert it (Cvt in csrc/transition_cuda_kernels.cuh): the upper 16 bits of a float, rounded to
// nearest even as __float2bfloat16_rn (a NaN stays a quiet NaN).
struct __nv_bfloat16 {
  uint16_t x;
  explicit operator float() const {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};
inline float __bfloat162float(__nv_bfloat16 v) { return static_cast<float>(v); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(bits >> 16)};
}

// ------------------------------------------------------------------------------------------ float16 storage
// IEEE binary16, converted as __half2float and __float2half_rn do: to nearest even, subnormals kept, past the
// largest finite value (65504) infinity, a NaN a quiet NaN.
struct __half {
  uint16_t x;
  explicit operator float() const {
    const uint32_t sign = static_cast<uint32_t>(x & 0x8000u) << 16;
    const uint32_t exponent = (x >> 10) & 0x1fu, mantissa = x & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
      bits = sign | 0x7f800000u | (mantissa << 13);                       // inf, NaN
    } else if (exponent != 0) {
      bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);          // normal: rebias 15 -> 127
    } else if (mantissa == 0) {
      bits = sign;                                                         // +-0
    } else {                                                               // subnormal: mantissa x 2^-24, exact
      float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};
inline float __half2float(__half v) { return static_cast<float>(v); }
inline __half __float2half_rn(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return __half{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
  if (magnitude >= 0x477ff000u) return __half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds past 65504: inf
  if (magnitude >= 0x38800000u) {                                         // normal in half (>= 2^-14)
    uint32_t m = magnitude - (112u << 23);                                // rebias 127 -> 15
    m += 0xfffu + ((m >> 13) & 1u);                                       // to nearest even on the 13 bits dropped
    return __half{static_cast<uint16_t>(sign | (m >> 13))};
  }
  // subnormal in half (or 0): the value in units of 2^-24, to nearest even
  float a;
  std::memcpy(&a, &magnitude, 4);
  const float units = a * 16777216.0f;                                    // exact: a power-of-two scale
  float whole = static_cast<float>(static_cast<uint32_t>(units));
  const float rest = units - whole;
  if (rest > 0.5f || (rest == 0.5f && (static_cast<uint32_t>(whole) & 1u))) whole += 1.0f;
  return __half{static_cast<uint16_t>(sign | static_cast<uint16_t>(whole))};   // (1024 units: the first normal)
}

// ------------------------------------------------------------------------------------------ warp matrix products
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}  // namespace precision

// Rounds to TF32 (10 mantissa bits), to nearest with ties away from zero, as cvt.rna.tf32.f32 does.
inline float __float_to_tf32(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & 0xffffe000u;   // (inf and NaN as they are)
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

template <typename E> struct storage_of { using type = E; };
template <> struct storage_of<precision::tf32> { using type = float; };

// The whole tile, row-major: matrix_a M x K, matrix_b K x N, accumulator M x N.
template <typename Use, int M, int N, int K, typename E, typename Layout = void> struct fragment {
  static constexpr int rows = std::is_same<Use, matrix_b>::value ? K : M;
  static constexpr int cols = std::is_same<Use, matrix_a>::value ? K : N;
  static constexpr int num_elements = rows * cols;
  typename storage_of<E>::type x[num_elements];
};

inline void check_operand(const void* p, unsigned ldm, size_t element) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) dtmt_emu::fiber_fail("emulated wmma: a pointer not 32-byte aligned");
  if ((ldm * element) % 16 != 0) dtmt_emu::fiber_fail("emulated wmma: a leading dimension not a multiple of 16 bytes");
}

template <typename Use, int M, int N, int K, typename E, typename L, typename P>
inline void load_matrix_sync(fragment<Use, M, N, K, E, L>& f, const P* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, E, L>;
  check_operand(p, ldm, sizeof(P));
  constexpr bool by_rows = std::is_same<L, row_major>::value;   // element (r, c) at p[r * ldm + c], else p[c * ldm + r]
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c) f.x[r * F::cols + c] = by_rows ? p[r * ldm + c] : p[c * ldm + r];
}

// An accumulator from memory, laid out as store_matrix_sync writes it.
template <int M, int N, int K, typename C>
inline void load_matrix_sync(fragment<accumulator, M, N, K, C>& f, const C* p, unsigned ldm, layout_t layout) {
  check_operand(p, ldm, sizeof(C));
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) f.x[m * N + n] = layout == mem_row_major ? p[m * ldm + n] : p[n * ldm + m];
}

template <int M, int N, int K, typename E, typename V>
inline void fill_fragment(fragment<accumulator, M, N, K, E>& f, V v) {
  for (int i = 0; i < M * N; ++i) f.x[i] = static_cast<E>(v);
}

template <int M, int N, int K, typename E, typename LA, typename LB, typename C>
inline void mma_sync(fragment<accumulator, M, N, K, C>& d, const fragment<matrix_a, M, N, K, E, LA>& a,
                     const fragment<matrix_b, M, N, K, E, LB>& b, const fragment<accumulator, M, N, K, C>& c) {
  C out[M * N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      C acc = c.x[m * N + n];
      for (int k = 0; k < K; ++k) acc += static_cast<C>(a.x[m * K + k]) * static_cast<C>(b.x[k * N + n]);
      out[m * N + n] = acc;
    }
  for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}

template <int M, int N, int K, typename C>
inline void store_matrix_sync(C* p, const fragment<accumulator, M, N, K, C>& f, unsigned ldm, layout_t layout) {
  check_operand(p, ldm, sizeof(C));
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) (layout == mem_row_major ? p[m * ldm + n] : p[n * ldm + m]) = f.x[m * N + n];
}
}  // namespace wmma
}  // namespace nvcuda
