"""Startup notices name only the user's values: an inert key set by the embedded demo's overlay
(configs/demo/base.yaml: ``trainer.total_epochs: 100`` next to ``total_training_steps: 100``) or
by a schema default says nothing; the same key set by the user's override, file or recipe does.
The trainer calls ``startup_notices(cfg)`` with the Config alone, as the tests below do where
they pass no sources."""

from __future__ import annotations

import dataclasses

from megarl.config import load_config
from megarl.config.__main__ import main as config_main
from megarl.config.loader import resolve_config
from megarl.config.notices import startup_notices

EPOCHS = "trainer.total_epochs="


def _epochs(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(EPOCHS)]


def test_demo_overlay_values_give_no_notice():
    """Planted: dropping the user_set filter (or counting demo layers as the user's) prints the
    overlay's total_epochs=100 line here."""
    resolved = resolve_config("grpo")
    assert resolved.demo and resolved.sources.written("trainer.total_epochs").startswith("demo")
    assert _epochs(startup_notices(resolved.config)) == []  # the trainer's call
    assert _epochs(startup_notices(resolved.config, resolved.sources)) == []


def test_user_override_still_gets_the_notice():
    """Both keys from overrides, and total_epochs alone on top of the demo's step count."""
    both = load_config("grpo", ["trainer.total_epochs=5", "trainer.total_training_steps=3"])
    [line] = _epochs(startup_notices(both))
    assert line.startswith("trainer.total_epochs=5: accepted without effect: "
                           "trainer.total_training_steps=3 sets the run's length")
    alone = load_config("grpo", ["trainer.total_epochs=5"])
    [line] = _epochs(startup_notices(alone))
    assert "trainer.total_training_steps=100 sets the run's length" in line


def test_user_file_and_recipe_values_are_the_users(tmp_path):
    """A value in the user's own file counts, so does one from a recipe file with the demo off."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: grpo\ntrainer: {total_epochs: 7}\n")
    [line] = _epochs(startup_notices(load_config(str(mine))))
    assert line.startswith("trainer.total_epochs=7:")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("extends: grpo\nactor_rollout_ref: {model: {path: some/model}}\n"
                      "data: {train_files: t.parquet}\n"
                      "trainer: {total_epochs: 9, total_training_steps: 4}\n")
    resolved = resolve_config(str(recipe))
    assert not resolved.demo
    [line] = _epochs(startup_notices(resolved.config))
    assert line.startswith("trainer.total_epochs=9:")


def test_a_config_without_provenance_gets_every_notice():
    """A Config copied outside the loader has no record: nothing is hidden from its notices."""
    cfg = dataclasses.replace(load_config("grpo"))
    assert len(_epochs(startup_notices(cfg))) == 1


def test_preflight_prints_no_demo_notice(capsys):
    assert config_main(["check", "grpo"]) == 0
    assert "notice: trainer.total_epochs" not in capsys.readouterr().out
    assert config_main(["check", "grpo", "trainer.total_epochs=5",
                        "trainer.total_training_steps=3"]) == 0
    assert "notice: trainer.total_epochs=5: accepted without effect" in capsys.readouterr().out
