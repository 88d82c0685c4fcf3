"""Engine logprobs equal logprobs recomputed from a full forward (fp32, within 1e-5): by
megarl's model through `recompute_logprobs`, and independently by transformers' log_softmax;
plus the metric helper and the batch layout."""

from __future__ import annotations

import pytest
import torch
from logprob_reference import completions_to_batch, recompute_logprobs
from rollout_helpers import prompts_of

from megarl.algos.rollout_correction import METRIC_MAX, METRIC_MEAN, logprob_diff_metrics
from megarl.models import load_model
from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.torch import TorchRolloutEngine

CASES = [
    pytest.param(dict(temperature=0.8, seed=3), id="T0.8"),
    pytest.param(dict(temperature=1.0, seed=4), id="T1"),
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=1.1, top_k=15, top_p=0.8, seed=5), id="topk-topp"),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_engine_logprobs_equal_recomputed(family, params, tiny_folder, hf_model):
    path = tiny_folder(family)
    prompts = prompts_of([5, 9, 3], seed=6)
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=4)
    sp = SamplingParams(n=3, max_new_tokens=12, **params)
    out = engine.generate(prompts, sp)
    batch, engine_lp = completions_to_batch(prompts, out, pad_id=0)
    mask = batch.response_mask

    model = load_model(path)  # a separate copy: the trainer's side
    ours = recompute_logprobs(model, batch, sp.temperature, sp.top_k, sp.top_p)
    m = logprob_diff_metrics(engine_lp, ours, mask)
    assert m[METRIC_MAX] < 1e-5, m

    if sp.top_k <= 0 and sp.top_p >= 1.0:  # transformers, one sequence at a time, unpadded
        hf = hf_model(path)
        temp = sp.temperature or 1.0
        for c in out:
            ids = torch.tensor([prompts[c.prompt_index] + c.token_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompts[c.prompt_index]) - 1 : -1].double()
            ref = torch.log_softmax(logits / temp, -1).gather(
                1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(c.logprobs.double(), ref, atol=1e-5, rtol=0)


def test_logprob_diff_metrics_by_hand():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    b = torch.tensor([[-1.5, -2.0, -9.0], [-0.25, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = logprob_diff_metrics(a, b, mask)
    assert m[METRIC_MEAN] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert m[METRIC_MAX] == pytest.approx(0.5)
    assert logprob_diff_metrics(a, b, torch.zeros_like(mask)) == {METRIC_MEAN: 0.0, METRIC_MAX: 0.0}
    with pytest.raises(ValueError, match="shapes"):
        logprob_diff_metrics(a, b[:, :2], mask)


def test_completions_to_batch_layout():
    prompts = [[1, 2, 3], [4]]
    comps = [Completion(0, [5, 6], torch.tensor([-0.1, -0.2]), "stop"),
             Completion(1, [7, 8, 9], torch.tensor([-0.3, -0.4, -0.5]), "length")]
    batch, lp = completions_to_batch(prompts, comps, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 6, 0], [0, 0, 4, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.response_length == 3
    torch.testing.assert_close(lp, torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
