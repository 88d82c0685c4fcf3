"""Continuous batching (few slots, many prompts of different lengths, n > 1) gives the same
outputs as one sequence at a time, for greedy and seeded sampling; and both equal a brute-force
reference that recomputes transformers' logits over the whole sequence at every step (no KV
cache) and inverts the CDF of the numpy-built target distribution."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import brute_force_generate, prompts_of

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine

PROMPT_LENGTHS = [6, 2, 13, 4, 9, 3, 7]
SETTINGS = [
    pytest.param(dict(greedy=True), id="greedy"),
    pytest.param(dict(temperature=0.9, seed=17), id="T0.9"),
    pytest.param(dict(temperature=1.2, top_k=30, top_p=0.9, seed=5), id="topk-topp"),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_continuous_batching_equals_one_by_one_and_brute_force(settings, tiny_folder, hf_model):
    path = tiny_folder("qwen3")
    prompts = prompts_of(PROMPT_LENGTHS, seed=4)
    # stop ids chosen so that sequences end at different steps and slots turn over
    sp = SamplingParams(n=3, max_new_tokens=10, stop_token_ids=[7, 20, 33, 61], **settings)
    runs = {}
    for slots in (1, 4, 64):
        engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=slots)
        runs[slots] = engine.generate(prompts, sp)
    ref = runs[1]
    assert [c.prompt_index for c in ref] == [i for i in range(len(prompts)) for _ in range(3)]
    for slots in (4, 64):
        for a, b in zip(ref, runs[slots]):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    lengths = {len(c.token_ids) for c in ref}
    assert len(lengths) > 2, "sequences should finish at different steps"

    brute = brute_force_generate(hf_model(path), prompts, sp, {7, 20, 33, 61, 2})
    assert [(c.token_ids, c.finish_reason) for c in ref] == brute
    if not sp.is_greedy:  # samples of one prompt differ
        assert len({tuple(c.token_ids) for c in ref}) > len(prompts)


def test_seed_reproducible_and_seed_none_random(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen3"), max_num_seqs=5)
    prompts = prompts_of([3, 5], seed=9)
    sp = SamplingParams(n=4, max_new_tokens=8, seed=3)
    a = engine.generate(prompts, sp)
    b = engine.generate(prompts, sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    c = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, seed=4))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    torch.manual_seed(0)
    d = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8))
    torch.manual_seed(0)
    e = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8))
    assert [x.token_ids for x in d] == [x.token_ids for x in e]  # seed None follows torch RNG


def test_prefill_budget_chunks_equal(tiny_folder):
    """Prefill split into many chunks (tiny token budget) gives the same result."""
    path = tiny_folder("llama3")
    prompts = prompts_of([12, 3, 8, 8, 5], seed=2)
    sp = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=11)
    a = TorchRolloutEngine.from_pretrained(path, max_num_seqs=10).generate(prompts, sp)
    b = TorchRolloutEngine.from_pretrained(path, max_num_seqs=10,
                                           prefill_token_budget=8).generate(prompts, sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
