"""Sampled tokens follow the target distribution (chi-square against an independent numpy
construction), the counter-based noise is a correct and uniform hash, and the inverse CDF picks
the same token as a float64 searchsorted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_helpers import assert_first_tokens_follow, chi2_pvalue, target_distribution

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sampling import (
    _inverse_cdf_full,
    _mix32,
    _mul32,
    counter_uniforms,
    sample_next,
)
from megarl.rollout.torch import TorchRolloutEngine

CASES = [
    pytest.param(dict(temperature=0.7), id="T0.7"),
    pytest.param(dict(temperature=1.6, top_k=12), id="T1.6-topk12"),
    pytest.param(dict(temperature=1.0, top_p=0.6), id="topp0.6"),
    pytest.param(dict(temperature=1.3, top_k=40, top_p=0.85), id="topk40-topp0.85"),
]


@pytest.mark.parametrize("params", CASES)
def test_engine_samples_follow_target(params, tiny_folder, hf_model):
    path = tiny_folder("qwen2")
    prompt = [1, 40, 41, 42, 3, 77]
    with torch.no_grad():  # target from transformers' logits, not from our model
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1].double().numpy()
    target = target_distribution(logits, params["temperature"], params.get("top_k", -1),
                                 params.get("top_p", 1.0))
    n = 6000
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=n)
    out = engine.generate([prompt], SamplingParams(n=n, max_new_tokens=1, seed=1234,
                                                   ignore_eos=True, **params))
    assert_first_tokens_follow(out, target, atol=2e-5)


@pytest.mark.parametrize("params", CASES)
def test_sample_next_large_vocab(params):
    """V = 3000: two full 1024-blocks and a tail block; 4000 draws from one row of logits."""
    g = torch.Generator().manual_seed(7)
    vocab, rows = 3000, 4000
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 2.0
    logits[2950:] += 3.0  # mass in the tail block
    target = target_distribution(logits.numpy(), params["temperature"], params.get("top_k", -1),
                                 params.get("top_p", 1.0))
    u = counter_uniforms(99, torch.zeros(rows, dtype=torch.long), torch.arange(rows),
                         torch.zeros(rows, dtype=torch.long))
    sp = SamplingParams(**params)
    tokens, lps = sample_next(logits.float().expand(rows, vocab), sp, u)
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert counts[target == 0].sum() == 0
    assert chi2_pvalue(counts, target) > 1e-3
    np.testing.assert_allclose(lps.numpy(), np.log(target[tokens.numpy()]), atol=2e-5)


def test_inverse_cdf_equals_float64_searchsorted():
    g = torch.Generator().manual_seed(3)
    for vocab in (5, 1024, 2500, 4096):
        probs = torch.softmax(torch.randn(300, vocab, generator=g) * 3, -1)
        probs[:, ::7] = 0.0  # zero-probability tokens must never be drawn
        u = torch.rand(300, generator=g, dtype=torch.float64)
        got = _inverse_cdf_full(probs, u).numpy()
        p64 = probs.double().numpy()
        for i in range(300):
            cdf = np.cumsum(p64[i])
            ref = int(np.searchsorted(cdf, u[i].item() * cdf[-1], side="right"))
            assert got[i] == ref, (vocab, i)
            assert p64[i, got[i]] > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20),
       st.integers(0, 2**32 - 1))
def test_mul32_and_mix32_match_python(xs, c):
    x = torch.tensor(xs, dtype=torch.int64)
    assert _mul32(x, c).tolist() == [(v * c) % 2**32 for v in xs]

    def mix(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) % 2**32
        v ^= v >> 15
        v = (v * 0x846CA68B) % 2**32
        return v ^ (v >> 16)

    assert _mix32(x).tolist() == [mix(v) for v in xs]


def test_counter_uniforms_uniform_and_keyed():
    n = 200_000
    idx = torch.arange(n)
    u = counter_uniforms(5, idx % 97, (idx // 97) % 13, idx // 1261)
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=100, min=0, max=1).numpy()
    assert chi2_pvalue(counts, np.full(100, 0.01)) > 1e-3
    # consecutive positions of one sequence are uncorrelated
    seq = counter_uniforms(5, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                           idx)
    corr = np.corrcoef(seq[:-1].numpy(), seq[1:].numpy())[0, 1]
    assert abs(corr) < 0.01
    # a pure function of its key: order / batch does not matter, every key part matters
    perm = torch.randperm(1000)
    a = counter_uniforms(5, idx[:1000] % 7, idx[:1000] % 3, idx[:1000])
    b = counter_uniforms(5, (idx[:1000] % 7)[perm], (idx[:1000] % 3)[perm], idx[:1000][perm])
    assert torch.equal(a[perm], b)
    base = counter_uniforms(5, torch.tensor([1]), torch.tensor([2]), torch.tensor([3]))
    for other in (counter_uniforms(6, torch.tensor([1]), torch.tensor([2]), torch.tensor([3])),
                  counter_uniforms(5 + 2**40, torch.tensor([1]), torch.tensor([2]),
                                   torch.tensor([3])),
                  counter_uniforms(5, torch.tensor([0]), torch.tensor([2]), torch.tensor([3])),
                  counter_uniforms(5, torch.tensor([1]), torch.tensor([0]), torch.tensor([3])),
                  counter_uniforms(5, torch.tensor([1]), torch.tensor([2]), torch.tensor([0]))):
        assert not torch.equal(base, other)


def test_greedy_logprob_is_temperature_one():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tok, lp = sample_next(logits, SamplingParams(temperature=0.0, top_k=3), None)
    assert torch.equal(tok, logits.argmax(-1))
    ref = torch.log_softmax(logits.double(), -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, atol=1e-6, rtol=0)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(st.tuples(st.integers(0, 2**32 - 1),
                                                      st.integers(0, 2**20),
                                                      st.integers(0, 2**20)), min_size=1,
                                            max_size=10))
def test_python_noise_equals_tensor_noise(seed, keys):
    """The engine's per-sequence Python path gives exactly the tensor function's uniforms."""
    from megarl.rollout.sampling import noise_key, uniform_at

    r, s, p = (torch.tensor(list(x)) for x in zip(*keys))
    want = counter_uniforms(seed, r, s, p).tolist()
    assert [uniform_at(noise_key(seed, a, b), c) for a, b, c in keys] == want
