// Beam search over the fused decoder step (declared and specified in decode_step.h): the loop of
// dtmt_models/decoding/beam_search.py, decision for decision and in the same arithmetic, with each step one call of
// rnmt_step_cpu and no Python between steps. The Python loop is its reference (tests/test_beam_search.py).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu_dispatch.h"
#include "decode_step.h"
#include "op_checks.h"
#include "phase_timers.h"

namespace dtmt {
namespace {

using at::Tensor;

// A finished hypothesis: its tokens (without BOS / EOS) are the `length` words on the path of back-pointers that
// ends at `node` (Tree), read out once the search is over.
struct Hyp {
  int64_t node;
  int64_t length;
  double score;   // log_prob / length_penalty
  double log_prob;
};

// The open hypotheses as a tree of back-pointers: node i is word[i] after the hypothesis of node parent[i] (-1: the
// empty one). A step adds one node a row kept, instead of copying each row's tokens.
struct Tree {
  std::vector<int64_t> word, parent;
  int64_t add(int64_t w, int64_t p) {
    word.push_back(w);
    parent.push_back(p);
    return static_cast<int64_t>(word.size()) - 1;
  }
  // the `length` words ending at `node`, first to last, appended to `out`
  void read(int64_t node, int64_t length, std::vector<int64_t>& out) const {
    const size_t end = out.size() + static_cast<size_t>(length);
    out.resize(end);
    for (size_t i = end; i > end - static_cast<size_t>(length); --i, node = parent[node]) out[i - 1] = word[node];
  }
};

// lp(y) for a hypothesis of `length` words (EOS included), in double as Python's floats (hypotheses.length_penalty):
// GNMT's ((5 + |y|) / 6) ^ alpha, or |y| (kLengthAverage: the log-probability per word).
double length_penalty(int64_t length, double alpha, int64_t kind) {
  if (kind == kLengthAverage) return static_cast<double>(length);
  return std::pow((5.0 + static_cast<double>(length)) / 6.0, alpha);
}

// A 1-D CPU tensor holding a copy of v (int64_t: long, double: double).
template <typename T> Tensor to_tensor(const std::vector<T>& v) {
  Tensor t = at::empty({static_cast<int64_t>(v.size())}, c10::CppTypeToScalarType<T>::value);
  std::copy(v.begin(), v.end(), t.data_ptr<T>());
  return t;
}

// The previous tokens embedded, embed[prev[i]] + positions[t] (no positional term: positions undefined) [n, E]: as
// embed.index_select(0, prev) + positions.select(0, t) computes it, without two ATen ops a step (float and double
// tables of one dtype; others through those ops).
Tensor embed_previous(const Tensor& embed, const Tensor& positions, const std::vector<int64_t>& prev, int64_t t) {
  const int64_t n = static_cast<int64_t>(prev.size()), V = embed.size(0), E = embed.size(1);
  for (int64_t w : prev) TORCH_CHECK(w >= 0 && w < V, "dtmt._C.rnmt_beam_search: token ", w, " has no embedding");
  const bool positional = positions.defined();
  if ((embed.scalar_type() != at::kFloat && embed.scalar_type() != at::kDouble) ||
      (positional && positions.scalar_type() != embed.scalar_type())) {
    Tensor y = embed.index_select(0, to_tensor(prev));
    return positional ? y + positions.select(0, t) : y;
  }
  Tensor y = at::empty({n, E}, embed.options());
  AT_DISPATCH_FLOATING_TYPES(embed.scalar_type(), "embed_previous", [&] {
    const scalar_t* table = embed.data_ptr<scalar_t>();
    const scalar_t* pos = positional ? positions.data_ptr<scalar_t>() + t * E : nullptr;
    scalar_t* out = y.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* row = table + prev[i] * E;
      scalar_t* o = out + i * E;
      if (pos)
        for (int64_t e = 0; e < E; ++e) o[e] = row[e] + pos[e];
      else
        std::copy(row, row + E, o);
    }
  });
  return y;
}

// t's rows `index` (in that order) written into `out` (made anew only where its shape or dtype differs, and never
// t itself), which is returned: t.index_select(0, index) without its dispatch or allocation.
Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& index, Tensor& out) {
  const Tensor src = t.contiguous();
  const int64_t n = static_cast<int64_t>(index.size());
  if (!out.defined() || out.dim() != 2 || out.size(0) != n || out.size(1) != src.size(1) ||
      out.scalar_type() != src.scalar_type() || out.is_same(src))
    out = at::empty({n, src.size(1)}, src.options());
  const int64_t row_bytes = src.size(1) * static_cast<int64_t>(src.element_size());
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < index.size(); ++i) std::memcpy(to + i * row_bytes, from + index[i] * row_bytes, row_bytes);
  return out;
}

// The search: the state carried from one step to the next (a sentence's beam rows together, the open sentences in
// the order of the state's row groups) and the steps' own buffers, kept across steps (no allocation a step once
// they have grown). Made once per call of rnmt_beam_search_cpu; it points into itself (tables.source), so it stays
// where it was made.
class BeamSearch {
 public:
  BeamSearch(const SearchSource& source, const SearchModel& model, const SearchSettings& settings);
  BeamSearch(const BeamSearch&) = delete;
  BeamSearch& operator=(const BeamSearch&) = delete;

  // Every step, until each sentence has finished; the finished hypotheses as rnmt_beam_search_cpu returns them.
  std::vector<Tensor> run();

 private:
  void check(const SearchSource& source);
  void make_tables();
  Tensor log_probs_of_step(int64_t t);
  void mask(const Tensor& log_probs, int64_t t) const;
  void rank(const Tensor& log_probs);
  bool keep_best(int64_t t, int64_t V);
  void drop_finished();
  std::vector<Tensor> results() const;

  const SearchModel& m_;
  const SearchSettings& o_;
  int64_t B_ = 0, nbest_ = 0, steps_ = 0, K_ = 0;
  bool positional_ = false;
  std::vector<int64_t> max_len_;
  // the source tensors stay one row a sentence: a sentence's beam rows share them (rnmt_step_cpu's group)
  Tensor annotations_, keys_, src_mask_, s_, embed_, positions_;
  std::vector<float> scores_;            // each row's score (float, as the Python loop keeps them)
  Tree tree_;
  std::vector<int64_t> rows_, prev_;     // each row's node in the tree (all t tokens long at step t), its last word
  std::vector<std::vector<Hyp>> finished_;
  std::vector<int64_t> active_;          // the open sentences, in the order of the state's row groups
  // what the steps read instead of recomputing it (decided once, for the whole search)
  std::optional<SourceProducts> source_products_;
  std::optional<TokenProducts> token_tables_;
  StepTables tables_;
  StepBuffers buffers_;
  Tensor state_;   // the decoder state carried from one step to the next (gather_rows)
  std::vector<float> top_scores_;
  std::vector<int64_t> top_idx_;
  // a step's decisions (cleared at each)
  std::vector<int64_t> select_, next_words_, still_, next_rows_;
  std::vector<float> next_scores_;
  std::vector<double> new_scores_;
  std::vector<int64_t> new_origin_, new_word_;
};

BeamSearch::BeamSearch(const SearchSource& source, const SearchModel& model, const SearchSettings& settings)
    : m_(model), o_(settings) {
  DTMT_PHASE_START(setup_phase, search_setup);
  check(source);
  const int64_t beam = o_.beam;
  // the decoder state repeated beam times; all beams start identical, so only the first one is open
  const Tensor start = at::arange(B_, at::kLong).repeat_interleave(beam);
  annotations_ = source.annotations.contiguous();
  keys_ = source.keys.contiguous();
  src_mask_ = source.src_mask.contiguous();
  s_ = source.s.index_select(0, start);
  embed_ = m_.embed.contiguous();
  if (positional_) positions_ = m_.positions.contiguous();
  scores_.assign(static_cast<size_t>(B_ * beam), -std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < B_; ++b) scores_[b * beam] = 0.0f;
  rows_.assign(B_ * beam, -1);
  prev_.assign(B_ * beam, o_.bos);
  finished_.resize(B_);
  active_.resize(B_);
  for (int64_t b = 0; b < B_; ++b) active_[b] = b;
  make_tables();
  new_scores_.resize(beam);
  new_origin_.resize(beam);
  new_word_.resize(beam);
  DTMT_PHASE_END(setup_phase);
}

// The arguments against each other and the op's bounds (op_checks.h); max_len_ and steps_ (the longest).
void BeamSearch::check(const SearchSource& source) {
  const Tensor &s0 = source.s, &embed = m_.embed, &max_len = source.max_len;
  TORCH_CHECK(s0.dim() == 2 && source.annotations.dim() == 3 && source.keys.dim() == 4 &&
                  source.src_mask.dim() == 2 && embed.dim() == 2 && max_len.dim() == 1,
              "dtmt._C.rnmt_beam_search: annotations [B, S, C], keys [B, S, NH, D], src_mask [B, S], s [B, H], "
              "embed [V, E] and max_len [B] expected");
  B_ = s0.size(0);
  TORCH_CHECK(source.annotations.size(0) == B_ && source.keys.size(0) == B_ && source.src_mask.size(0) == B_ &&
                  max_len.size(0) == B_,
              "dtmt._C.rnmt_beam_search: the state's tensors and max_len must have the same batch size");
  const int64_t beam = o_.beam;
  TORCH_CHECK(beam >= 1 && beam <= kMaxBeam, "dtmt._C.rnmt_beam_search: beam must be in [1, ", kMaxBeam, "], got ",
              beam);
  nbest_ = o_.nbest.value_or(beam);
  TORCH_CHECK(nbest_ >= 1 && nbest_ <= beam, "dtmt._C.rnmt_beam_search: need 1 <= nbest <= beam, got nbest=",
              nbest_, ", beam=", beam);
  const int64_t V = embed.size(0);
  TORCH_CHECK(m_.readout.w_out.size(0) == V, "dtmt._C.rnmt_beam_search: the output layer's ",
              m_.readout.w_out.size(0), " words and the target embedding's ", V, " must be the same");
  TORCH_CHECK(o_.bos >= 0 && o_.bos < V && o_.eos >= 0 && o_.eos < V, "dtmt._C.rnmt_beam_search: bos ", o_.bos,
              " and eos ", o_.eos, " must be words of the ", V);
  for (const int64_t w : o_.banned)   // (the step's output words are the target embedding's rows)
    TORCH_CHECK(w >= 0 && w < V && w != o_.eos, "dtmt._C.rnmt_beam_search: banned id ", w, " must be a word of the ",
                V, " other than EOS");
  TORCH_CHECK(at::isIntegralType(max_len.scalar_type(), /*includeBool=*/false),
              "dtmt._C.rnmt_beam_search: max_len must be an integer tensor, got ", max_len.scalar_type());
  const Tensor max_len_cpu = max_len.to(at::kLong).contiguous();
  max_len_.assign(max_len_cpu.data_ptr<int64_t>(), max_len_cpu.data_ptr<int64_t>() + B_);
  for (int64_t m : max_len_) {
    TORCH_CHECK(m >= 1 && m <= kMaxSearchSteps, "dtmt._C.rnmt_beam_search: max_len must be in [1, ",
                kMaxSearchSteps, "] (op_checks.h), got ", m);
    steps_ = std::max(steps_, m);
  }
  const Tensor& positions = m_.positions;
  positional_ = positions.defined() && positions.numel() > 0;
  TORCH_CHECK(!positional_ ||
                  (positions.dim() == 2 && positions.size(0) >= steps_ && positions.size(1) == embed.size(1)),
              "dtmt._C.rnmt_beam_search: positions must be [>= max(max_len), E]");
}

// What the steps read instead of recomputing it, made once per sentence where it applies (step_tables): the
// context's products where they pay, the keys' exponentials, and the previous token's products from the model's
// tables where they were given for this model (and its positions).
void BeamSearch::make_tables() {
  if (!o_.step_tables) return;
  const int64_t NH = keys_.size(2);
  if (source_products_pay(annotations_, NH, m_.decoder_cell, m_.attention, m_.readout)) {
    source_products_ = source_products_cpu(annotations_, NH, m_.decoder_cell.w_ih, m_.decoder_cell.b_ih,
                                           m_.readout.w_c, m_.readout.b_c, m_.context_heads);
    tables_.source = &*source_products_;
  }
  tables_.key_exps = key_exps_cpu(keys_);
  const Tensor &tokens = m_.token_products, &positions = m_.position_products;
  const bool position_tables = positions.defined() && positions.numel() > 0;
  if (positional_ == position_tables && tokens.dim() == 2 && tokens.size(0) == m_.embed.size(0))
    token_tables_ = token_products_cpu(tokens, positions, steps_, m_.query_cell, m_.readout);
}

std::vector<Tensor> BeamSearch::run() {
  for (int64_t t = 0; t < steps_; ++t) {
    buffers_.scratch.rewind();   // (the state s carried from the last step is not in it: `state_`)
    const Tensor step_log_probs = log_probs_of_step(t);
    DTMT_PHASE_START(eos_phase, eos_mask);
    // [n * beam, V] float32 (the step's own buffer for a float model: the masking writes into it)
    const Tensor log_probs =
        step_log_probs.scalar_type() == at::kFloat ? step_log_probs : step_log_probs.to(at::kFloat);
    mask(log_probs, t);
    DTMT_PHASE_END(eos_phase);
    DTMT_PHASE_START(top_phase, top_candidates);
    rank(log_probs);
    DTMT_PHASE_END(top_phase);
    DTMT_PHASE_START(bookkeeping_phase, bookkeeping);
    const bool open = keep_best(t, log_probs.size(1));
    DTMT_PHASE_END(bookkeeping_phase);
    if (!open) break;
  }
  return results();
}

// The step from the previous tokens: its log-probabilities [n * beam, V] (float32 for a float model, the step's own
// buffer); s_ becomes the step's s'.
Tensor BeamSearch::log_probs_of_step(int64_t t) {
  DTMT_PHASE_START(rows_phase, token_rows);
  Tensor y;
  if (token_tables_) {
    std::vector<Tensor> y_products = token_tables_->rows(prev_, t, &buffers_.scratch);
    tables_.y_cell = y_products[0];
    tables_.y_readout = y_products[1];
  } else {
    y = embed_previous(embed_, positions_, prev_, t);
  }
  DTMT_PHASE_END(rows_phase);
  DTMT_PHASE_START(step_phase, step);
  auto r = rnmt_step_cpu(y, s_, keys_, annotations_, src_mask_, m_.query_cell, m_.decoder_cell, m_.cell_eps,
                         m_.attention, m_.readout, o_.beam, &tables_, /*with_attention=*/false, &buffers_);
  DTMT_PHASE_END(step_phase);
  s_ = r[1];
  return r[0];
}

// Ids never chosen; at the last step allowed for a sentence, only EOS may follow.
void BeamSearch::mask(const Tensor& log_probs, int64_t t) const {
  const int64_t n = static_cast<int64_t>(active_.size()), V = log_probs.size(1), beam = o_.beam;
  float* lp = log_probs.data_ptr<float>();
  for (const int64_t w : o_.banned)
    for (int64_t r = 0; r < n * beam; ++r) lp[r * V + w] = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (t + 1 < max_len_[active_[i]]) continue;
    for (int64_t o = 0; o < beam; ++o) {
      float* row = lp + (i * beam + o) * V;
      const float keep = row[o_.eos];
      std::fill(row, row + V, -std::numeric_limits<float>::infinity());
      row[o_.eos] = keep;
    }
  }
}

// Each sentence's K_ = 2 * beam best (beam score + word log-prob) candidates, as at::topk over them gives them.
void BeamSearch::rank(const Tensor& log_probs) {
  const int64_t n = static_cast<int64_t>(active_.size()), V = log_probs.size(1), beam = o_.beam;
  K_ = std::min<int64_t>(2 * beam, beam * V);
  const int64_t K = K_;
  top_scores_.resize(static_cast<size_t>(n * K));
  top_idx_.resize(static_cast<size_t>(n * K));
  const float* sc = scores_.data();
  const float* lp = log_probs.data_ptr<float>();
  const auto top = cpu_kernels().top_candidates;   // (this CPU's copy of the one-pass loop)
  // sentences split among threads, at least 64K candidates a task
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / (beam * V)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (K <= kMaxTopCandidates &&
          top(sc + i * beam, lp + i * beam * V, beam, V, K, &top_scores_[i * K], &top_idx_[i * K]))
        continue;
      const Tensor row_scores = at::from_blob(const_cast<float*>(sc + i * beam), {beam, 1}, at::kFloat);
      const Tensor cand = (row_scores + log_probs.narrow(0, i * beam, beam)).view({beam * V});
      auto best = at::topk(cand, K, 0);
      const Tensor v = std::get<0>(best).contiguous(), j = std::get<1>(best).contiguous();
      std::copy(v.data_ptr<float>(), v.data_ptr<float>() + K, &top_scores_[i * K]);
      std::copy(j.data_ptr<int64_t>(), j.data_ptr<int64_t>() + K, &top_idx_[i * K]);
    }
  });
}

// Each open sentence's finished hypotheses and next beam from its ranked candidates; the state moves to the rows
// kept. False when every sentence has finished.
bool BeamSearch::keep_best(int64_t t, int64_t V) {
  const int64_t n = static_cast<int64_t>(active_.size()), beam = o_.beam, K = K_, eos = o_.eos;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const float* ts = top_scores_.data();
  const int64_t* ti = top_idx_.data();
  select_.clear();
  next_words_.clear();
  still_.clear();
  next_scores_.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = active_[i];
    std::fill(new_scores_.begin(), new_scores_.end(), neg_inf);
    std::fill(new_origin_.begin(), new_origin_.end(), 0);
    std::fill(new_word_.begin(), new_word_.end(), eos);
    // a NaN candidate comes first (at::topk ranks NaN above every number; top_candidates hands NaN to it), as
    // does +inf: the model overflowed, and ranking on would give garbage (and NaN breaks the sort below)
    TORCH_CHECK_VALUE(ts[i * K] < std::numeric_limits<float>::infinity(), "dtmt._C.rnmt_beam_search: ",
                      kNonFiniteScore, " (", ts[i * K], ") at step ", t, " of sentence ", b, " of the batch");
    int64_t k = 0;
    std::vector<Hyp>& done = finished_[b];
    // in rank order: the first `beam` words other than EOS stay open; an EOS finishes its hypothesis where it
    // ranks among the `beam` best candidates (below them it is no hypothesis of the beam)
    for (int64_t c = 0; c < K && k < beam; ++c) {
      const double sc = ts[i * K + c];
      if (sc == neg_inf) break;
      const int64_t j = ti[i * K + c], o = j / V, w = j % V;
      if (w != eos) {
        new_scores_[k] = sc;
        new_origin_[k] = o;
        new_word_[k] = w;
        ++k;
      } else if (c < beam) {
        done.push_back({rows_[i * beam + o], t, sc / length_penalty(t + 1, o_.alpha, o_.length_penalty), sc});
      }
    }
    std::stable_sort(done.begin(), done.end(), [](const Hyp& x, const Hyp& y_) { return x.score > y_.score; });
    if (static_cast<int64_t>(done.size()) > beam) done.resize(beam);
    // finished when no open hypothesis can still enter the nbest (log-probs only decrease, and a penalty that grows
    // with the length is at most that of the max length; one that does not grow is taken as 1, an upper bound),
    // or, with early_stop, as soon as it is full
    const double best_open = *std::max_element(new_scores_.begin(), new_scores_.end());
    const double bound = best_open / std::max(length_penalty(max_len_[b], o_.alpha, o_.length_penalty), 1.0);
    const int64_t n_done = static_cast<int64_t>(done.size());
    if (t + 1 >= max_len_[b] || best_open == neg_inf ||
        (o_.early_stop ? n_done >= beam : n_done >= nbest_ && bound <= done[nbest_ - 1].score))
      continue;
    still_.push_back(i);
    for (int64_t o = 0; o < beam; ++o) {
      select_.push_back(i * beam + new_origin_[o]);
      next_words_.push_back(new_word_[o]);
      next_scores_.push_back(static_cast<float>(new_scores_[o]));
    }
  }
  if (still_.empty()) return false;
  prev_ = next_words_;
  s_ = gather_rows(s_, select_, state_);   // (the step's s' is its scratch's: the state is kept apart)
  if (static_cast<int64_t>(still_.size()) < n) drop_finished();
  next_rows_.clear();
  for (size_t r = 0; r < select_.size(); ++r) next_rows_.push_back(tree_.add(next_words_[r], rows_[select_[r]]));
  rows_.swap(next_rows_);
  scores_.swap(next_scores_);
  return true;
}

// The sentences that finished at this step leave the source tensors and the tables read per sentence.
void BeamSearch::drop_finished() {
  const Tensor kept = to_tensor(still_);
  annotations_ = annotations_.index_select(0, kept);
  keys_ = keys_.index_select(0, kept);
  if (tables_.key_exps.defined()) tables_.key_exps = tables_.key_exps.index_select(0, kept);
  src_mask_ = src_mask_.index_select(0, kept);
  std::vector<int64_t> next_active;
  for (int64_t i : still_) next_active.push_back(active_[i]);
  active_.swap(next_active);
  if (source_products_) source_products_->block = active_;
}

std::vector<Tensor> BeamSearch::results() const {
  std::vector<int64_t> counts, lengths, tokens;
  std::vector<double> hyp_scores, hyp_log_probs;
  for (const auto& done : finished_) {
    counts.push_back(static_cast<int64_t>(done.size()));
    for (const Hyp& h : done) {
      lengths.push_back(h.length);
      tree_.read(h.node, h.length, tokens);
      hyp_scores.push_back(h.score);
      hyp_log_probs.push_back(h.log_prob);
    }
  }
  return {to_tensor(counts), to_tensor(lengths), to_tensor(tokens), to_tensor(hyp_scores),
          to_tensor(hyp_log_probs)};
}

}  // namespace

std::vector<Tensor> rnmt_beam_search_cpu(const SearchSource& source, const SearchModel& model,
                                         const SearchSettings& settings) {
  DTMT_PHASE_START(search_phase, search);
  BeamSearch search(source, model, settings);
  auto out = search.run();
  DTMT_PHASE_END(search_phase);
  return out;
}

}  // namespace dtmt
