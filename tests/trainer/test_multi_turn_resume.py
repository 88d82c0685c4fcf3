"""Exact resume with multi-turn rollouts: 4 GRPO steps straight == 2 steps, a hard kill after
the step-2 checkpoint, a resume and 2 more steps, bit for bit (metrics but timings, exported
weights; fp32, CPU, one process).

The embedded demo with the calculator tool; the demo policy writes no tool calls, so the
training process reads a call to the calculator in every turn (as
tests/trainer/test_multi_turn_trainer.py does) and ``max_assistant_turns=2``: every trajectory
has two model turns around a tool turn, and the multi-turn metrics (tool time aside, a wall
clock) are in the compared rows.

Planted: the trainer ignoring trainer.resume=auto passes the metric comparison (the run is
deterministic) and fails the resume evidence (`assert_resumed`); per-turn seeds drawn from a
process-global counter instead of (step, turn) make the resumed steps' trajectories differ.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_resume
import torch
from safetensors.torch import load_file
from test_multi_turn_trainer import MT, tool_yaml
from test_resume import RESUMED, _hard_kill, _policy_dir, _weights, assert_resumed, logged_before
from trainer_helpers import FAST, REPO, env, train, train_rows

from megarl.trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.e2e

# launch/train.py with every turn read as one call to the calculator
FORCED_CALLS = """
import runpy, sys
from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser

class EveryTurnCalls:
    def parse(self, text):
        return ParsedTurn([ToolCall("calculator", {"expression": "(3 + 4) * 6"})], text)

register_tool_parser("hermes", EveryTurnCalls)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _common(tmp_path: Path) -> list[str]:
    return ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.export_hf=true",
            "actor_rollout_ref.model.dtype=fp32", "data.max_response_length=160",
            f"{MT}.enable=true", f"{MT}.tool_config_path={tool_yaml(tmp_path)}",
            f"{MT}.max_assistant_turns=2"]


def _untimed(row: dict) -> dict:
    """`test_resume._untimed`, less the tools' wall time (a clock, not a result)."""
    return {k: v for k, v in test_resume._untimed(row).items()
            if not k.startswith("multi_turn/tool_time_s")}


def test_kill_and_resume_multi_turn_is_bitwise_identical(tmp_path, demo_assets):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = _common(tmp_path)
    forced = ("-c", FORCED_CALLS)
    train(straight, "grpo", *common, python_args=forced)

    # the run killed once its step-2 checkpoint is complete
    cmd = [sys.executable, *forced, "launch/train.py", "--config", "grpo",
           f"trainer.default_local_dir={resumed}", *FAST, *common]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = resumed / "checkpoints" / "global_step_2" / "COMPLETE"
    deadline = time.time() + 600
    try:
        while not marker.exists():
            assert proc.poll() is None, "training exited before the checkpoint appeared"
            assert time.time() < deadline, "no checkpoint within 600 s"
            time.sleep(0.02)
    finally:
        _hard_kill(proc)
    assert CheckpointManager(resumed / "checkpoints").complete_steps() == [2]
    before = logged_before(resumed, 2)
    out = train(resumed, "grpo", *common, *RESUMED, python_args=forced)

    a, b = train_rows(straight), train_rows(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert _untimed(ra) == _untimed(rb), f"step {ra['step']} metrics differ"
    wa, wb = _weights(straight), _weights(resumed)
    assert wa.keys() == wb.keys() and wa and all(torch.equal(wa[k], wb[k]) for k in wa)
    init = load_file(next(_policy_dir().glob("*.safetensors")))
    assert any(not torch.equal(init[k], wa[k]) for k in init if k in wa)
    assert_resumed(out, resumed, before, 2, 4)
    for row in a:
        assert row["multi_turn/assistant_turns/mean"] == 2
        assert row["multi_turn/tool_calls/mean"] == 1 and row["multi_turn/appended_tokens/mean"] > 0
