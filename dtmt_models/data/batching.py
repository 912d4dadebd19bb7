"""Token-budget batches: for training, bucketed by length and shuffled per epoch with a seed (`token_batches`);
for decoding, longest first (`length_batches`); and the padded tensors of a training batch (`collate`)."""
from __future__ import annotations

import random
from typing import Callable, List, Sequence, Tuple

import torch

from dtmt_models.data.vocabulary import BOS, EOS, PAD


def token_batches(lengths: Sequence[Tuple[int, int]], max_tokens: int, seed: int = 1, epoch: int = 0,
                  shuffle: bool = True) -> List[List[int]]:
    """Index batches whose padded size (longest side + 1 for BOS/EOS, times the number of pairs) stays within
    max_tokens. Pairs are sorted by length (random tie order per epoch), cut into batches, and the batch
    order is shuffled with Random(seed, epoch): the same seed and epoch always give the same batches."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rng = random.Random(f"{seed}-{epoch}")
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: (lengths[i][0], lengths[i][1]))   # stable: ties keep the shuffled order
    batches = _cut(order, lambda i: max(lengths[i]) + 1, max_tokens)
    if shuffle:
        rng.shuffle(batches)
    return batches


def length_batches(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Indices of `lengths`, longest first, cut into batches of at most `max_tokens` padded source tokens
    (number of sentences x longest length); a source longer than max_tokens is a batch by itself (decoding)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])    # stable: ties keep the input order
    return _cut(order, lambda i: lengths[i], max_tokens)


def _cut(order: Sequence[int], size: Callable[[int], int], max_tokens: int) -> List[List[int]]:
    """`order` cut, in its order, into batches whose padded size (items x the largest size(i) among them) stays
    within max_tokens; an item larger than max_tokens is a batch by itself."""
    batches: List[List[int]] = []
    current: List[int] = []
    longest = 0
    for i in order:
        s = size(i)
        if current and max(longest, s) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, s)
    if current:
        batches.append(current)
    return batches


def collate(pairs: Sequence[Tuple[List[int], List[int]]], device=None):
    """(src ids, tgt ids) pairs -> src [B, S], src_lengths [B], prev_tokens [B, T] (BOS y), target [B, T]
    (y EOS), all padded with PAD. Sources get no BOS/EOS."""
    B = len(pairs)
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs) + 1
    src = torch.full((B, S), PAD, dtype=torch.long)
    prev = torch.full((B, T), PAD, dtype=torch.long)
    target = torch.full((B, T), PAD, dtype=torch.long)
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
