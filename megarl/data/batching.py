"""Padding id lists into tensors and splitting samples into token-budget micro-batches."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch


def _pad(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None, left: bool):
    longest = max((len(s) for s in seqs), default=0)
    width = longest if length is None else length
    if width < longest:
        raise ValueError(f"pad length {width} is shorter than the longest sequence ({longest})")
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        row = torch.as_tensor(list(s), dtype=torch.long)
        if left:
            ids[i, width - len(s) :], mask[i, width - len(s) :] = row, 1
        else:
            ids[i, : len(s)], mask[i, : len(s)] = row, 1
    return ids, mask


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
    """Left-pad id lists (prompts). Returns ``(ids [B, P], mask [B, P])`` int64, P = ``length``
    or the longest sequence; mask is 1 on real tokens."""
    return _pad(seqs, pad_id, length, left=True)


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
    """Right-pad id lists (responses). Returns ``(ids [B, L], mask [B, L])`` int64."""
    return _pad(seqs, pad_id, length, left=False)


def _pack(lengths: Sequence[int], idx: list[int], max_tokens: int, n_bins: int) -> list[list[int]]:
    """Longest-first: each sample (longest first, ties by index) goes to the least-loaded bin
    it fits in (ties by bin order); a new bin opens when none fits."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in sorted(idx, key=lambda j: (-lengths[j], j)):
        best = -1
        for b in range(len(bins)):
            if loads[b] + lengths[i] <= max_tokens and (best < 0 or loads[b] < loads[best]):
                best = b
        if best < 0:
            bins.append([])
            loads.append(0)
            best = len(bins) - 1
        bins[best].append(i)
        loads[best] += lengths[i]
    return [b for b in bins if b]


def _split_in_two(lengths: Sequence[int], items: list[int]) -> list[list[int]]:
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for i in sorted(items, key=lambda j: (-lengths[j], j)):
        b = 0 if loads[0] <= loads[1] else 1
        halves[b].append(i)
        loads[b] += lengths[i]
    return halves


def split_by_token_budget(
    lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Split samples into micro-batches of at most ``max_tokens`` tokens each, balanced.

    Args:
        lengths: token count of each sample (e.g. prompt + response length)
        max_tokens: token budget per micro-batch; a sample longer than the budget gets a
            micro-batch of its own (the only case where a micro-batch exceeds it)
        num_micro_batches: produce exactly this many (>= ``needed_micro_batches``; <= number
            of samples). Data-parallel ranks all-reduce (max) their ``needed_micro_batches`` and
            pass the result here so every rank runs the same number of forward/backward passes.

    Returns: micro-batches as lists of sample indices (each ascending), every index exactly
    once, ordered by their first index. Deterministic: a pure function of the arguments.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    lengths = [int(x) for x in lengths]
    if any(x < 0 for x in lengths):
        raise ValueError("sample lengths must be >= 0")
    n = len(lengths)
    over = [i for i in range(n) if lengths[i] > max_tokens]
    rest = [i for i in range(n) if lengths[i] <= max_tokens]
    start = math.ceil(sum(lengths[i] for i in rest) / max_tokens) if rest else 0
    groups = [[i] for i in over] + _pack(lengths, rest, max_tokens, max(start, 1 if rest else 0))
    if num_micro_batches is not None:
        if num_micro_batches < len(groups):
            raise ValueError(
                f"num_micro_batches={num_micro_batches} is fewer than the {len(groups)} needed "
                f"to keep every micro-batch within max_tokens={max_tokens}; use "
                f"needed_micro_batches() (all-reduced with max over ranks)"
            )
        if num_micro_batches > n:
            raise ValueError(
                f"cannot make {num_micro_batches} non-empty micro-batches from {n} samples"
            )
        # Split the heaviest splittable micro-batch in two until there are enough.
        heap = [(-sum(lengths[i] for i in g), k) for k, g in enumerate(groups)]
        heapq.heapify(heap)
        while len(groups) < num_micro_batches:
            popped = []
            while True:
                neg, k = heapq.heappop(heap)
                if len(groups[k]) > 1:
                    break
                popped.append((neg, k))
            a, b = _split_in_two(lengths, groups[k])
            groups[k] = a
            groups.append(b)
            for g_k in (k, len(groups) - 1):
                heapq.heappush(heap, (-sum(lengths[i] for i in groups[g_k]), g_k))
            for item in popped:
                heapq.heappush(heap, item)
    groups = [sorted(g) for g in groups]
    groups.sort(key=lambda g: g[0])
    return groups


def needed_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """How many micro-batches ``split_by_token_budget(lengths, max_tokens)`` makes."""
    return len(split_by_token_budget(lengths, max_tokens))
