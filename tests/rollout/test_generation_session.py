"""`GenerationSession` (megarl/rollout/torch/session.py): requests that join a running batch.

Requests arrive while others decode (some at the start, some after a few steps, follow-ups
built from a finished completion the step it is handed back, as a multi-turn trajectory's
next turn would), each with its own seed, prompt key and token budget, on 3 slots. Every
completion equals a brute-force reference (transformers' logits over the whole sequence at
every step, no KV cache, the CDF inverted at the engine's documented uniform of (seed, key,
sample, position)), and its logprobs equal those of the same request in a `generate` call of
its own. A session driven the same way again gives the same bits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_helpers import (
    brute_force_generate,
    float64_model,
    moved_folder,
    prompts_of,
    switching_reference,
)
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp32_bounds import fp32_ref_gap_bound  # noqa: E402

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine

STOPS = [7, 20, 33, 61]
SP = SamplingParams(temperature=0.9, max_new_tokens=10, stop_token_ids=STOPS, seed=0)


def _drive(engine, first, later, follow_up_at):
    """Submit ``first`` at once, ``later`` (step -> requests) at those steps, and a follow-up of
    each completion of the requests in ``follow_up_at`` (prompt + tokens + [5, 6]). Returns
    {request id: (request, completion)} and the step each completion came back at."""
    session = engine.open_session(SP, max_len=48)
    asked, out, when = {}, {}, {}

    def submit(req):
        rid = session.submit(req["prompt"], prompt_key=req["key"], seed=req["seed"], n=req["n"],
                             max_new_tokens=req["max_new"])
        asked[rid] = req

    for req in first:
        submit(req)
    step = 0
    while session.busy or step in later:
        for req in later.get(step, []):
            submit(req)
        for c in session.step():
            rid = c.prompt_index
            out.setdefault(rid, []).append(c)
            when[rid] = step
            if rid in follow_up_at and len(out[rid]) == asked[rid]["n"]:
                submit({"prompt": asked[rid]["prompt"] + c.token_ids + [5, 6], "key": 100 + rid,
                        "seed": 9, "n": 1, "max_new": 6})
        step += 1
    return asked, out, when


def _requests():
    prompts = prompts_of([6, 2, 13, 4, 9], seed=4)
    first = [{"prompt": prompts[0], "key": 0, "seed": 3, "n": 2, "max_new": 10},
             {"prompt": prompts[1], "key": 1, "seed": 3, "n": 1, "max_new": 4}]
    later = {2: [{"prompt": prompts[2], "key": 2, "seed": 5, "n": 2, "max_new": 10}],
             5: [{"prompt": prompts[3], "key": 7, "seed": 3, "n": 1, "max_new": 8},
                 {"prompt": prompts[4], "key": 8, "seed": 11, "n": 3, "max_new": 10}]}
    return first, later, {0, 1}


def test_requests_joining_a_running_batch_equal_brute_force(tiny_folder, hf_model):
    path = tiny_folder("qwen3")
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3)
    first, later, follow = _requests()
    asked, out, when = _drive(engine, first, later, follow)
    assert len(asked) == 2 + 3 + 2  # the follow-ups of requests 0 and 1 were served too
    assert len(set(when.values())) > 3, "completions should come back at different steps"
    hf = hf_model(path)
    for rid, req in asked.items():
        got = out[rid]
        sp = SamplingParams(n=req["n"], temperature=SP.temperature, seed=req["seed"],
                            max_new_tokens=req["max_new"], stop_token_ids=STOPS)
        want = brute_force_generate(hf, [req["prompt"]], sp, set(STOPS) | {2}, keys=[req["key"]])
        assert sorted((c.token_ids, c.finish_reason) for c in got) == sorted(want), rid
        alone = engine.generate([req["prompt"]], sp, prompt_keys=[req["key"]])
        for c in got:
            (match,) = [a for a in alone if a.token_ids == c.token_ids]
            torch.testing.assert_close(c.logprobs, match.logprobs, atol=1e-5, rtol=0)


def test_the_same_submissions_give_the_same_bits(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen3"), max_num_seqs=3)
    first, later, follow = _requests()
    a = _drive(engine, first, later, follow)
    b = _drive(engine, first, later, follow)
    assert a[2] == b[2]
    for rid in a[1]:
        for x, y in zip(a[1][rid], b[1][rid]):
            assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)


def test_a_request_that_cannot_fit_is_refused(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen3"), max_num_seqs=2)
    session = engine.open_session(SP, max_len=8)
    with pytest.raises(ValueError, match="leaves no room"):
        session.submit(list(range(1, 9)), prompt_key=0, seed=0)
    rid = session.submit([1, 5, 9], prompt_key=0, seed=0, max_new_tokens=50)
    done = []
    while session.busy:
        done += session.step()
    assert [c.prompt_index for c in done] == [rid] and len(done[0].token_ids) <= 5


RUN_ON = SamplingParams(temperature=0.9, max_new_tokens=10, ignore_eos=True, seed=0)  # no stop


def test_a_partial_rollout_goes_on_under_new_weights(tiny_folder, tmp_path):
    """Weights replaced after 3 steps while 3 samples are mid-sequence (a partial rollout; no
    stop token, so none can have ended):
    each keeps its tokens so far, with the logprobs they were sampled with, and goes on as if
    the new weights had read its whole prefix (its KV cache recomputed): every token equals a
    brute-force draw from the old model before the switch and from the new one after it, at
    the same uniforms, and every logprob is the float64 reference's within the fp32 bound
    (tests/fp32_bounds.py; measured <= 1.3e-6). A request submitted after the switch runs
    wholly on the new version. Planted: the refill skipped (the old weights' KV cache kept)
    -> the first token after the switch is off the reference's logprob by 0.31 / 0.83 and the
    tokens that follow differ."""
    path = tiny_folder("qwen3")
    new_path = moved_folder(path, tmp_path / "moved")
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3)
    session = engine.open_session(RUN_ON, max_len=48, version=0)
    prompts = prompts_of([6, 9, 4], seed=5)
    reqs = {session.submit(prompts[0], prompt_key=0, seed=3, n=2, max_new_tokens=10): (0, 3, 2),
            session.submit(prompts[1], prompt_key=1, seed=4, n=1, max_new_tokens=10): (1, 4, 1)}
    out: dict[int, list] = {}
    for _ in range(3):
        for c in session.step():
            out.setdefault(c.prompt_index, []).append(c)
    assert not out, "every sample should still be running at the switch"
    engine.update_weights(iter(load_file(str(new_path / "model.safetensors")).items()))
    session.weights_changed(1)
    reqs[session.submit(prompts[2], prompt_key=2, seed=5, n=1, max_new_tokens=10)] = (2, 5, 1)
    while session.busy:
        for c in session.step():
            out.setdefault(c.prompt_index, []).append(c)
    hf_old, hf_new = float64_model(path), float64_model(new_path)
    bound = max(fp32_ref_gap_bound(p, tokens=40, temperature=RUN_ON.temperature)
                for p in (path, new_path))
    switched = 0
    for rid, (key, seed, n) in reqs.items():
        assert len(out[rid]) == n
        for c in out[rid]:
            v = c.token_versions
            assert v == sorted(v) and len(v) == len(c.token_ids) and set(v) <= {0, 1}
            switch = v.index(1) if 1 in v else len(v)
            assert (switch == 0) == (key == 2), (key, v)  # the late request: all version 1
            switched += 0 < switch < len(v)
            want = [switching_reference(hf_old, hf_new, switch, prompts[key], key, seed, s,
                                        RUN_ON) for s in range(n)]
            (match,) = [w for w in want if w[0] == c.token_ids]
            assert c.finish_reason == "length"
            np.testing.assert_allclose(c.logprobs.double().numpy(), match[1], atol=bound, rtol=0)
    assert switched == 3, "the 3 running samples should each span both versions"
