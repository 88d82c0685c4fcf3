"""Padding helpers and token-budget micro-batching."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data import needed_micro_batches, pad_left, pad_right, split_by_token_budget


def test_pad_left_and_right():
    seqs = [[5, 6, 7], [8], []]
    ids, mask = pad_left(seqs, pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    ids, mask = pad_right(seqs, pad_id=9, length=4)
    assert ids.tolist() == [[5, 6, 7, 9], [8, 9, 9, 9], [9, 9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_left(seqs, 0, length=2)


def check_partition(lengths, budget, groups):
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    for g in groups:
        assert g and g == sorted(g)
        load = sum(lengths[i] for i in g)
        assert load <= budget or len(g) == 1  # only a lone oversize sample may exceed


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 120), max_size=40), budget=st.integers(1, 200))
def test_budget_partition_properties(lengths, budget):
    groups = split_by_token_budget(lengths, budget)
    check_partition(lengths, budget, groups)
    assert groups == split_by_token_budget(list(lengths), budget)  # deterministic
    over = sum(x > budget for x in lengths)
    small = sum(x for x in lengths if x <= budget)
    # any-fit packing: two micro-batches never fit together, so fewer than 2 * S / B + 1
    rest = [x for x in lengths if x <= budget]
    lower = over + math.ceil(small / budget)
    assert len(groups) <= over + ((2 * small) // budget + 1 if rest else 0)
    assert len(groups) >= lower
    assert needed_micro_batches(lengths, budget) == len(groups)


def brute_force_min_bins(lengths, budget):
    n = len(lengths)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for i, b in enumerate(assign):
                loads[b] += lengths[i]
            if max(loads) <= budget and len(set(assign)) == k:
                return k
    return 0


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=6), budget=st.integers(10, 20))
def test_close_to_optimal_bin_count(lengths, budget):
    opt = brute_force_min_bins(lengths, budget)
    assert len(split_by_token_budget(lengths, budget)) <= math.floor(11 / 9 * opt) + 1


def test_balanced_example():
    # 8 samples of 10 tokens, budget 45: 2 micro-batches needed, 4 each
    groups = split_by_token_budget([10] * 8, 45)
    assert sorted(len(g) for g in groups) == [4, 4]
    # an oversize sample goes alone
    groups = split_by_token_budget([100, 5, 5, 5], 20)
    assert [0] in groups and len(groups) == 2


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=30), budget=st.integers(1, 100),
       extra=st.integers(0, 10))
def test_fixed_count_variant(lengths, budget, extra):
    need = needed_micro_batches(lengths, budget)
    k = min(need + extra, len(lengths))
    groups = split_by_token_budget(lengths, budget, num_micro_batches=k)
    assert len(groups) == k
    check_partition(lengths, budget, groups)
    assert groups == split_by_token_budget(lengths, budget, num_micro_batches=k)


def test_fixed_count_errors():
    with pytest.raises(ValueError, match="fewer than the 3 needed"):
        split_by_token_budget([10, 10, 10], 10, num_micro_batches=2)
    with pytest.raises(ValueError, match="non-empty"):
        split_by_token_budget([1, 1], 10, num_micro_batches=3)


def test_same_count_on_every_rank():
    ranks = [[50, 50, 50, 50], [10, 10, 10, 10]]
    k = max(needed_micro_batches(r, 100) for r in ranks)
    out = [split_by_token_budget(r, 100, num_micro_batches=k) for r in ranks]
    assert [len(o) for o in out] == [2, 2]
