"""Stop token ids, stop strings, EOS / ignore_eos, max_new_tokens, max_model_len, and the
finish reasons; stop strings checked against brute-force decoding of every prefix."""

from __future__ import annotations

import pytest
from rollout_helpers import prompts_of

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine


@pytest.fixture(scope="module")
def engine(tiny_folder):
    return TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"), max_num_seqs=4)


PROMPT = [1, 50, 60, 70, 80]


def test_max_new_tokens_and_ignore_eos(engine):
    out = engine.generate(prompts_of([3, 6, 4], seed=1),
                          SamplingParams(n=2, max_new_tokens=9, ignore_eos=True, seed=0))
    assert all(len(c.token_ids) == 9 and c.finish_reason == "length" for c in out)


def test_stop_token_id_cuts_at_first_occurrence(engine):
    free = engine.generate([PROMPT], SamplingParams(greedy=True, max_new_tokens=20,
                                                     ignore_eos=True))[0].token_ids
    stop = free[5]
    cut = free.index(stop)
    c = engine.generate([PROMPT], SamplingParams(greedy=True, max_new_tokens=20,
                                                 ignore_eos=True, stop_token_ids=[stop]))[0]
    assert c.token_ids == free[: cut + 1] and c.finish_reason == "stop"
    assert len(c.logprobs) == cut + 1


def test_eos_stops_unless_ignored(engine):
    """Find sampled sequences that emit EOS (2): they end there with reason "stop"; with
    ignore_eos the same seed continues past it with the identical prefix."""
    prompts = prompts_of([4] * 8, seed=3)
    sp = dict(n=8, max_new_tokens=40, temperature=1.5, seed=2)
    stopped = engine.generate(prompts, SamplingParams(**sp))
    going = engine.generate(prompts, SamplingParams(ignore_eos=True, **sp))
    hits = [(a, b) for a, b in zip(stopped, going) if a.finish_reason == "stop"]
    assert hits, "no sequence emitted EOS; pick another seed"
    for a, b in hits:
        assert a.token_ids[-1] == 2 and 2 not in a.token_ids[:-1]
        assert b.token_ids[: len(a.token_ids)] == a.token_ids
        assert len(b.token_ids) == 40
    for a in stopped:
        if a.finish_reason == "length":
            assert 2 not in a.token_ids and len(a.token_ids) == 40


def _first_stop_prefix(tok, ids: list[int], stops: list[str]) -> int | None:
    for j in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:j], skip_special_tokens=False) for s in stops):
            return j
    return None


def test_stop_string_greedy(engine):
    tok = engine.tokenizer
    free = engine.generate([PROMPT], SamplingParams(greedy=True, max_new_tokens=24,
                                                     ignore_eos=True))[0].token_ids
    text = tok.decode(free[4:7], skip_special_tokens=False)
    stops = [text[:2], "\u00e9never"]
    j = _first_stop_prefix(tok, free, stops)
    c = engine.generate([PROMPT], SamplingParams(greedy=True, max_new_tokens=24,
                                                 ignore_eos=True, stop=stops))[0]
    assert c.token_ids == free[:j] and c.finish_reason == "stop"


def test_stop_strings_sampled_property(engine):
    """Many sampled sequences with two one/two-char stop strings: every "stop" ends exactly
    at the first prefix whose text contains a stop string; every "length" contains none."""
    tok = engine.tokenizer
    stops = ["a", "Q!"]
    out = engine.generate(prompts_of([3, 7, 5], seed=8),
                          SamplingParams(n=6, max_new_tokens=15, temperature=1.3, seed=9,
                                         ignore_eos=True, stop=stops))
    n_stop = 0
    for c in out:
        j = _first_stop_prefix(tok, c.token_ids, stops)
        if c.finish_reason == "stop":
            n_stop += 1
            assert j == len(c.token_ids)
        else:
            assert j is None and len(c.token_ids) == 15
    assert n_stop > 0


def test_stop_string_needs_tokenizer(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"), tokenizer=None)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([PROMPT], SamplingParams(stop=["x"]))


def test_max_model_len_cuts_response(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"), max_model_len=12)
    c = engine.generate([PROMPT + [3, 4, 5]], SamplingParams(max_new_tokens=10,
                                                             ignore_eos=True, seed=1))[0]
    assert len(c.token_ids) == 4 and c.finish_reason == "length"


def test_logprobs_off(engine):
    c = engine.generate([PROMPT], SamplingParams(max_new_tokens=3, logprobs=False))[0]
    assert c.logprobs is None
