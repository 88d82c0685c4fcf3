"""GRPO, PACS and PURE-PRM+VR learn on the embedded default (slow: ~2.5 min each on one core).

Each recipe runs as shipped (64 prompts x 8 responses, T=1.0; PURE-PRM+VR with its dynamic
sampling, entropy bonus and cosine lr decay, here over 20 steps) for 20 steps in one process. The
measure is the greedy accuracy on the 500 held-out problems (validation at steps 0, 10, 20),
far less noisy than the sampled training reward; the SFT start is 23-24%. Trials on a 2-core box
(one process each) gained at step 20: GRPO +11.2, PACS +14.8, PURE-PRM+VR +9.8; the bar here is
5 points. The sampled training reward must rise too (mean of
the first 10 steps vs the last 10).
"""

from __future__ import annotations

import statistics

import pytest
from trainer_helpers import metrics, train

VAL = "val/test_score/arith"
STEPS = 20


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["grpo", "pacs", "pure_prm_vr"])
def test_recipe_learns(tmp_path, demo_assets, recipe):
    train(tmp_path, recipe, f"trainer.total_training_steps={STEPS}", "trainer.test_freq=10",
          "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
          "trainer.export_hf=false", fast=False, timeout=1500)
    rows = metrics(tmp_path)
    val = {r["step"]: r[VAL] for r in rows if VAL in r}
    assert sorted(val) == [0, 10, 20], val
    assert val[20] >= val[0] + 0.05, f"{recipe}: held-out accuracy {val} (no 5-point gain)"
    score = [r["critic/score/mean"] for r in rows if r["step"] > 0]
    assert statistics.mean(score[-10:]) > statistics.mean(score[:10]), (recipe, score)
