// Where a decoding search's time goes, phase by phase (benchmarks/bench_step_phases.py). The timers are compiled in
// only when the extension is built with DTMT_PHASE_TIMERS=1 (setup.py); otherwise the macros below are empty
// statements and cost nothing.
//
//   DTMT_PHASE_START(var, phase);   ...   DTMT_PHASE_END(var);
//
// adds the steady_clock time between the two statements (same scope) to `phase`, whichever thread runs them; the
// totals are process-wide (relaxed atomic adds) and are read and reset from Python: _C.phase_times(),
// _C.reset_phase_times(), _C.PHASE_TIMERS says whether this build has them. Phases nest (a step holds its cells,
// a cell its products), so they do not add up to a whole; the benchmark says which holds which.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace dtmt {

enum class Phase : int {
  encode,              // transition_encode_tokens / transition_encode: a sequence layer over the source
  search,              // rnmt_beam_search: the whole call
  search_setup,        // its set-up before the first step (the context's products, the keys' exponentials)
  token_rows,          // a step's previous tokens: their table rows or embeddings
  step,                // rnmt_step_cpu: one decoder step
  eos_mask,            // the step's log-probabilities as float32, and at the last step allowed only EOS may follow
  top_candidates,      // each sentence's 2 * beam best candidates
  bookkeeping,         // finished hypotheses, the stopping rule, the next rows, the state's reorder
  query_cell,          // the step's parts: the query cell (its products and rows below) ...
  attention,           // ... the attention (query product, scores, softmax [, context] below) ...
  weigh,               // ... the context's products weighed (SourceProducts) ...
  decoder_cell,        // ... the decoder cell ...
  readout,             // ... the readout ...
  output_product,      // ... the output layer's product ...
  log_softmax,         // ... and its log-softmax
  recurrent_product,   // a cell step (step_impl): w_hh times the state
  cell_rows,           // its row pass (layer norms, gates, the new state)
  tgru_product,        // a T-GRU's product
  tgru_rows,           // and its row pass
  query_product,       // the attention's query product
  scores,              // the additive scores (after the query's layer norm, where the attention has one)
  attention_softmax,   // the masked softmax (and the context, where the step computes one)
  kCount
};

#ifdef DTMT_PHASE_TIMERS
constexpr bool kPhaseTimers = true;
#else
constexpr bool kPhaseTimers = false;
#endif

// (name, seconds, calls) of every phase, in the enum's order; all zero in a build without the timers.
std::vector<std::tuple<std::string, double, int64_t>> phase_times();
void reset_phase_times();

#ifdef DTMT_PHASE_TIMERS
class PhaseScope {
 public:
  explicit PhaseScope(Phase p);
  ~PhaseScope() { end(); }   // (a scope left without its END still counts, to where it is left)
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;
  void end();   // adds the time since construction to the phase (once)
 private:
  Phase phase_;
  int64_t t0_;
  bool open_ = true;
};
#define DTMT_PHASE_START(var, phase) ::dtmt::PhaseScope var(::dtmt::Phase::phase)
#define DTMT_PHASE_END(var) var.end()
#else
// (the phase's name is still checked, so that a misspelt one fails in every build, not in the timers' only)
#define DTMT_PHASE_START(var, phase) static_cast<void>(::dtmt::Phase::phase)
#define DTMT_PHASE_END(var) static_cast<void>(0)
#endif

}  // namespace dtmt
