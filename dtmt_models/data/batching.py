"""Token-budget batches: for training, bucketed by length and shuffled per epoch with a seed (`token_batches`);
for decoding, longest first (`length_batches`); and the padded tensors of a training batch (`collate`)."""
from __future__ import annotations

import hashlib
import numbers
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dtmt_models.data.vocabulary import BOS, EOS, PAD


def token_batches(lengths, max_tokens: int, seed: int = 1, epoch: int = 0, shuffle: bool = True,
                  keep: Optional[np.ndarray] = None, max_sentences: Optional[int] = None) -> "Batches":
    """Index batches whose padded size (longest side + 1 for BOS/EOS, times the number of pairs) stays within
    max_tokens, of at most `max_sentences` pairs unless None (paper 004's batches of 80 sentences). The pairs (those
    in `keep`, original indices, if given) are put in a random order, sorted by (longer side's length, target
    length) keeping that order among equals, cut into batches in that order, and the batch order is shuffled; the
    randomness comes from (seed, epoch) alone, so the same seed and epoch always give the same batches. Without
    shuffle: sorted by length in index order, batches in that order.

    `lengths`: (source, target) lengths, a sequence of pairs or an [N, 2] integer array. Memory is O(N) in compact
    arrays (4 bytes a pair for the order, transient buffers in chunks), whatever N is."""
    _check_bounds(max_tokens, max_sentences)
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        lengths = lengths.reshape(0, 2)
    if lengths.ndim != 2 or lengths.shape[1] != 2:
        raise ValueError(f"lengths must be (source, target) pairs, got shape {lengths.shape}")
    n = len(lengths)
    index_type = np.int32 if n < 2 ** 31 else np.int64
    if keep is not None:   # (a negative index had read a pair from the end, one past n an IndexError later)
        keep = np.asarray(keep)
        if keep.size and (keep.dtype.kind not in "iu" or keep.min() < 0 or keep.max() >= n):
            raise ValueError(f"keep must hold pair indices in [0, {n}), got {keep.dtype} in "
                             f"[{keep.min()}, {keep.max()}]")
    order = (np.arange(n, dtype=index_type) if keep is None else np.array(keep, dtype=index_type))
    rng = np.random.Generator(np.random.PCG64(_seed_of(seed, epoch)))
    if shuffle:
        rng.shuffle(order)
    order = _stable_sort_by_lengths(order, lengths)
    bounds = _cut_bounds(order, lengths, max_tokens, max_sentences)
    sel = np.arange(len(bounds) - 1, dtype=np.int64)
    if shuffle:
        rng.shuffle(sel)
    return Batches(order, bounds, sel)


class Batches:
    """The batches of an epoch: a sequence whose items are lists of pair indices. Slicing gives a Batches over the
    same arrays (a DDP rank's share, `batches[rank::world]`, costs no copy of the indices)."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, sel: np.ndarray):
        self.order, self.bounds, self.sel = order, bounds, sel

    def __len__(self) -> int:
        return len(self.sel)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Batches(self.order, self.bounds, self.sel[k])
        b = int(self.sel[k])
        return self.order[self.bounds[b]:self.bounds[b + 1]].tolist()

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"Batches({len(self)} batches of {len(self.order)} pairs)"


def _check_bounds(max_tokens, max_sentences) -> None:
    """ValueError unless max_tokens is an integer >= 1 and max_sentences one or None (numpy's too): a NaN or an
    infinite bound had made one batch of everything, a fractional max_sentences turned the bound off."""
    for name, value in (("max_tokens", max_tokens), ("max_sentences", max_sentences)):
        if value is None and name == "max_sentences":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1{' or None' if name == 'max_sentences' else ''}, got "
                             f"{value!r}")


def _seed_of(seed: int, epoch: int) -> int:
    """A 64-bit seed from (seed, epoch), the same on every platform and Python."""
    return int.from_bytes(hashlib.sha256(f"{seed}-{epoch}".encode()).digest()[:8], "little")


_CHUNK = 1 << 18


def length_dtype(max_len: int) -> np.dtype:
    """The smallest unsigned type that holds lengths up to max_len with one value to spare: lengths saturated at
    its top still compare right against max_len (a pair of 1 M subwords reads as 255 and is > 100)."""
    for t in (np.uint8, np.uint16, np.uint32):
        if max_len < np.iinfo(t).max:
            return np.dtype(t)
    return np.dtype(np.uint64)


def kept_indices(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Indices (int32 where they fit) of the pairs whose two sides have 1 to max_len tokens, found in chunks."""
    index_type = np.int32 if len(lengths) < 2 ** 31 else np.int64
    parts = []
    for start in range(0, len(lengths), _CHUNK):
        part = lengths[start:start + _CHUNK]
        ok = (part.min(axis=1) >= 1) & (part.max(axis=1) <= max_len)
        parts.append(np.flatnonzero(ok).astype(index_type) + index_type(start))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=index_type)


def _longer_side(part: np.ndarray) -> np.ndarray:
    """The longer side's length of each (source, target) row, as int64: what a batch pads every pair to (less the
    BOS/EOS position), and so the first sort key."""
    return part.max(axis=1).astype(np.int64)


def _stable_sort_by_lengths(order: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`order` sorted by (longer side, target length), equal keys keeping their order: a counting sort over the
    keys present, done in chunks so that the transient buffers stay small whatever the corpus size (and the counts
    as many as the distinct keys: counted over every key up to the largest, they had grown with the square of the
    longest pair, 1.7 GB for one of 10,000 tokens). The longer side is what `_cut_bounds` pads to, so batches come
    out as full as the budget allows; the target length second leaves little target padding inside a batch, where
    a padded position costs the most (every decoder step). (Why: docs/design/data.md, "Batches".)"""
    def keys(idx):
        part = lengths[idx]
        return _longer_side(part) * _KEY_BASE + part[:, 1]

    present, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)   # (the keys seen, sorted)
    for start in range(0, len(order), _CHUNK):
        seen, seen_counts = np.unique(keys(order[start:start + _CHUNK]), return_counts=True)
        merged = np.union1d(present, seen)
        total = np.zeros(len(merged), dtype=np.int64)
        total[np.searchsorted(merged, present)] = counts
        total[np.searchsorted(merged, seen)] += seen_counts
        present, counts = merged, total
    next_pos = np.cumsum(counts) - counts
    out = np.empty_like(order)
    for start in range(0, len(order), _CHUNK):
        part = order[start:start + _CHUNK]
        k = np.searchsorted(present, keys(part))   # (each key's rank among those present)
        idx = np.argsort(k, kind="stable")
        k = k[idx]
        uniq, first, cnt = np.unique(k, return_index=True, return_counts=True)
        pos = next_pos[k] + (np.arange(len(k)) - np.repeat(first, cnt))
        out[pos] = part[idx]
        next_pos[uniq] += cnt
    return out


_KEY_BASE = 1 << 32   # a sort key: longer side x this + target length (lengths below 2^31: the keys fit int64)


def _cut_bounds(order: np.ndarray, lengths: np.ndarray, max_tokens: int,
                max_sentences: Optional[int] = None) -> np.ndarray:
    """Batch starts (and the end) of `order` cut, in its order, into batches whose padded size (pairs x the largest
    max(source, target) + 1 among them) stays within max_tokens, of at most max_sentences pairs (None: no bound);
    a pair larger than max_tokens is a batch alone."""
    bounds = [0]
    count = longest = pos = 0
    most = max_sentences or len(order) + 1
    for start in range(0, len(order), _CHUNK):
        part = lengths[order[start:start + _CHUNK]]
        for s in (_longer_side(part) + 1).tolist():
            if count and (max(longest, s) * (count + 1) > max_tokens or count == most):
                bounds.append(pos)
                count = longest = 0
            count += 1
            longest = max(longest, s)
            pos += 1
    if count:
        bounds.append(pos)
    return np.asarray(bounds, dtype=np.int64)


def length_batches(lengths: Sequence[int], max_tokens: int,
                   max_sentences: Optional[int] = None) -> List[List[int]]:
    """Indices of `lengths`, longest first, cut into batches of at most `max_tokens` padded source tokens
    (number of sentences x longest length) and, unless None, at most `max_sentences` sentences; a source longer
    than max_tokens is a batch by itself (decoding)."""
    _check_bounds(max_tokens, max_sentences)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])    # stable: ties keep the input order
    return _cut(order, lambda i: lengths[i], max_tokens, max_sentences)


def _cut(order: Sequence[int], size: Callable[[int], int], max_tokens: int,
         max_items: Optional[int] = None) -> List[List[int]]:
    """`order` cut, in its order, into batches whose padded size (items x the largest size(i) among them) stays
    within max_tokens, of at most `max_items` items (None: no bound); an item larger than max_tokens is a batch by
    itself."""
    batches: List[List[int]] = []
    current: List[int] = []
    longest = 0
    for i in order:
        s = size(i)
        if current and (max(longest, s) * (len(current) + 1) > max_tokens
                        or (max_items is not None and len(current) == max_items)):
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, s)
    if current:
        batches.append(current)
    return batches


def collate(pairs: Sequence[Tuple[List[int], List[int]]], device=None, pad_id: int = PAD):
    """(src ids, tgt ids) pairs -> src [B, S], src_lengths [B], prev_tokens [B, T] (BOS y), target [B, T]
    (y EOS), all padded with `pad_id` (the model's: a model built with another pad_id counted PAD padding as
    targets). Sources get no BOS/EOS."""
    B = len(pairs)
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs) + 1
    src = torch.full((B, S), pad_id, dtype=torch.long)
    prev = torch.full((B, T), pad_id, dtype=torch.long)
    target = torch.full((B, T), pad_id, dtype=torch.long)
    for b, (s, t) in enumerate(pairs):
        if not s:
            raise ValueError(f"collate: pair {b} has an empty source")
        src[b, :len(s)] = torch.tensor(s)
        prev[b, :len(t) + 1] = torch.tensor([BOS] + list(t))
        target[b, :len(t) + 1] = torch.tensor(list(t) + [EOS])
    lengths = torch.tensor([len(s) for s, _ in pairs])
    if device is not None:
        src, lengths, prev, target = (x.to(device) for x in (src, lengths, prev, target))
    return src, lengths, prev, target
