"""The engine's ops: a decoder step's inference work (beam search: no autograd; one call in place of a dozen small
PyTorch ops) as torch.library custom ops with C++ CPU kernels (csrc/engine/decode_step_cpu.cpp,
csrc/engine/beam_search_cpu.cpp), their fakes, the named weight structures they take (each mirrors a struct of
csrc/engine/decode_step.h) and the functions that call them:

    torch.ops.dtmt.attention_step     one (multi-head) additive attention step, query projection to output
    torch.ops.dtmt.readout_features   the readout's tanh(LN(.) + LN(.) + LN(.))
    torch.ops.dtmt.rnmt_step          one whole attentional RNMT decoder step, to the log-probabilities
    torch.ops.dtmt.rnmt_beam_search   beam search over rnmt_step, the whole loop of decoding.beam_search in one call
    torch.ops.dtmt.memory_encoder     one direction of mce's read-write-memory encoder

plus the weights' preparations: fold_context_projection (the attention's output projection folded into the two
matrices that read the context), token_products and context_heads (rnmt_beam_search's tables) and
step_weights_on_huge_pages. Their references are the modules they stand in for (dtmt_models.models), against which
tests/test_decode_kernels.py and the systems' tests hold them. The kernels' general pieces they use (the small-row
and int8 products, huge pages) are dtmt_kernels.ops.linear's."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from dtmt_kernels.ops import _autocast
from dtmt_kernels.ops._extension import built
from dtmt_kernels.ops._register import register_fake
from dtmt_kernels.ops.linear.op import float64_products
from dtmt_kernels.ops.linear.placement import huge_page_copies
from dtmt_kernels.ops.linear.quantize import pack_int8_rows

_ABSENT = torch.empty(0, device="cpu")   # what the C++ inference ops take for an absent tensor (they test numel() == 0)
# the most steps a search takes (csrc/op_checks.h's kMaxSearchSteps, which rnmt_beam_search checks): max_len is bounded
# by it on every path, so a model that rarely ends a sentence and a huge max_len_b make a long translation, not a search
# running for hours (dtmt_models.decoding re-exports it)
MAX_SEARCH_STEPS = 16384


def _or_none(t: Optional[Tensor]) -> Tensor:
    return _ABSENT if t is None else t


class _InferenceWeights:
    """Base of the named weight structures of the inference ops: each mirrors a struct of csrc/engine/decode_step.h
    (its tensor fields in the same order: `tensor_fields()`, which a test holds equal to the extension's
    `_C.<NAME>_WEIGHT_FIELDS`), and keeps its tensors as the list the op takes (`tensors`, absent ones empty),
    made once. Fields named ...eps are the ops' float arguments, not tensors."""

    @classmethod
    def tensor_fields(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if not f.name.endswith("eps"))

    def __post_init__(self):
        object.__setattr__(self, "tensors", [_or_none(getattr(self, name)) for name in self.tensor_fields()])

    MATRICES: ClassVar[Tuple[str, ...]] = ()   # the fields that are weight matrices (what int8() quantizes)

    def int8(self):
        """A copy with every weight matrix (MATRICES) as int8 rows (dtmt_kernels.ops.linear.quantize.pack_int8_rows:
        one float32 scale per output row; the ops multiply them by int8 activations, linear.quantize.linear_int8);
        vectors and layer norms stay float. For CPU float32 decoding."""
        return replace(self, **{name: pack_int8_rows(getattr(self, name)) for name in self.MATRICES
                                if getattr(self, name) is not None})


@dataclass(frozen=True, eq=False)
class AttentionWeights(_InferenceWeights):
    """(Multi-head) additive attention for `attention_step`: w_q [NH*D, Q], v [NH, D]; the output projection w_o
    [C', C], b_o [C'] (multi-head attention) or None; the query's layer norm ln_w, ln_b [NH*D] and its eps
    (Nematus' attention) or None."""
    w_q: Tensor
    v: Tensor
    w_o: Optional[Tensor] = None
    b_o: Optional[Tensor] = None
    ln_w: Optional[Tensor] = None
    ln_b: Optional[Tensor] = None
    ln_eps: float = 1e-5
    MATRICES = ("w_q", "w_o")


@dataclass(frozen=True, eq=False)
class ReadoutWeights(_InferenceWeights):
    """The Readout for `readout_features` and `rnmt_step`: w_y [R, E], w_s [R, Hs], w_c [R, C] and their biases
    (or None); the three layer norms' gains and offsets stacked, ln_w, ln_b [3, R] (or None) and their one eps;
    the output projection w_out [V, R], b_out [V] (`rnmt_step` only; None where the readout has more layers)."""
    w_y: Tensor
    b_y: Optional[Tensor]
    w_s: Tensor
    b_s: Optional[Tensor]
    w_c: Tensor
    b_c: Optional[Tensor]
    ln_w: Optional[Tensor] = None
    ln_b: Optional[Tensor] = None
    w_out: Optional[Tensor] = None
    b_out: Optional[Tensor] = None
    eps: float = 1e-5
    MATRICES = ("w_y", "w_s", "w_c", "w_out")


@dataclass(frozen=True, eq=False)
class MemoryWeights(_InferenceWeights):
    """mce's memory addressing for `memory_encoder` (dtmt_models/models/systems/mce.py): w_state [H, H],
    w_memory [H, H], b_memory [H], v [1, H], w_read [H, H], b_read [H], w_write [H, H], b_write [H]."""
    w_state: Tensor
    w_memory: Tensor
    b_memory: Tensor
    v: Tensor
    w_read: Tensor
    b_read: Tensor
    w_write: Tensor
    b_write: Tensor


@dataclass(frozen=True, eq=False)
class CellWeights:
    """A recurrent cell as `rnmt_step` takes it, what engine.forms.FrozenTransitionCell gathers: the kernel's
    cell `kind`, the ten flat kernel parameters (dtmt_kernels.ops.transition.flat_params order, absent ones empty) and
    the layer norms' `eps`."""
    kind: int
    params: Sequence[Tensor]
    eps: float

    MATRICES = (0, 2, 6)   # w_ih, w_hh, t_w [D, 3H, H] in the flat order

    @classmethod
    def of(cls, cell) -> "CellWeights":
        return cls(cell.kind, list(cell.params), cell.eps)

    def int8(self) -> "CellWeights":
        """A copy with the matrices w_ih, w_hh and t_w as int8 rows (see _InferenceWeights.int8); biases and layer
        norms stay float."""
        return CellWeights(self.kind, [pack_int8_rows(p) if i in self.MATRICES and p.numel() else p
                                       for i, p in enumerate(self.params)], self.eps)


def fold_context_projection(attention: AttentionWeights, decoder_cell, readout: ReadoutWeights):
    """(attention, decoder_cell, readout) for `rnmt_step` with the attention's output projection folded into the two
    matrices that read the context, where it has one (w_o, b_o: multi-head attention); else the three unchanged.
    Both are linear in c' = c W_o^T + b_o: c' W^T + b = c (W W_o)^T + (b + W b_o), so the decoder cell's input
    matrix (its flat w_ih, b_ih) and the readout's context matrix (w_c, b_c) become W W_o and b + W b_o, of the
    same shapes, and a step multiplies by two matrices instead of three. Computed in float64 and rounded once to
    the weights' dtype: the step equals the unfolded one up to that rounding. `decoder_cell`: a
    FrozenTransitionCell or CellWeights of float weights (fold before int8()); returns CellWeights."""
    cell = CellWeights.of(decoder_cell) if not isinstance(decoder_cell, CellWeights) else decoder_cell
    if attention.w_o is None:
        return attention, cell, readout
    w_o = attention.w_o.detach().double()
    b_o = None if attention.b_o is None else attention.b_o.detach().double()

    def fold(w: Tensor, b: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        wd = w.detach().double()
        bias = None if b is None or b.numel() == 0 else b.detach().double()
        if b_o is not None:
            bias = wd @ b_o if bias is None else bias + wd @ b_o
        return (wd @ w_o).to(w.dtype), None if bias is None else bias.to(w.dtype)

    params = list(cell.params)
    params[0], b_ih = fold(params[0], params[1])
    params[1] = params[0].new_empty(0) if b_ih is None else b_ih
    w_c, b_c = fold(readout.w_c, readout.b_c)
    return (replace(attention, w_o=None, b_o=None), CellWeights(cell.kind, params, cell.eps),
            replace(readout, w_c=w_c, b_c=b_c))


# The largest token table `token_products` makes (bytes): past it (large vocabularies and models) the steps read the
# matrices as before.
TOKEN_TABLE_BYTES = 64 << 20


def token_products(rows: Tensor, query_cell, readout: ReadoutWeights) -> Optional[Tensor]:
    """The previous token's products as a table (csrc/engine/decode_step.h, TokenProducts): for embedding rows [n, E]
    (the target embedding, or its position rows) the query cell's input products and the readout's y products, rows W^T
    [n, N_q + R] with W = [query cell's w_ih; readout's w_y] (no biases: the step adds them), computed in float64 and
    rounded once to the weights' dtype, for `rnmt_beam_search`'s token_products / position_products. None where they do
    not apply: weights that are not float32 / float64 CPU matrices of the rows' width (int8 rows), or a table past
    TOKEN_TABLE_BYTES."""
    cell = query_cell if isinstance(query_cell, CellWeights) else CellWeights.of(query_cell)
    w_ih, w_y = cell.params[0], readout.w_y
    if not all(w.dtype in (torch.float32, torch.float64) and w.dtype == rows.dtype and w.device.type == "cpu" and
               w.dim() == 2 and w.shape[1] == rows.shape[1] for w in (w_ih, w_y)):
        return None
    if rows.shape[0] * (w_ih.shape[0] + w_y.shape[0]) * rows.element_size() > TOKEN_TABLE_BYTES:
        return None
    return float64_products(rows, (w_ih, w_y))


def context_heads(decoder_cell, readout: ReadoutWeights, heads: int) -> Optional[Tensor]:
    """The two matrices that read the context, per head, for `rnmt_beam_search`'s context_heads: W = [decoder cell's
    w_ih; readout's w_c] [N, C] as W[:, h] [heads, C / heads, N] (contiguous), made once per decoder. A search's
    products of the annotations with them (csrc/engine/decode_step.h, SourceProducts) are then one batched GEMM on this
    tensor, instead of a concatenation of the two matrices and a GEMM on a strided view of it every sentence.
    None where they do not apply: not float32 / float64 CPU matrices of one width and dtype (int8 rows), or a width
    the heads do not divide."""
    cell = decoder_cell if isinstance(decoder_cell, CellWeights) else CellWeights.of(decoder_cell)
    w_ih, w_c = cell.params[0], readout.w_c
    if not (heads >= 1 and all(w is not None and w.dim() == 2 and w.dtype in (torch.float32, torch.float64) and
                               w.device.type == "cpu" for w in (w_ih, w_c))
            and w_ih.dtype == w_c.dtype and w_ih.shape[1] == w_c.shape[1] and w_ih.shape[1] % heads == 0):
        return None
    with torch.no_grad():
        w = torch.cat([w_ih, w_c])
        return w.view(w.shape[0], heads, -1).permute(1, 2, 0).contiguous()


def step_weights_on_huge_pages(query_cell, decoder_cell, attention: AttentionWeights, readout: ReadoutWeights):
    """(query_cell, decoder_cell, attention, readout) for `rnmt_step` / `rnmt_beam_search` with every tensor
    copied, in the order a step reads them, into one buffer of 2 MiB pages (linear.placement.huge_page_copies:
    fewer TLB misses while a step streams its ~10 MB of weights; the same values, so the same results). The cells
    (FrozenTransitionCell or CellWeights, float or int8) come back as CellWeights; where huge pages are not offered
    the tensors are the same ones."""
    cells = [c if isinstance(c, CellWeights) else CellWeights.of(c) for c in (query_cell, decoder_cell)]
    names = [[n for n in w.tensor_fields() if getattr(w, n) is not None] for w in (attention, readout)]
    groups = [list(cells[0].params), [getattr(attention, n) for n in names[0]], list(cells[1].params),
              [getattr(readout, n) for n in names[1]]]
    copies = iter(huge_page_copies([t for g in groups for t in g]))
    q, a, d, r = ([next(copies) for _ in g] for g in groups)
    return (CellWeights(cells[0].kind, q, cells[0].eps), CellWeights(cells[1].kind, d, cells[1].eps),
            replace(attention, **dict(zip(names[0], a))), replace(readout, **dict(zip(names[1], r))))


def attention_step(query: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor, weights: AttentionWeights):
    """Inference only (no autograd; CPU float32 / float64): one step of (multi-head) additive attention in one
    C++ call, what MultiHeadAdditiveAttention / AdditiveAttention compute in a dozen ops: q = query W_q^T,
    layer-normalised over all its NH*D features when the weights have ln_w / ln_b (Nematus), split into heads;
    scores = additive_scores(keys, q, v), alpha = softmax over the source positions where src_mask is true (0
    elsewhere), context = attention_context(alpha, annotations), then context W_o^T + b_o when w_o is given.
    query [B, Q], keys [B, S, NH, D], annotations [B, S, C], src_mask [B, S] bool -> (context, alpha [B, NH, S])."""
    context, alpha = torch.ops.dtmt.attention_step(query, keys, annotations, src_mask, weights.tensors, weights.ln_eps)
    return context, alpha


def readout_features(y: Tensor, s: Tensor, c: Tensor, weights: ReadoutWeights) -> Tensor:
    """Inference only: tanh(LN_y(y W_y^T + b_y) + LN_s(s W_s^T + b_s) + LN_c(c W_c^T + b_c)) in one C++ call (the
    Readout's features; no layer norm where the weights have none). y [..., E], s [..., Hs], c [..., C] with the
    same leading dims -> [..., R]."""
    lead = y.shape[:-1]
    out = torch.ops.dtmt.readout_features(y.reshape(-1, y.shape[-1]), s.reshape(-1, s.shape[-1]), c.reshape(-1, c.shape[-1]),
                              weights.tensors, weights.eps)
    return out.view(*lead, weights.w_y.shape[0])


def rnmt_step(y: Tensor, s: Tensor, keys: Tensor, annotations: Tensor, src_mask: Tensor, query_cell, decoder_cell,
              attention: AttentionWeights, readout: ReadoutWeights):
    """Inference only: one whole step of the attentional RNMT decoder in one C++ call (dtmt_models.models.rnmt's
    FusedRNMTDecoder, for AttentionalRNMT and one-level Nematus): query cell, attention_step, decoder cell,
    readout_features, output projection (readout.w_out) and log-softmax. y [B, E] the embedded previous tokens,
    s [B, H]; keys [B, S, NH, D], annotations, src_mask as attention_step's; query_cell / decoder_cell:
    engine.forms.FrozenTransitionCell (a cell's kernel parameters gathered once) or CellWeights, with the same
    eps. Returns (log_probs [B, V], float32 at least; s' [B, H]; the attention weights averaged over the heads
    [B, S]). Any weight matrix may be int8 rows (the weights' int8(): CPU float32 only)."""
    log_probs, s_new, alpha = torch.ops.dtmt.rnmt_step(y, s, keys, annotations, src_mask, query_cell.kind, query_cell.params,
                                           decoder_cell.kind, decoder_cell.params, query_cell.eps, attention.tensors,
                                           attention.ln_eps, readout.tensors, readout.eps)
    return log_probs, s_new, alpha


def rnmt_beam_search(annotations: Tensor, keys: Tensor, src_mask: Tensor, s: Tensor, embed: Tensor,
                     positions: Optional[Tensor], query_cell, decoder_cell, attention: AttentionWeights,
                     readout: ReadoutWeights, beam: int, alpha: float, max_len: Tensor, bos: int, eos: int,
                     step_tables: bool = False, early_stop: bool = False, token_table: Optional[Tensor] = None,
                     position_table: Optional[Tensor] = None, context_table: Optional[Tensor] = None,
                     nbest: Optional[int] = None, banned: Optional[List[int]] = None, penalty: str = "gnmt"
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Inference only: beam search over `rnmt_step` in one C++ call, the loop of dtmt_models.decoding.beam_search
    (its reference: the same hypotheses, scores and order) with no Python between steps. The decoder state as
    `encode` makes it, one row a sentence: annotations [B, S, C], keys [B, S, NH, D], src_mask [B, S] bool, s [B, H].
    The previous token is embedded as embed[token] + positions[t] at step t (positions [>= max(max_len), E], or
    None). max_len [B]: the steps a sentence may take, EOS included. Returns (counts [B], lengths [N], tokens,
    scores [N], log_probs [N]): sentence b's finished hypotheses, best first, are the counts[b] after those of the
    sentences before it, each `lengths` tokens long (without BOS and EOS); scores and log-probabilities float64.
    `step_tables`: the steps read what the search makes once per sentence instead of recomputing it
    (csrc/engine/decode_step.h, StepTables): where the attention has no output projection (after
    fold_context_projection) and the sources are short enough for it to pay (B * heads * S <= C / 2), the context
    through its products with the two matrices that multiply it (SourceProducts); the attention scores from the keys'
    exponentials where the keys and queries are within +-20 (key_exps); and with `token_table` (token_products(embed,
    ...)) and, exactly where `positions` is given, `position_table` (token_products(positions, ...), >= max(max_len)
    rows), the previous token's products from those tables instead of its embedding (TokenProducts); with
    `context_table` (context_heads(decoder_cell, readout, heads)), the context's products made from it. The same sums in
    another order, so the same search up to rounding. False: rnmt_step's arithmetic exactly. `early_stop`: a sentence
    ends as soon as it has `beam` finished hypotheses (beam_search's `early_stop`). Otherwise it ends once no open
    hypothesis can enter its `nbest` best finished ones (1 <= nbest <= beam; None: beam), so that those are exactly what
    a search run to max length would return (beam_search's `nbest`). `banned`: ids never chosen; beam_search passes
    [pad_id, BOS] (its reference loop's mask), None bans nothing. `penalty`: the length penalty the scores are
    ranked by, "gnmt" (with alpha) or "average" (dtmt_models.decoding.hypotheses.length_penalty)."""
    return torch.ops.dtmt.rnmt_beam_search(annotations, keys, src_mask, s, embed, positions, query_cell.kind,
                                           query_cell.params, decoder_cell.kind, decoder_cell.params, query_cell.eps,
                                           attention.tensors, attention.ln_eps, readout.tensors, readout.eps, beam,
                                           alpha, max_len, bos, eos, step_tables, early_stop, token_table,
                                           position_table, context_table, nbest, banned, penalty)


def memory_encoder(x: Tensor, memory: Tensor, src_mask: Tensor, reverse: bool, cell, addressing: MemoryWeights):
    """Inference only: one direction of mce's read-write-memory GRU encoder (dtmt_models/models/systems/mce.py) over the
    whole source in one C++ call. x [B, S, E], memory [B, S, H], src_mask [B, S] bool, cell: the direction's
    engine.forms.FrozenTransitionCell. Returns (states [B, S, H], final memory [B, S, H])."""
    states, final = torch.ops.dtmt.memory_encoder(x.contiguous(), memory, src_mask, reverse, cell.kind, cell.params, cell.eps,
                                      addressing.tensors)
    return states, final


def _fake_check(op: str, kinds=(), **shapes) -> None:
    """The fakes' share of the kernels' checks (a fake is all that a meta call or a torch.compile / export trace
    runs): every cell kind known, and each tensor of `shapes` (name=(tensor, [sizes]), None a size not checked) of
    those sizes. RuntimeError naming the argument, as the kernels'."""
    from dtmt_kernels.ops.transition.layout import check_kind

    for name, kind in kinds:
        check_kind(op, kind, name)
    for name, (t, sizes) in shapes.items():
        if t.dim() != len(sizes) or any(want is not None and got != want for got, want in zip(t.shape, sizes)):
            shown = ", ".join("?" if want is None else str(want) for want in sizes)
            raise RuntimeError(f"dtmt::{op}: {name} must be [{shown}], got {list(t.shape)}")


def _attention_step_fake(query, keys, annotations, src_mask, weights, ln_eps, key_exps=None):
    _fake_check("attention_step", src_mask=(src_mask, [None, None]))
    B, S = src_mask.shape
    _fake_check("attention_step", query=(query, [B, None]), keys=(keys, [B, S, None, None]),
                annotations=(annotations, [B, S, None]))
    B, S, NH, _ = keys.shape
    w_o = weights[2]
    C = w_o.shape[0] if w_o.numel() else annotations.shape[2]
    return query.new_empty(B, C), query.new_empty(B, NH, S)


def _readout_fake(y, s, c, weights, eps):
    _fake_check("readout_features", y=(y, [None, None]))
    _fake_check("readout_features", s=(s, [y.shape[0], None]), c=(c, [y.shape[0], None]))
    return y.new_empty(y.shape[0], weights[0].shape[0])


def _rnmt_step_fake(y, s, keys, annotations, src_mask, q_kind, q_params, d_kind, d_params, cell_eps, attention,
                    att_eps, readout, readout_eps):
    _fake_check("rnmt_step", (("q_kind", q_kind), ("d_kind", d_kind)), src_mask=(src_mask, [None, None]))
    B, S = src_mask.shape
    _fake_check("rnmt_step", y=(y, [B, None]), s=(s, [B, None]), keys=(keys, [B, S, None, None]),
                annotations=(annotations, [B, S, None]))
    V = readout[8].shape[0]
    return (y.new_empty(B, V, dtype=torch.promote_types(y.dtype, torch.float32)), s.new_empty(s.shape),
            y.new_empty(B, S))


def _rnmt_beam_search_fake(annotations, keys, src_mask, s, embed, positions, q_kind, q_params, d_kind, d_params,
                           cell_eps, attention, att_eps, readout, readout_eps, beam, alpha, max_len, bos, eos,
                           step_tables=False, early_stop=False, token_products=None, position_products=None,
                           context_heads=None, nbest=None, banned=None, length_penalty="gnmt"):
    _fake_check("rnmt_beam_search", (("q_kind", q_kind), ("d_kind", d_kind)), src_mask=(src_mask, [None, None]))
    B, S = src_mask.shape
    _fake_check("rnmt_beam_search", s=(s, [B, None]), keys=(keys, [B, S, None, None]),
                annotations=(annotations, [B, S, None]), max_len=(max_len, [B]))
    ctx = torch.library.get_ctx()
    n, tokens = ctx.new_dynamic_size(), ctx.new_dynamic_size()   # how many hypotheses and tokens: data-dependent
    long, double = dict(dtype=torch.long), dict(dtype=torch.float64)
    return (max_len.new_empty(s.shape[0], **long), max_len.new_empty(n, **long), max_len.new_empty(tokens, **long),
            max_len.new_empty(n, **double), max_len.new_empty(n, **double))


def _memory_encoder_fake(x, memory, src_mask, reverse, cell_kind, cell, cell_eps, addressing):
    _fake_check("memory_encoder", (("cell_kind", cell_kind),), src_mask=(src_mask, [None, None]))
    B, S = src_mask.shape
    _fake_check("memory_encoder", x=(x, [B, S, None]), memory=(memory, [B, S, None]))
    return x.new_empty(memory.shape), torch.empty_like(memory, memory_format=torch.contiguous_format)


if built():
    register_fake("dtmt::attention_step", _attention_step_fake)
    register_fake("dtmt::readout_features", _readout_fake)
    register_fake("dtmt::rnmt_step", _rnmt_step_fake)
    register_fake("dtmt::memory_encoder", _memory_encoder_fake)
    register_fake("dtmt::rnmt_beam_search", _rnmt_beam_search_fake)
    for op in ("dtmt::attention_step", "dtmt::readout_features", "dtmt::rnmt_step", "dtmt::rnmt_beam_search",
               "dtmt::memory_encoder"):
        _autocast.register(op, _autocast.float32_rule)
