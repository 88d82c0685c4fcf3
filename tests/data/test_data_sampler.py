"""PromptSampler: deterministic epochs and exact mid-epoch resume."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data import PromptSampler


def take(sampler, k):
    return [sampler.next_batch() for _ in range(k)]


def test_each_epoch_is_a_permutation_and_seeded():
    s = PromptSampler(10, 5, shuffle=True, seed=3)
    batches = take(s, 6)  # 3 epochs of 2 batches
    for e in range(3):
        flat = batches[2 * e] + batches[2 * e + 1]
        assert sorted(flat) == list(range(10))
    epochs = [tuple(batches[2 * e] + batches[2 * e + 1]) for e in range(3)]
    assert len(set(epochs)) == 3  # a fresh order every epoch
    assert take(PromptSampler(10, 5, seed=3), 6) == batches
    assert take(PromptSampler(10, 5, seed=4), 6) != batches
    assert s.epoch == 2


def test_no_shuffle_and_drop_last():
    s = PromptSampler(7, 3, shuffle=False, drop_last=True)
    assert take(s, 3) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert s.batches_per_epoch == 2
    s = PromptSampler(7, 3, shuffle=False, drop_last=False)
    assert take(s, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]
    assert s.batches_per_epoch == 3
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptSampler(3, 4)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), bs=st.integers(1, 12), seed=st.integers(0, 2**31),
    k=st.integers(0, 30), shuffle=st.booleans(), drop_last=st.booleans(),
)
def test_resume_reproduces_remaining_order(n, bs, seed, k, shuffle, drop_last):
    if drop_last and bs > n:
        return
    ref = PromptSampler(n, bs, shuffle, seed, drop_last)
    expected = take(ref, k + 15)
    run = PromptSampler(n, bs, shuffle, seed, drop_last)
    take(run, k)
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(n, bs, shuffle, seed=999, drop_last=drop_last)  # seed restored
    resumed.load_state_dict(state)
    assert take(resumed, 15) == expected[k:]
    assert resumed.epoch == ref.epoch


def test_state_dict_fields_and_mismatch_errors():
    s = PromptSampler(10, 4, seed=7)
    take(s, 3)  # the 3rd batch starts epoch 1
    st_ = s.state_dict()
    assert (st_["epoch"], st_["position"], st_["seed"]) == (1, 4, 7)
    with pytest.raises(ValueError, match="12"):
        PromptSampler(12, 4).load_state_dict(st_)
    with pytest.raises(KeyError, match="position"):
        PromptSampler(10, 4).load_state_dict({"epoch": 0, "seed": 1})
