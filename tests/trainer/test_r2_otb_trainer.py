"""GRPO steps with ``algorithm.adv_estimator=optimal_token_baseline`` and
``actor_rollout_ref.actor.router_replay.mode=R2`` on a Qwen3-MoE policy, either strategy: the
old-logprob pass runs on every step (OTB reads its sum_pi_squared, also on-policy), records the
routing the update replays (2 mini-batches per step: the second is taken after the first moved
the routers), and both backends train the same (grad norms equal to 1e-4; measured 0.36634 /
0.51455 on both)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from trainer_helpers import FAST, REPO, env, metrics

pytestmark = [pytest.mark.e2e]

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""


def test_otb_with_r2_trains_on_both_backends(tmp_path, demo_assets):
    from megarl.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "moe", "qwen3_moe")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    rows = {}
    for strategy in ("torch", "megatron"):
        run = tmp_path / strategy
        cmd = [sys.executable, "launch/train.py", "--config", "grpo", "--demo", "on",
               f"trainer.default_local_dir={run}", *FAST, "trainer.total_training_steps=2",
               "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=32",
               f"actor_rollout_ref.model.path={path}",
               f"actor_rollout_ref.actor.strategy={strategy}",
               "actor_rollout_ref.actor.router_replay.mode=R2",
               "algorithm.adv_estimator=optimal_token_baseline",
               f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.optim.lr=1e-3"]
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows[strategy] = metrics(run)
    for rs in rows.values():
        assert [r["step"] for r in rs] == [1, 2]
        assert all("timing_s/old_log_prob" in r and r["actor/grad_norm"] > 0 for r in rs)
    for a, b in zip(rows["torch"], rows["megatron"]):
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 1e-4
