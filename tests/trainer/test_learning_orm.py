"""GRPO learns from the demo outcome reward model alone (slow: ~2.5 min on one core).

embedded://orm (megarl.demo.orm.surprise_orm) scores a response by how expected each written
token is to a stronger arithmetic model; its score replaces the rule reward as the training
reward (verl's ``reward_model.enable``). The run is test_learning's: 64 prompts x 8 responses,
T=1.0, 20 steps in one process, greedy accuracy on the 500 held-out problems at steps 0, 10 and
20, validated with the rule reward. Measured on the shared 2-core box, 1 process: with the ORM
as the build makes it (1 thread: pairwise accuracy 0.84 on the policy's samples, 103 s) 24.0% ->
28.6% (step 10) -> 34.0% (step 20) in 137 s, the rule reward of the samples 0.14 -> 0.38 while
the training reward was the ORM's alone; with a prototype of the same construction (0.82) 24.0%
-> 31.0% -> 36.8%.
"""

from __future__ import annotations

import math
import statistics

import pytest
from trainer_helpers import metrics, train

VAL = "val/test_score/arith"
STEPS = 20
RUN_TIMEOUT = 1080  # s: below pytest's --timeout=1200 (Makefile), which would kill it first


@pytest.mark.slow
def test_grpo_learns_from_the_demo_orm(tmp_path, demo_assets):
    train(tmp_path, "grpo", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=10",
          "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
          "trainer.export_hf=false", "reward_model.enable=true",
          "reward_model.model.path=embedded://orm", "reward_model.use_dynamic_bsz=true",
          fast=False, timeout=RUN_TIMEOUT)
    rows = metrics(tmp_path)
    val = {r["step"]: r[VAL] for r in rows if VAL in r}
    assert sorted(val) == [0, 10, 20], val
    assert val[20] >= val[0] + 0.05, f"held-out accuracy {val} (no 5-point gain)"
    steps = [r for r in rows if r["step"] > 0]
    for r in steps:  # the training reward is the ORM's score, not the rule reward
        assert math.isclose(r["critic/score/mean"], r["reward/rm_score/mean"], abs_tol=1e-5)
    rule = [r["reward/score/mean"] for r in steps]
    assert statistics.mean(rule[-10:]) > statistics.mean(rule[:10]), rule
