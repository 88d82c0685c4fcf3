"""A visible resume (megarl.trainer.resume_config): what it continues, the settings that differ
from the checkpoint's config.yaml, the changes of meaning it refuses without
trainer.resume=force, and "nothing left to train". Unit level (a checkpoint folder written by
hand); the run's own wiring: test_resume_visible in this file (one short demo run).

Before: a rerun printed only ``resumed from step 2`` and exited 0 having trained nothing; with
``actor_rollout_ref.actor.optim.lr=1e-5`` it continued the old run at the new learning rate
without a word; ``trainer.resume=force`` was read as a checkpoint path ("force is not a complete
checkpoint")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_helpers import metrics, train

from megarl.config import load_config, to_yaml
from megarl.errors import UserInputError
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.resume_config import check, checkpoint_for, is_meaning

LR = "actor_rollout_ref.actor.optim.lr"


def _ckpt(tmp_path: Path, overrides: list[str], step: int = 2) -> Path:
    ckpt = tmp_path / "checkpoints" / f"global_step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(to_yaml(load_config("grpo", overrides)))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (ckpt / "COMPLETE").write_text(f"{step}\n")
    return ckpt


def test_same_settings_say_what_was_resumed(tmp_path):
    ckpt = _ckpt(tmp_path, ["trainer.total_training_steps=3"])
    lines = check(load_config("grpo", ["trainer.total_training_steps=3"]), ckpt, 3)
    assert lines == [f"  checkpoint: {ckpt} (trainer.resume=auto; trainer.resume=disable starts "
                     "from step 0)",
                     "  settings: as in the checkpoint's config.yaml"]


def test_a_longer_run_lists_the_change_and_continues(tmp_path):
    ckpt = _ckpt(tmp_path, ["trainer.total_training_steps=2"])
    lines = check(load_config("grpo", ["trainer.total_training_steps=5"]), ckpt, 5)
    assert lines[1] == ("  settings that differ from the checkpoint's config.yaml (saved -> now): "
                        "trainer.total_training_steps: 2 -> 5")


def test_nothing_left_to_train_is_said(tmp_path):
    ckpt = _ckpt(tmp_path, ["trainer.total_training_steps=2"])
    lines = check(load_config("grpo", ["trainer.total_training_steps=2"]), ckpt, 2)
    assert lines[-1].startswith("nothing left to train: the checkpoint is at step 2 and the run "
                                "has 2 steps; raise trainer.total_training_steps")


@pytest.mark.parametrize("override", [f"{LR}=1e-5", "actor_rollout_ref.rollout.n=5",
                                      "algorithm.adv_estimator=rloo",
                                      "data.train_batch_size=128"])
def test_a_change_of_meaning_is_refused_unless_forced(tmp_path, override):
    ckpt = _ckpt(tmp_path, [])
    key = override.split("=")[0]
    with pytest.raises(UserInputError) as err:
        check(load_config("grpo", [override]), ckpt, 10)
    text = str(err.value)
    assert "\n" not in text and key in text and "trainer.resume=force" in text
    assert text.startswith(f"trainer.resume=auto: the checkpoint {ckpt} was trained with other "
                           "settings (saved -> now): ")
    lines = check(load_config("grpo", [override, "trainer.resume=force"]), ckpt, 10)
    assert key in lines[1] and "trainer.resume=force" in lines[0]


def test_force_takes_the_latest_checkpoint_and_verl_spelling():
    latest = Path("runs/x/checkpoints/global_step_4")
    assert checkpoint_for("force", latest) == latest
    assert checkpoint_for("auto", latest) == latest
    assert checkpoint_for("disable", latest) is None
    assert checkpoint_for("/a/global_step_2", latest) == Path("/a/global_step_2")
    assert load_config("grpo", ["trainer.resume_mode=force"]).trainer.resume == "force"
    assert is_meaning(LR) and is_meaning("algorithm.kl_ctrl.kl_coef")
    assert not is_meaning("trainer.total_training_steps") and not is_meaning("trainer.logger")
    # the judge: what its verdicts depend on, not its engine's memory settings
    assert is_meaning("reward_model.use_reward_loop") and is_meaning("reward_model.rollout.template")
    assert not is_meaning("reward_model.rollout.gpu_memory_utilization")


def test_incomplete_checkpoint_is_one_line(tmp_path):
    (tmp_path / "global_step_3").mkdir()
    cfg = load_config("grpo", [f"trainer.resume={tmp_path / 'global_step_3'}"])
    with pytest.raises(UserInputError, match=r"is not a complete checkpoint \(no COMPLETE"):
        check(cfg, tmp_path / "global_step_3")


def test_checkpoints_carry_the_run_config(tmp_path):
    """CheckpointManager.save copies the run directory's config.yaml into the checkpoint."""
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    ckpt = CheckpointManager(tmp_path / "checkpoints").save(1, lambda tmp: None, {"step": 1})
    assert (ckpt / "config.yaml").read_text() == "trainer: {}\n"


def test_resume_visible(tmp_path, demo_assets):
    """The run's own wiring: a 1-step GRPO run; the same command again says what it resumed
    and that nothing is left to train; a new learning rate is refused (exit 2, one line, no
    traceback, before any model is built) and continues under trainer.resume=force."""
    run = tmp_path / "run"
    quick = ["trainer.total_training_steps=1", "trainer.save_freq=1",
             "trainer.logger=[console,jsonl]"]
    train(run, "grpo", *quick)
    again = train(run, "grpo", *quick)
    assert "resumed from step 1\n  checkpoint: " in again.stdout
    assert "nothing left to train: the checkpoint is at step 1" in again.stdout
    refused = train(run, "grpo", *quick, f"{LR}=1e-5", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert f"{LR}: 0.0003 -> 1e-05" in refused.stderr and "trainer.resume=force" in refused.stderr
    forced = train(run, "grpo", *quick, "trainer.total_training_steps=2", f"{LR}=1e-5",
                   "trainer.resume=force")
    assert f"{LR}: 0.0003 -> 1e-05" in forced.stdout
    assert [r["step"] for r in metrics(run) if r["step"] > 0] == [1, 2]
