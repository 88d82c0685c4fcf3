"""GRPO, PACS and PURE-PRM+VR learn on the embedded default (slow: ~3-4 min each on one core).

Each recipe runs as shipped (64 prompts x 8 responses, T=1.0) for 30 steps in one process. The
measure is the greedy accuracy on the 500 held-out problems (validation every 10 steps), which
is far less noisy than the sampled training reward; the SFT start is 23%. In the trials behind
the demo settings PURE-PRM+VR gained 13 points by steps 20-30 (P=64); the bar here is 5.
The sampled training reward must rise too (first 10 steps vs last 10).
"""

from __future__ import annotations

import os
import statistics

import pytest
from trainer_helpers import metrics, train

VAL = "val/test_score/arith"
STEPS = 30


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEGARL_LEARNING_TESTS") != "1",
                    reason="opt-in (~10 min of CPU): MEGARL_LEARNING_TESTS=1; thresholds not yet "
                           "confirmed for grpo and pacs")
@pytest.mark.parametrize("recipe", ["grpo", "pacs", "pure_prm_vr"])
def test_recipe_learns(tmp_path, demo_assets, recipe):
    train(tmp_path, recipe, f"trainer.total_training_steps={STEPS}", "trainer.test_freq=10",
          "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
          "trainer.export_hf=false", fast=False, timeout=1500)
    rows = metrics(tmp_path)
    val = {r["step"]: r[VAL] for r in rows if VAL in r}
    assert sorted(val) == [0, 10, 20, 30], val
    late = statistics.mean([val[20], val[30]])
    assert late >= val[0] + 0.05, f"{recipe}: held-out accuracy {val} (no 5-point gain)"
    score = [r["critic/score/mean"] for r in rows if r["step"] > 0]
    assert statistics.mean(score[-10:]) > statistics.mean(score[:10]), (recipe, score)
