"""GRPO with an outcome reward model (verl's ``reward_model.enable`` with a sequence classifier)
on the embedded demo: the RM's score is the training reward in place of the rule reward, which is
still logged."""

from __future__ import annotations

import math
import shutil

import pytest

from megarl.data import resolve_path
from megarl.models.testing import make_tiny_hf_model

RM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
               "<|im_end|>")


def demo_rm(folder, own_template: bool):
    """A random qwen2 sequence classifier over the demo tokenizer's vocabulary, with the demo's
    tokenizer (``own_template``: under another chat template, so its input is re-rendered)."""
    rm = make_tiny_hf_model(folder, "qwen2", head="seq_cls", tokenizer=False, vocab_size=384,
                            seed=7)
    tok_dir = resolve_path("embedded://tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{tok_dir}/{f}", rm / f)
    if own_template:
        (rm / "chat_template.jinja").write_text(RM_TEMPLATE)
    return rm


@pytest.mark.e2e
@pytest.mark.parametrize("backend,own_template", [("torch", False), ("megatron", True)])
def test_grpo_trains_on_outcome_rm_scores(tmp_path, demo_assets, backend, own_template):
    from trainer_helpers import train, train_rows

    rm = demo_rm(tmp_path / "rm", own_template)
    proc = train(tmp_path / "run", "grpo", "trainer.total_training_steps=2",
                 "reward_model.enable=true", f"reward_model.model.path={rm}",
                 "reward_model.use_dynamic_bsz=true",
                 f"actor_rollout_ref.actor.strategy={backend}")
    said = proc.stdout + proc.stderr
    assert "is an outcome reward model" in said
    assert ("re-render" in said or "own chat template" in said) == own_template
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # some response earned a rule reward: a sum of the two would show in critic/score
    assert any(r["reward/score/mean"] > 0 for r in rows)
    for row in rows:
        rm_mean = row["reward/rm_score/mean"]
        # the training reward is the RM's score (not the rule reward, not their sum)
        assert math.isclose(row["critic/score/mean"], rm_mean, abs_tol=1e-5)
        assert math.isclose(row["critic/verifiable_reward/mean"], rm_mean, abs_tol=1e-5)
        assert row["reward/score/mean"] != pytest.approx(rm_mean, abs=1e-4)
        assert row["critic/score/max"] > row["critic/score/min"]  # a real per-response score
        assert math.isfinite(row["actor/pg_loss"])
