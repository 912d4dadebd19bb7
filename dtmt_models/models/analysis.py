"""Looking inside the systems: ATR's twin gates and eq. 10 dependency weights (paper 004 §3.3, §5.1, §5.3)
and attention heat maps for every system whose decoder reports its attention.

ATR (contract §2), one direction, for real steps t of a sequence:

    p_t = W x_t                (with layer norm: LN(W x_t))
    q_t = U h_{t-1} + b        (with layer norm: LN(U h_{t-1}) + b)
    i_t = σ(p_t + q_t),  f_t = σ(p_t − q_t),  h_t = i_t ⊙ p_t + f_t ⊙ h_{t-1}

Rolling the recurrence out (paper 004 eq. 10; exact, not approximate, once the h_0 term is kept):

    h_t = Σ_{k ≤ t} g_{t,k} ⊙ p_k + (Π_{l ≤ t} f_l) ⊙ h_0,      g_{t,k} = i_k ⊙ Π_{l=k+1..t} f_l

so g_{t,k} (a vector over the hidden units) is the weight with which input k enters state t: a forward,
unnormalised self-attention. `dependency_weights` computes it (reduced to a scalar per (t, k) by the mean over
units unless asked for the vectors); `unrolled_states` evaluates the right-hand side, so the identity can be
checked against `atr_gates`' states. The paper writes the rolled-out states in terms of W_x x_k (its q); ours is
p_k, the same quantity under the contract's names (contract §2).

Conventions: gate tensors are time-major [T, B, H] with a mask [T, B] (True at real tokens). Padded steps
hold zeros (never NaN) in i, f, p, h, and are excluded from every statistic. A reversed direction (the
backward half of a bidirectional layer, or `reverse=True`) reads each sequence from its own last token; its
"previous" inputs are the positions to the right (`dependency_weights(..., reverse=True)`).

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch), are imported only when a
plot is asked for, and are written atomically (a temporary file renamed over the target).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import dtmt_kernels as dk
from dtmt_kernels.functional import lengths_to_mask
from dtmt_models.data.vocabulary import BOS
from dtmt_models.models.modes import evaluating
from dtmt_models.plotting import figure, save

__all__ = ["atr_gates", "GateStatistics", "gate_correlation", "gate_position_curves", "dependency_weights",
           "unrolled_states", "strongest_previous", "attention_matrix", "plot_attention", "plot_dependencies",
           "plot_gate_scatter_and_positions", "find_atr_layer"]


# --------------------------------------------------------------------------------------------- ATR gates
def atr_gates(layer, x: Tensor, lengths=None, direction: int = 0, h0: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """Runs one direction of a `dtmt_kernels.nn.ATR` layer step by step with the layer's own weights (pure
    PyTorch, no autograd) and returns what the fused kernels do not expose.

    x: the layer's input, [T, B, input_size] ([B, T, input_size] if the layer is batch_first; [T, input_size]
    unbatched). lengths: B ints in [1, T] (padding at the end), as for `layer(x, lengths=...)`. direction: 0, or
    1 for the backward half of a bidirectional layer. h0: [B, hidden_size] initial state of that direction
    (zeros by default).

    Returns a dict of time-major tensors: i, f (input and forget gates), p (the input projection, layer-normed
    when the layer is), h (the states, equal to that direction's slice of the layer's output), each
    [T, B, hidden_size] and zero at padded steps; mask [T, B] bool (True at real tokens); reverse (bool, whether
    this direction reads right to left).
    """
    if not isinstance(layer, dk.nn.ATR):
        raise ValueError(f"atr_gates: layer must be a dtmt_kernels.nn.ATR, got {type(layer).__name__}")
    if not isinstance(direction, int) or not 0 <= direction < layer.num_directions:
        raise ValueError(f"atr_gates: direction must be 0{' or 1' if layer.num_directions == 2 else ''} for this "
                         f"layer, got {direction!r}")
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() not in (2, 3) \
            or x.shape[-1] != layer.input_size:
        raise ValueError(f"atr_gates: x must be a floating-point tensor "
                         f"{'[B, T, input_size]' if layer.batch_first else '[T, B, input_size]'} with "
                         f"input_size={layer.input_size}, got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{list(getattr(x, 'shape', []))}")
    w = layer.direction_weights(direction)
    H = layer.hidden_size
    with torch.no_grad():
        x = x.detach().to(device=w.w_ih.device, dtype=w.w_ih.dtype)
        if x.dim() == 2:
            if lengths is not None:
                raise ValueError("atr_gates: lengths is for batched input; an unbatched x has no padding")
            x = x.unsqueeze(1)
        elif layer.batch_first:
            x = x.transpose(0, 1)
        T, B = x.shape[0], x.shape[1]
        if T == 0 or B == 0:
            raise ValueError(f"atr_gates: x must have at least one step and one sequence, got {list(x.shape)}")
        mask = (torch.ones(T, B, dtype=torch.bool, device=x.device) if lengths is None
                else lengths_to_mask(lengths, T, B, x.dtype, x.device, "atr_gates").bool())
        if h0 is None:
            h = x.new_zeros(B, H)
        else:
            if tuple(h0.shape) != (B, H):
                raise ValueError(f"atr_gates: h0 must have shape [B, hidden_size] = {[B, H]}, got {list(h0.shape)}")
            h = h0.detach().to(x)
        p_all = F.linear(x, w.w_ih, w.b_ih)
        if w.ln_w is not None:
            p_all = F.layer_norm(p_all, (H,), w.ln_w[:H], w.ln_b[:H], layer.eps)
        gi, gf, gp, gh = (x.new_zeros(T, B, H) for _ in range(4))
        reverse = direction == 1 or bool(getattr(layer, "reverse", False))
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            p = p_all[t]
            q = F.linear(h, w.w_hh, w.b_hh)
            if w.ln_w is not None:
                q = F.layer_norm(q, (H,), w.ln_w[H:], w.ln_b[H:], layer.eps)
            i, f = torch.sigmoid(p + q), torch.sigmoid(p - q)
            h_new = i * p + f * h
            valid = mask[t].unsqueeze(-1)
            zero = torch.zeros_like(h_new)
            gi[t], gf[t] = torch.where(valid, i, zero), torch.where(valid, f, zero)
            gp[t], gh[t] = torch.where(valid, p, zero), torch.where(valid, h_new, zero)
            h = torch.where(valid, h_new, h)
    return {"i": gi, "f": gf, "p": gp, "h": gh, "mask": mask, "reverse": reverse}


def find_atr_layer(model, name: Optional[str] = None):
    """(module name, layer, direction) of the ATR layer to analyse in `model`.

    By default: the first `dtmt_kernels.nn.ATR` module in registration order that has a left-to-right direction
    (a bidirectional layer's direction 0, or a unidirectional layer without reverse=True). In rnnsearch-atr
    (encoder="bi") and gnmt-atr that is the bottom encoder layer, whose input is the word embeddings: its
    p_k = W x_k depends on source token k alone, so eq. 10's weights attribute each state to the words
    themselves, and "previous word" means the word to the left, as in paper 004's Figure 4 (with the
    context-aware encoder, encoder="ca", it is the forward layer, which reads the embeddings too). One-step
    cells (ATRCell: the decoder's, the CA encoder's backward two-level cell) are not considered. `name` picks a
    module by its name in `model.named_modules()` instead (its direction 0)."""
    modules = dict(model.named_modules())
    if name is not None:
        if name not in modules or not isinstance(modules[name], dk.nn.ATR):
            atrs = [n for n, m in modules.items() if isinstance(m, dk.nn.ATR)]
            raise ValueError(f"no ATR layer named {name!r} in {type(model).__name__}; its ATR layers: {atrs}")
        return name, modules[name], 0
    for n, m in modules.items():
        if isinstance(m, dk.nn.ATR) and (m.num_directions == 2 or not m.reverse):
            return n, m, 0
    for n, m in modules.items():   # only right-to-left ATR layers
        if isinstance(m, dk.nn.ATR):
            return n, m, 0
    raise ValueError(f"{type(model).__name__} ({getattr(model, 'model_name', '?')}) has no ATR layer "
                     "(dtmt_kernels.nn.ATR); the gate analysis is for rnnsearch-atr and gnmt-atr with cell='atr'")


# ------------------------------------------------------------------------------------- gate statistics
def _mask_of(mask: Optional[Tensor], like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
    if tuple(mask.shape) != tuple(like.shape[:2]):
        raise ValueError(f"mask must have shape [T, B] = {list(like.shape[:2])}, got {list(mask.shape)}")
    return mask.to(like.device).bool() if mask.dtype == torch.bool else mask.to(like.device) > 0.5


def _check_gates(i: Tensor, f: Tensor) -> None:
    if not isinstance(i, Tensor) or not isinstance(f, Tensor) or i.shape != f.shape or i.dim() != 3:
        raise ValueError(f"i and f must be tensors of the same shape [T, B, H], got "
                         f"{list(getattr(i, 'shape', []))} and {list(getattr(f, 'shape', []))}")


class GateStatistics:
    """Streams the gate values of many batches: Pearson r over every (real position, unit) pair, the paper's
    Figure-3 curves (per position: mean over units, averaged over sentences) and a uniform random sample of
    (i, f) pairs for a scatter plot. Co-moments are merged with Chan et al.'s pairwise update (float64), so
    the result does not depend on the batching and needs no memory per value."""

    def __init__(self, max_points: int = 20000, seed: int = 0):
        self.n = 0
        self.mean_i = self.mean_f = 0.0
        self.s_ii = self.s_ff = self.s_if = 0.0
        self.pos_i = torch.zeros(0, dtype=torch.float64)
        self.pos_f = torch.zeros(0, dtype=torch.float64)
        self.pos_n = torch.zeros(0, dtype=torch.float64)
        self.sentences = 0
        self.max_points = max_points
        self._gen = torch.Generator().manual_seed(seed)
        self._sample = torch.zeros(0, 3, dtype=torch.float64)   # columns: key, i, f

    def update(self, i: Tensor, f: Tensor, mask: Optional[Tensor] = None) -> "GateStatistics":
        """Adds gates i, f [T, B, H] (mask [T, B], True/1 at real tokens; None: all real)."""
        _check_gates(i, f)
        m = _mask_of(mask, i)
        i64, f64 = i.detach().to("cpu", torch.float64), f.detach().to("cpu", torch.float64)
        m = m.cpu()
        xi, xf = i64[m].reshape(-1), f64[m].reshape(-1)      # real positions only: padding never enters
        nb = xi.numel()
        self.sentences += int(m.any(0).sum())
        if nb:
            mi, mf = float(xi.mean()), float(xf.mean())
            di, df = xi - mi, xf - mf
            sii, sff, sif = float((di * di).sum()), float((df * df).sum()), float((di * df).sum())
            na, n = self.n, self.n + nb
            dmi, dmf = mi - self.mean_i, mf - self.mean_f
            self.s_ii += sii + dmi * dmi * na * nb / n
            self.s_ff += sff + dmf * dmf * na * nb / n
            self.s_if += sif + dmi * dmf * na * nb / n
            self.mean_i += dmi * nb / n
            self.mean_f += dmf * nb / n
            self.n = n
            if self.max_points > 0:   # uniform sample without replacement: keep the smallest random keys
                keys = torch.rand(nb, generator=self._gen, dtype=torch.float64)
                pool = torch.cat([self._sample, torch.stack([keys, xi, xf], 1)])
                if pool.shape[0] > self.max_points:
                    pool = pool[torch.topk(pool[:, 0], self.max_points, largest=False).indices]
                self._sample = pool
        # Figure 3: the unit mean of each (position, sentence), summed per position over real sentences
        T = i.shape[0]
        if self.pos_n.numel() < T:
            grow = T - self.pos_n.numel()
            self.pos_i, self.pos_f, self.pos_n = (torch.cat([v, v.new_zeros(grow)])
                                                  for v in (self.pos_i, self.pos_f, self.pos_n))
        mf_ = m.to(torch.float64)
        self.pos_i[:T] += (i64.mean(-1) * mf_).sum(1)
        self.pos_f[:T] += (f64.mean(-1) * mf_).sum(1)
        self.pos_n[:T] += mf_.sum(1)
        return self

    def correlation(self) -> float:
        """Pearson r between input and forget gate values (nan when there are < 2 values or no variance)."""
        if self.n < 2 or self.s_ii <= 0 or self.s_ff <= 0:
            return float("nan")
        return max(-1.0, min(1.0, self.s_if / math.sqrt(self.s_ii * self.s_ff)))

    def position_curves(self) -> Dict[str, Tensor]:
        """{"input", "forget", "count"} [P] float64: per position (0-based), the unit-mean gate value averaged
        over the sentences that have that position, and how many did; positions no sentence reached are cut."""
        keep = int((self.pos_n > 0).nonzero().max()) + 1 if bool((self.pos_n > 0).any()) else 0
        n = self.pos_n[:keep].clamp_min(1)
        return {"input": self.pos_i[:keep] / n, "forget": self.pos_f[:keep] / n, "count": self.pos_n[:keep].clone()}

    def sample(self):
        """(i values, f values) float64: a uniform random sample of at most max_points real (position, unit)
        gate pairs, for scatter plots."""
        return self._sample[:, 1].clone(), self._sample[:, 2].clone()


def gate_correlation(i: Tensor, f: Tensor, mask: Optional[Tensor] = None) -> float:
    """Pearson r between input and forget gate values over all real (unpadded) positions and all units.
    i, f: [T, B, H]; mask [T, B] (True/1 at real tokens; None: all real). Paper 004 §5.1 reports r = −0.98 on
    its test set. nan when undefined (fewer than two values, or a constant gate)."""
    return GateStatistics(max_points=0).update(i, f, mask).correlation()


def gate_position_curves(i: Tensor, f: Tensor, mask: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """Paper 004 Figure 3: for each sentence and position, the mean gate value over the units; then, per
    position, the average over the sentences long enough to have it. Returns {"input", "forget", "count"},
    each [P] float64 (P = the longest real length)."""
    return GateStatistics(max_points=0).update(i, f, mask).position_curves()


# -------------------------------------------------------------------------------- eq. 10: dependencies
def _dependency_vectors(i: Tensor, f: Tensor, mask: Optional[Tensor], reverse: bool) -> Tensor:
    """g [B, T(state t), T(input k), H]; zero where t or k is padded or k is not before-or-at t."""
    _check_gates(i, f)
    m = _mask_of(mask, i).unsqueeze(-1)                                   # [T, B, 1]
    i_m = torch.where(m, i, torch.zeros_like(i))
    f_m = torch.where(m, f, torch.ones_like(f))     # a padded step carries the state: a factor of exactly 1
    if reverse:   # with padding at the end, reading right to left = reading the flipped time axis
        i_m, f_m = i_m.flip(0), f_m.flip(0)
    T = i.shape[0]
    g = i.new_zeros((T, T) + tuple(i.shape[1:]))                          # [t, k, B, H]
    for k in range(T):
        g[k, k] = i_m[k]
        if k + 1 < T:
            g[k + 1:, k] = i_m[k] * torch.cumprod(f_m[k + 1:], 0)        # Π_{l=k+1..t} f_l for t > k
    if reverse:
        g = g.flip(0).flip(1)
    mm = m.squeeze(-1)
    g = g * (mm.unsqueeze(1) & mm.unsqueeze(0)).unsqueeze(-1).to(g.dtype)
    return g.permute(2, 0, 1, 3)


def dependency_weights(i: Tensor, f: Tensor, mask: Optional[Tensor] = None, reduce: Optional[str] = "mean",
                       reverse: bool = False) -> Tensor:
    """Paper 004 eq. 10: g_{t,k} = i_k ⊙ Π_{l=k+1..t} f_l, the weight of input k in state t (k ≤ t).

    i, f: [T, B, H] gates of one direction (from `atr_gates`); mask [T, B]. reduce="mean" returns [B, T, T]
    (row t = state, column k = input, averaged over the hidden units; the paper does not say how it reduces the
    vector to draw Figure 4); reduce=None returns the vectors [B, T, T, H]. Entries with k after t, or with a
    padded t or k, are 0. reverse=True for a right-to-left direction: g_{t,k} = i_k ⊙ Π_{l=t..k-1} f_l for k ≥ t.
    Cost O(T² B H) time and memory."""
    if reduce not in ("mean", None, "none"):
        raise ValueError(f"dependency_weights: reduce must be 'mean' or None, got {reduce!r}")
    with torch.no_grad():
        g = _dependency_vectors(i, f, mask, reverse)
        return g.mean(-1) if reduce == "mean" else g


def unrolled_states(i: Tensor, f: Tensor, p: Tensor, mask: Optional[Tensor] = None, h0: Optional[Tensor] = None,
                    reverse: bool = False) -> Tensor:
    """The right-hand side of eq. 10, h_t = Σ_k g_{t,k} ⊙ p_k + (Π_{l ≤ t} f_l) ⊙ h_0, as [T, B, H] (zeros at
    padded steps). Equal to the recurrence's states (`atr_gates(...)["h"]`) up to rounding."""
    with torch.no_grad():
        g = _dependency_vectors(i, f, mask, reverse)                      # [B, t, k, H]
        h = torch.einsum("btkh,kbh->tbh", g, p)
        if h0 is not None:
            m = _mask_of(mask, i).unsqueeze(-1)
            f_m = torch.where(m, f, torch.ones_like(f))
            carry = torch.cumprod(f_m.flip(0), 0).flip(0) if reverse else torch.cumprod(f_m, 0)
            h = h + torch.where(m, carry * h0.unsqueeze(0), torch.zeros_like(h))
        return h


def strongest_previous(weights: Tensor, reverse: bool = False) -> List[Optional[int]]:
    """For each position t of a [T, T] dependency matrix, the previous position k < t (k > t when reverse) with
    the largest weight (None for the first word): the arcs of paper 004's Figure 4."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.dim() != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"strongest_previous: weights must be [T, T], got {list(w.shape)}")
    T = w.shape[0]
    out: List[Optional[int]] = []
    for t in range(T):
        ks = range(t + 1, T) if reverse else range(t)
        out.append(max(ks, key=lambda k: float(w[t, k])) if len(ks) else None)
    return out


# ------------------------------------------------------------------------------------------- attention
def attention_matrix(model, src, src_lengths=None, tgt_tokens=None) -> Tensor:
    """Attention weights of one sentence pair under forced decoding: [T_tgt, S] float, CPU.

    src: the source ids, [S] or [1, S] (a LongTensor or a list); src_lengths: its real length (int, [1] tensor
    or None for all of S; columns past it are 0). tgt_tokens: the reference target ids without BOS; row t is the
    attention of the decoder step that predicts tgt_tokens[t] after reading BOS, tgt_tokens[:t] (append EOS to
    get the end-of-sentence row too). Each row sums to 1 over the real source positions. Multi-head attention
    (dtmt's [B, heads, S]) is averaged over the heads. Runs `model.encode` and `model.step` in eval mode (an eval
    copy of a model in training mode: its own modes untouched), without gradients.

    Needs a system whose decoder state carries "attn" (the recurrent systems: dtmt, shallow-rnmt, rnnsearch-atr,
    gnmt-atr, nematus, deeplau, ...). The `transformer` baseline does not expose its attention (it lives
    inside torch.nn.MultiheadAttention layers): a ValueError says so."""
    name = f"{type(model).__name__} ({getattr(model, 'model_name', '?')})"
    if not callable(getattr(model, "encode", None)) or not callable(getattr(model, "step", None)):
        raise ValueError(f"attention_matrix: takes one model with encode and step, got {type(model).__name__} (an "
                         f"ensemble's models each attend on their own: pass one of them)")   # (an AttributeError)
    device = next(model.parameters()).device
    src = torch.as_tensor(src, dtype=torch.long, device=device)
    if src.dim() == 1:
        src = src.unsqueeze(0)
    if src.dim() != 2 or src.shape[0] != 1 or src.shape[1] == 0:
        raise ValueError(f"attention_matrix: src must be one sentence, [S] or [1, S], got {list(src.shape)}")
    S = src.shape[1]
    if src_lengths is None:
        src_lengths = S
    src_lengths = torch.as_tensor(src_lengths, dtype=torch.long, device=device).reshape(-1)
    if src_lengths.numel() != 1 or not 1 <= int(src_lengths[0]) <= S:
        raise ValueError(f"attention_matrix: src_lengths must be one length in [1, S={S}], got {src_lengths.tolist()}")
    tgt = torch.as_tensor(tgt_tokens if tgt_tokens is not None else [], dtype=torch.long, device=device).reshape(-1)
    if tgt.numel() == 0:
        raise ValueError("attention_matrix: tgt_tokens must hold at least one token")
    V = getattr(model, "tgt_vocab_size", None)
    if V is not None and not bool(((tgt >= 0) & (tgt < V)).all()):   # (the last id, never read by a step, was taken)
        outside = tgt[(tgt < 0) | (tgt >= V)]
        raise ValueError(f"attention_matrix: tgt_tokens must be ids in [0, {V}), got {int(outside[0])} (of "
                         f"{tgt.numel()} ids)")
    prev = torch.cat([tgt.new_tensor([BOS]), tgt[:-1]])

    rows = []
    with evaluating(model) as model, torch.no_grad():
        state = model.encode(src, src_lengths)
        for t in range(prev.numel()):
            _, state = model.step(state, prev[t:t + 1])
            attn = state.get("attn") if isinstance(state, dict) else None
            if attn is None:
                raise ValueError(f"attention_matrix: {name} exposes no attention weights (its decoder state "
                                 "has no 'attn'); the transformer keeps its attention inside "
                                 "torch.nn.MultiheadAttention. Use a recurrent system.")
            if attn.dim() == 3:
                attn = attn.mean(1)       # [B, heads, S] -> head average
            rows.append(attn[0].float().cpu())
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------- plots
def _canvas(width: float, height: float):
    return figure(width, height)


def _save(fig, path: str) -> str:
    return save(fig, path, tight=True)


def _as_matrix(m, rows: int, cols: int, what: str):
    import numpy as np

    a = torch.as_tensor(m).detach().to("cpu", torch.float64).numpy() if not isinstance(m, np.ndarray) \
        else m.astype(np.float64)
    if a.shape != (rows, cols):
        raise ValueError(f"{what}: matrix has shape {list(a.shape)} but the tokens give [{rows}, {cols}]")
    return a


def plot_attention(matrix, src_tokens: Sequence[str], tgt_tokens: Sequence[str], path: str,
                   title: Optional[str] = None) -> str:
    """Heat map of an attention matrix [T_tgt, S]: source tokens across, target tokens down. Returns path."""
    a = _as_matrix(matrix, len(tgt_tokens), len(src_tokens), "plot_attention")
    fig = _canvas(max(4.0, 0.35 * len(src_tokens) + 2.0), max(3.0, 0.3 * len(tgt_tokens) + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(a, cmap="Greys", vmin=0.0, vmax=max(1e-12, float(a.max())), aspect="auto",
                   interpolation="nearest")
    ax.set_xticks(range(len(src_tokens)))
    ax.set_xticklabels(list(src_tokens), rotation=90, fontsize=8)
    ax.set_yticks(range(len(tgt_tokens)))
    ax.set_yticklabels(list(tgt_tokens), fontsize=8)
    ax.set_xlabel("source")
    ax.set_ylabel("target (forced decoding)")
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    if title:
        ax.set_title(title, fontsize=9, pad=40)
    fig.colorbar(im, ax=ax, fraction=0.04)
    return _save(fig, path)


def plot_dependencies(weights, tokens: Sequence[str], path: str, title: Optional[str] = None,
                      reverse: bool = False) -> List[Optional[int]]:
    """Paper 004 §5.3 / Figure 4 for one sentence: top, each word joined by an arc to the previous word with
    the highest eq.-10 weight; bottom, the heat map of the weights [T (state), T (input)] with that word boxed
    in every row. Returns the chosen previous position per word (None for the first)."""
    from matplotlib.patches import Arc, Rectangle

    T = len(tokens)
    a = _as_matrix(weights, T, T, "plot_dependencies")
    best = strongest_previous(torch.as_tensor(a), reverse)
    fig = _canvas(max(5.0, 0.45 * T + 2.0), max(5.0, 0.35 * T + 3.5))
    top = fig.add_axes([0.1, 0.72, 0.8, 0.22])
    low = fig.add_axes([0.1, 0.05, 0.8, 0.6])
    # arcs
    top.set_xlim(-0.5, T - 0.5)
    span = max([abs(t - k) for t, k in enumerate(best) if k is not None] or [1])
    top.set_ylim(-0.35, 0.55 * span + 0.3)
    for t, k in enumerate(best):
        if k is None:
            continue
        d = abs(t - k)
        top.add_patch(Arc(((t + k) / 2.0, 0.0), d, 1.1 * d, theta1=0, theta2=180, color="tab:red", lw=1.2))
        top.plot([t], [0.0], marker="v", color="tab:red", ms=4)
    for t, tok in enumerate(tokens):
        top.text(t, -0.08, tok, ha="center", va="top", fontsize=8, rotation=90 if len(tok) > 3 else 0)
    top.axis("off")
    if title:
        top.set_title(title, fontsize=9)
    # heat map (entries that are not dependencies left blank)
    import numpy as np

    shown = np.array(a, dtype=np.float64)
    rows, cols = np.indices(shown.shape)
    shown[(cols > rows) if not reverse else (cols < rows)] = np.nan
    im = low.imshow(shown, cmap="viridis", aspect="auto", interpolation="nearest")
    for t, k in enumerate(best):
        if k is not None:
            low.add_patch(Rectangle((k - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5))
    low.set_xticks(range(T))
    low.set_xticklabels(list(tokens), rotation=90, fontsize=8)
    low.set_yticks(range(T))
    low.set_yticklabels(list(tokens), fontsize=8)
    low.set_xlabel("input word k")
    low.set_ylabel("state t")
    fig.colorbar(im, ax=low, fraction=0.04, label="mean over units of g_{t,k}")
    _save(fig, path)
    return best


def plot_gate_scatter_and_positions(input_values, forget_values, input_by_position, forget_by_position,
                                    path: str, r: Optional[float] = None, title: Optional[str] = None) -> str:
    """Left: forget against input gate values (a sample of (position, unit) pairs) with Pearson r in the
    legend. Right: paper 004 Figure 3, the per-position unit mean of each gate averaged over sentences."""
    import numpy as np

    xi = np.asarray(torch.as_tensor(input_values, dtype=torch.float64).reshape(-1))
    xf = np.asarray(torch.as_tensor(forget_values, dtype=torch.float64).reshape(-1))
    ci = np.asarray(torch.as_tensor(input_by_position, dtype=torch.float64).reshape(-1))
    cf = np.asarray(torch.as_tensor(forget_by_position, dtype=torch.float64).reshape(-1))
    if xi.shape != xf.shape or ci.shape != cf.shape:
        raise ValueError("plot_gate_scatter_and_positions: input and forget values must pair up")
    fig = _canvas(10.0, 4.0)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.scatter(xi, xf, s=2, alpha=0.2, color="tab:blue", rasterized=True,
                 label=f"r = {r:.4f}" if r is not None and math.isfinite(r) else None)
    left.set_xlim(0, 1)
    left.set_ylim(0, 1)
    left.set_xlabel("input gate i")
    left.set_ylabel("forget gate f")
    if r is not None and math.isfinite(r):
        left.legend(loc="upper right", markerscale=0, handlelength=0)
    pos = np.arange(1, ci.size + 1)
    right.plot(pos, ci, label="input gate", color="tab:blue")
    right.plot(pos, cf, label="forget gate", color="tab:orange")
    right.set_xlabel("position")
    right.set_ylabel("mean gate value")
    right.set_ylim(0, 1)
    right.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
