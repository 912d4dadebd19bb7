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

// GNMT's lp(y) = ((5 + |y|) / 6) ^ alpha, in double as Python's floats (beam_search.length_penalty).
double length_penalty(int64_t length, double alpha) {
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

}  // namespace

std::vector<Tensor> rnmt_beam_search_cpu(const Tensor& annotations0, const Tensor& keys0, const Tensor& src_mask0,
                                         const Tensor& s0, const Tensor& embed, const Tensor& positions,
                                         const TransitionWeights& query_cell, const TransitionWeights& decoder_cell,
                                         double cell_eps, const AttentionWeights& attention,
                                         const ReadoutWeights& readout, int64_t beam, double alpha,
                                         const Tensor& max_len, int64_t bos, int64_t eos, bool step_tables,
                                         bool early_stop, const Tensor& token_products,
                                         const Tensor& position_products, const Tensor& context_heads,
                                         std::optional<int64_t> nbest_given, const std::vector<int64_t>& banned) {
  DTMT_PHASE_START(search_phase, search);
  DTMT_PHASE_START(setup_phase, search_setup);
  TORCH_CHECK(s0.dim() == 2 && annotations0.dim() == 3 && keys0.dim() == 4 && src_mask0.dim() == 2 &&
                  embed.dim() == 2 && max_len.dim() == 1,
              "dtmt._C.rnmt_beam_search: annotations [B, S, C], keys [B, S, NH, D], src_mask [B, S], s [B, H], "
              "embed [V, E] and max_len [B] expected");
  const int64_t B = s0.size(0);
  TORCH_CHECK(annotations0.size(0) == B && keys0.size(0) == B && src_mask0.size(0) == B && max_len.size(0) == B,
              "dtmt._C.rnmt_beam_search: the state's tensors and max_len must have the same batch size");
  TORCH_CHECK(beam >= 1 && beam <= kMaxBeam, "dtmt._C.rnmt_beam_search: beam must be in [1, ", kMaxBeam, "], got ",
              beam);
  const int64_t nbest = nbest_given.value_or(beam);
  TORCH_CHECK(nbest >= 1 && nbest <= beam, "dtmt._C.rnmt_beam_search: need 1 <= nbest <= beam, got nbest=", nbest,
              ", beam=", beam);
  const int64_t V = embed.size(0);
  TORCH_CHECK(readout.w_out.size(0) == V, "dtmt._C.rnmt_beam_search: the output layer's ", readout.w_out.size(0),
              " words and the target embedding's ", V, " must be the same");
  TORCH_CHECK(bos >= 0 && bos < V && eos >= 0 && eos < V, "dtmt._C.rnmt_beam_search: bos ", bos, " and eos ", eos,
              " must be words of the ", V);
  for (const int64_t w : banned)   // (the step's output words are the target embedding's rows)
    TORCH_CHECK(w >= 0 && w < embed.size(0) && w != eos, "dtmt._C.rnmt_beam_search: banned id ", w,
                " must be a word of the ", embed.size(0), " other than EOS");
  const Tensor max_len_cpu = max_len.to(at::kLong).contiguous();
  const std::vector<int64_t> max_len_list(max_len_cpu.data_ptr<int64_t>(), max_len_cpu.data_ptr<int64_t>() + B);
  int64_t steps = 0;
  for (int64_t m : max_len_list) {
    TORCH_CHECK(m >= 1 && m <= kMaxSearchSteps, "dtmt._C.rnmt_beam_search: max_len must be in [1, ",
                kMaxSearchSteps, "] (op_checks.h), got ", m);
    steps = std::max(steps, m);
  }
  const bool positional = positions.defined() && positions.numel() > 0;
  TORCH_CHECK(!positional || (positions.dim() == 2 && positions.size(0) >= steps && positions.size(1) == embed.size(1)),
              "dtmt._C.rnmt_beam_search: positions must be [>= max(max_len), E]");
  const double neg_inf = -std::numeric_limits<double>::infinity();

  // the decoder state repeated beam times; all beams start identical, so only the first one is open. The source
  // tensors stay one row a sentence: a sentence's beam rows share them (rnmt_step_cpu's group).
  const Tensor start = at::arange(B, at::kLong).repeat_interleave(beam);
  Tensor annotations = annotations0.contiguous(), keys = keys0.contiguous(), src_mask = src_mask0.contiguous(),
         s = s0.index_select(0, start);
  // each row's score (float, as the Python loop keeps them), a sentence's beam rows together
  std::vector<float> scores(static_cast<size_t>(B * beam), -std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < B; ++b) scores[b * beam] = 0.0f;
  Tree tree;
  std::vector<int64_t> rows(B * beam, -1), next_rows;   // each row's node in the tree (all t tokens long at step t)
  std::vector<int64_t> prev(B * beam, bos);
  std::vector<std::vector<Hyp>> finished(B);
  std::vector<int64_t> active(B);  // the open sentences, in the order of the state's row groups
  for (int64_t b = 0; b < B; ++b) active[b] = b;
  // what the steps read instead of recomputing it, made once per sentence where it applies (decided here, for the
  // whole search): the context's products where they pay, the keys' exponentials
  std::optional<SourceProducts> source;
  StepTables tables;
  const int64_t NH = keys.size(2);
  if (step_tables && source_products_pay(annotations, NH, decoder_cell, attention, readout)) {
    source = source_products_cpu(annotations, NH, decoder_cell.w_ih, decoder_cell.b_ih, readout.w_c, readout.b_c,
                                 context_heads);
    tables.source = &*source;
  }
  if (step_tables) tables.key_exps = key_exps_cpu(keys);
  // the previous token's products from the model's tables, where they were given for this model (and its positions)
  std::optional<TokenProducts> token_tables;
  const bool position_tables = position_products.defined() && position_products.numel() > 0;
  if (step_tables && positional == position_tables && token_products.dim() == 2 &&
      token_products.size(0) == embed.size(0))
    token_tables = token_products_cpu(token_products, position_products, steps, query_cell, readout);

  const Tensor table = embed.contiguous(), positions_c = positional ? positions.contiguous() : Tensor();
  StepBuffers buffers;
  Tensor state;   // the decoder state carried from one step to the next (gather_rows)
  std::vector<float> top_scores;
  std::vector<int64_t> top_idx;
  // a step's decisions (kept across steps, cleared at each: no allocation a step once they have grown)
  std::vector<int64_t> select, next_words, still;
  std::vector<float> next_scores;
  std::vector<double> new_scores(beam);
  std::vector<int64_t> new_origin(beam), new_word(beam);
  DTMT_PHASE_END(setup_phase);
  for (int64_t t = 0; t < steps; ++t) {
    buffers.scratch.rewind();   // (the state s carried from the last step is not in it: `state`)
    DTMT_PHASE_START(rows_phase, token_rows);
    Tensor y;
    if (token_tables) {
      std::vector<Tensor> y_products = token_tables->rows(prev, t, &buffers.scratch);
      tables.y_cell = y_products[0];
      tables.y_readout = y_products[1];
    } else {
      y = embed_previous(table, positions_c, prev, t);
    }
    DTMT_PHASE_END(rows_phase);
    DTMT_PHASE_START(step_phase, step);
    auto r = rnmt_step_cpu(y, s, keys, annotations, src_mask, query_cell, decoder_cell, cell_eps, attention, readout,
                           beam, &tables, /*with_attention=*/false, &buffers);
    DTMT_PHASE_END(step_phase);
    DTMT_PHASE_START(eos_phase, eos_mask);
    s = r[1];
    const int64_t n = static_cast<int64_t>(active.size()), V = r[0].size(1);
    // [n * beam, V] float32 (the step's own buffer for a float model: the masking below writes into it)
    const Tensor log_probs = r[0].scalar_type() == at::kFloat ? r[0] : r[0].to(at::kFloat);
    {  // ids never chosen; at the last step allowed for a sentence, only EOS may follow
      float* lp = log_probs.data_ptr<float>();
      for (const int64_t w : banned)
        for (int64_t r = 0; r < n * beam; ++r) lp[r * V + w] = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        if (t + 1 < max_len_list[active[i]]) continue;
        for (int64_t o = 0; o < beam; ++o) {
          float* row = lp + (i * beam + o) * V;
          const float keep = row[eos];
          std::fill(row, row + V, -std::numeric_limits<float>::infinity());
          row[eos] = keep;
        }
      }
    }
    DTMT_PHASE_END(eos_phase);
    DTMT_PHASE_START(top_phase, top_candidates);
    // each sentence's 2 * beam best (beam score + word log-prob) candidates, as at::topk over them gives them
    const int64_t K = std::min<int64_t>(2 * beam, beam * V);
    top_scores.resize(static_cast<size_t>(n * K));
    top_idx.resize(static_cast<size_t>(n * K));
    {
      const float* sc = scores.data();
      const float* lp = log_probs.data_ptr<float>();
      const auto top = cpu_kernels().top_candidates;   // (this CPU's copy of the one-pass loop)
      // sentences split among threads, at least 64K candidates a task
      at::parallel_for(0, n, std::max<int64_t>(1, 65536 / (beam * V)), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          if (K <= kMaxTopCandidates &&
              top(sc + i * beam, lp + i * beam * V, beam, V, K, &top_scores[i * K], &top_idx[i * K]))
            continue;
          const Tensor row_scores = at::from_blob(const_cast<float*>(sc + i * beam), {beam, 1}, at::kFloat);
          const Tensor cand = (row_scores + log_probs.narrow(0, i * beam, beam)).view({beam * V});
          auto top = at::topk(cand, K, 0);
          const Tensor v = std::get<0>(top).contiguous(), j = std::get<1>(top).contiguous();
          std::copy(v.data_ptr<float>(), v.data_ptr<float>() + K, &top_scores[i * K]);
          std::copy(j.data_ptr<int64_t>(), j.data_ptr<int64_t>() + K, &top_idx[i * K]);
        }
      });
    }
    DTMT_PHASE_END(top_phase);
    DTMT_PHASE_START(bookkeeping_phase, bookkeeping);
    const float* ts = top_scores.data();
    const int64_t* ti = top_idx.data();

    select.clear();
    next_words.clear();
    still.clear();
    next_scores.clear();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = active[i];
      std::fill(new_scores.begin(), new_scores.end(), neg_inf);
      std::fill(new_origin.begin(), new_origin.end(), 0);
      std::fill(new_word.begin(), new_word.end(), eos);
      // a NaN candidate comes first (at::topk ranks NaN above every number; top_candidates hands NaN to it), as
      // does +inf: the model overflowed, and ranking on would give garbage (and NaN breaks the sort below)
      TORCH_CHECK_VALUE(ts[i * K] < std::numeric_limits<float>::infinity(), "dtmt._C.rnmt_beam_search: ", kNonFiniteScore,
                        " (", ts[i * K], ") at step ", t, " of sentence ", b, " of the batch");
      int64_t k = 0;
      std::vector<Hyp>& done = finished[b];
      for (int64_t c = 0; c < K; ++c) {
        const double sc = ts[i * K + c];
        if (sc == neg_inf) break;
        const int64_t j = ti[i * K + c], o = j / V, w = j % V;
        if (w == eos) {
          done.push_back({rows[i * beam + o], t, sc / length_penalty(t + 1, alpha), sc});
        } else if (k < beam) {
          new_scores[k] = sc;
          new_origin[k] = o;
          new_word[k] = w;
          ++k;
        }
        if (k == beam && static_cast<int64_t>(done.size()) >= beam) break;
      }
      std::stable_sort(done.begin(), done.end(), [](const Hyp& x, const Hyp& y_) { return x.score > y_.score; });
      if (static_cast<int64_t>(done.size()) > beam) done.resize(beam);
      // finished when no open hypothesis can still enter the nbest (log-probs only decrease; the length penalty
      // is at most that of the max length), or, with early_stop, as soon as it is full
      const double best_open = *std::max_element(new_scores.begin(), new_scores.end());
      const double bound = alpha > 0 ? best_open / length_penalty(max_len_list[b], alpha) : best_open;
      const int64_t n_done = static_cast<int64_t>(done.size());
      if (t + 1 >= max_len_list[b] || best_open == neg_inf ||
          (early_stop ? n_done >= beam : n_done >= nbest && bound <= done[nbest - 1].score))
        continue;
      still.push_back(i);
      for (int64_t o = 0; o < beam; ++o) {
        select.push_back(i * beam + new_origin[o]);
        next_words.push_back(new_word[o]);
        next_scores.push_back(static_cast<float>(new_scores[o]));
      }
    }
    if (still.empty()) {
      DTMT_PHASE_END(bookkeeping_phase);
      break;
    }
    prev = next_words;
    s = gather_rows(s, select, state);   // (the step's s' is its scratch's: the state is kept apart)
    if (static_cast<int64_t>(still.size()) < n) {  // finished sentences leave the state
      const Tensor kept = to_tensor(still);
      annotations = annotations.index_select(0, kept);
      keys = keys.index_select(0, kept);
      if (tables.key_exps.defined()) tables.key_exps = tables.key_exps.index_select(0, kept);
      src_mask = src_mask.index_select(0, kept);
      std::vector<int64_t> next_active;
      for (int64_t i : still) next_active.push_back(active[i]);
      active.swap(next_active);
      if (source) source->block = active;
    }
    next_rows.clear();
    for (size_t r_ = 0; r_ < select.size(); ++r_) next_rows.push_back(tree.add(next_words[r_], rows[select[r_]]));
    rows.swap(next_rows);
    scores.swap(next_scores);
    DTMT_PHASE_END(bookkeeping_phase);
  }

  std::vector<int64_t> counts, lengths, tokens;
  std::vector<double> hyp_scores, hyp_log_probs;
  for (const auto& done : finished) {
    counts.push_back(static_cast<int64_t>(done.size()));
    for (const Hyp& h : done) {
      lengths.push_back(h.length);
      tree.read(h.node, h.length, tokens);
      hyp_scores.push_back(h.score);
      hyp_log_probs.push_back(h.log_prob);
    }
  }
  DTMT_PHASE_END(search_phase);
  return {to_tensor(counts), to_tensor(lengths), to_tensor(tokens), to_tensor(hyp_scores),
          to_tensor(hyp_log_probs)};
}

}  // namespace dtmt
