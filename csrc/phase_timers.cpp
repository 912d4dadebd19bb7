// The phase timers of phase_timers.h: process-wide totals, nanoseconds and calls per phase.
#include "phase_timers.h"

#include <array>
#include <atomic>
#include <chrono>

namespace dtmt {
namespace {

constexpr int kPhases = static_cast<int>(Phase::kCount);
constexpr const char* kNames[] = {
    "encode",       "search",         "search_setup", "token_rows",        "step",         "eos_mask",
    "top_candidates", "bookkeeping",  "query_cell",   "attention",         "weigh",        "decoder_cell",
    "readout",      "output_product", "log_softmax",  "recurrent_product", "cell_rows",    "tgru_product",
    "tgru_rows",    "query_product",  "scores",       "attention_softmax"};

static_assert(sizeof(kNames) / sizeof(kNames[0]) == kPhases, "a name for every phase of phase_timers.h");

std::array<std::atomic<int64_t>, kPhases> g_ns{};
std::array<std::atomic<int64_t>, kPhases> g_calls{};

}  // namespace

std::vector<std::tuple<std::string, double, int64_t>> phase_times() {
  std::vector<std::tuple<std::string, double, int64_t>> out;
  for (int i = 0; i < kPhases; ++i)
    out.emplace_back(kNames[i], static_cast<double>(g_ns[i].load(std::memory_order_relaxed)) * 1e-9,
                     g_calls[i].load(std::memory_order_relaxed));
  return out;
}

void reset_phase_times() {
  for (int i = 0; i < kPhases; ++i) {
    g_ns[i].store(0, std::memory_order_relaxed);
    g_calls[i].store(0, std::memory_order_relaxed);
  }
}

#ifdef DTMT_PHASE_TIMERS
namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

PhaseScope::PhaseScope(Phase p) : phase_(p), t0_(now_ns()) {}

void PhaseScope::end() {
  if (!open_) return;
  open_ = false;
  const int i = static_cast<int>(phase_);
  g_ns[i].fetch_add(now_ns() - t0_, std::memory_order_relaxed);
  g_calls[i].fetch_add(1, std::memory_order_relaxed);
}
#endif

}  // namespace dtmt
