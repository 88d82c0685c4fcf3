"""Multi-turn rollouts with asynchronous rollout (``async_training.staleness_threshold=1``): the
trainer queues each step's whole multi-turn request and the engine process runs the agent loop
(its tools built there from the same tool YAML), one weight version per trajectory
(tests/rollout/test_multi_turn_engine_process.py checks the versions token by token).

2 GRPO steps on the embedded demo with the calculator tool; the demo policy writes no tool calls,
so every turn is read as a call to the calculator by a tool-call format registered in the
training process from a module the engine process imports too, and ``max_assistant_turns=2``:
every trajectory is [model turn | tool response + glue | model turn]. Step 2 trains on the batch
generated during step 1 by the initial weights (lag 1), step 1 on its own (lag 0).

Planted: the engine process ignoring the tool-call format it is sent (its own hermes parser)
gives trajectories of one turn and no tool call; the batch of step 2 generated on the newest
weights gives lag 0 at step 2.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

pytestmark = pytest.mark.e2e

MT = "actor_rollout_ref.rollout.multi_turn"

PARSER = """
from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall


class EveryTurnCalls:
    def parse(self, text):
        return ParsedTurn([ToolCall("calculator", {"expression": "(3 + 4) * 6"})], text)
"""

# launch/train.py with every turn read as one call to the calculator, in the training process
# and (the class pickled by reference) in the engine process
FORCED_CALLS = """
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
from megarl.rollout.agent.tool_parser import register_tool_parser
from mt_async_parser import EveryTurnCalls

register_tool_parser("hermes", EveryTurnCalls)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

REWARD = '''
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None):
    with open(log, "a") as f:
        f.write(json.dumps({"turns": extra_info["turns"], "calls": extra_info["tool_calls"],
                            "has_response": "42" in solution_str}) + "\\n")
    return sum(map(ord, solution_str)) % 97 / 97
'''


def test_two_async_steps_with_tool_calls(tmp_path, demo_assets):
    from trainer_helpers import train, train_rows

    (tmp_path / "mt_async_parser.py").write_text(PARSER)
    (tmp_path / "reward.py").write_text(REWARD)
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [
        {"class_name": "megarl.rollout.agent.tools.CalculatorTool", "config": {"type": "native"}}]}))
    log = tmp_path / "reward_calls.jsonl"
    train(tmp_path / "run", "grpo", "trainer.total_training_steps=2",
          "async_training.staleness_threshold=1", "data.max_response_length=160",
          f"{MT}.enable=true", f"{MT}.tool_config_path={tools}", f"{MT}.max_assistant_turns=2",
          f"custom_reward_function.path={tmp_path / 'reward.py'}",
          "custom_reward_function.name=compute_score",
          f"+custom_reward_function.reward_kwargs.log={log}",
          python_args=("-c", FORCED_CALLS, str(tmp_path)))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["async/policy_version_lag/max"] for r in rows] == [0, 1]
    assert [r["async/policy_version_lag/min"] for r in rows] == [0, 1]
    for row in rows:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(row[key]), key
        assert row["multi_turn/assistant_turns/mean"] == row["multi_turn/assistant_turns/max"] == 2
        assert row["multi_turn/tool_calls/mean"] == 1 and row["multi_turn/tool_errors/mean"] == 0
        assert row["multi_turn/sanity_mismatch_ratio"] == 0
        assert row["multi_turn/appended_tokens/mean"] > 0
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 * 16
    for s in seen:
        assert s["turns"] == 2 and [c["name"] for c in s["calls"]] == ["calculator"]
        assert s["calls"][0]["response"] == "42" and s["has_response"]
