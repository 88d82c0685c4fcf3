"""``reward_model.max_length`` (the outcome reward model's input cut) is read only when the
reward model runs: with ``reward_model.enable=false`` a value set for it is named among the
values set but not read, with the switch; with the reward model on it is a listed value."""

from __future__ import annotations

from megarl.config.loader import resolve_config
from megarl.config.provenance import UNUSED


def _unused_line(report: str) -> str:
    lines = [line for line in report.splitlines() if line.startswith(f"  {UNUSED} (")]
    return lines[0] if lines else ""


def test_max_length_named_unused_when_the_reward_model_is_off():
    """Planted: without max_length among the reward-model-only keys it is listed as read."""
    report = resolve_config("grpo", ["reward_model.max_length=512"]).report()
    unused = _unused_line(report)
    assert "reward_model.max_length" in unused, unused
    assert "(reward_model.enable=false)" in unused
    assert not any(line.startswith("  reward_model.max_length ") for line in report.splitlines())


def test_max_length_listed_when_the_reward_model_runs():
    report = resolve_config("pure_prm_vr", ["reward_model.max_length=512"]).report()
    assert "reward_model.max_length" not in _unused_line(report)
    assert any(line.startswith("  reward_model.max_length ") for line in report.splitlines())
