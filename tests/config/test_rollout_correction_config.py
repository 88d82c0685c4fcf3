"""algorithm.rollout_correction: verl's keys load with verl's defaults, bad values name the key,
and the one setting where the weights are not applied is announced."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.notices import startup_notices
from megarl.config.verl_compat import classify

BASE = """
data: {train_files: train.parquet, train_batch_size: 4}
actor_rollout_ref:
  model: {path: some/model}
  actor: {ppo_mini_batch_size: 4}
  rollout: {n: 2}
algorithm: {adv_estimator: grpo}
"""
KEY = "algorithm.rollout_correction"


@pytest.fixture
def load(tmp_path):
    def run(*overrides: str):
        path = tmp_path / "c.yaml"
        path.write_text(BASE)
        return load_config(str(path), list(overrides))
    return run


def test_defaults_are_verls_and_keys_are_implemented(load):
    rc = load().algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize) == (
        None, 2.0, False)
    for name in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize"):
        assert classify(f"{KEY}.{name}").status == "implemented"
    assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode, rc.loss_type) == (
        None, None, False, "ppo_clip")
    for name in ("rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type"):
        assert classify(f"{KEY}.{name}").status == "implemented"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_levels_load(load, level):
    rc = load(f"{KEY}.rollout_is={level}", f"{KEY}.rollout_is_threshold=5").algorithm
    assert rc.rollout_correction.rollout_is == level
    assert rc.rollout_correction.rollout_is_threshold == 5.0


@pytest.mark.parametrize("override, words", [
    (f"{KEY}.rollout_is=geometric", [f"{KEY}.rollout_is", "geometric", "token", "sequence"]),
    (f"{KEY}.rollout_is_threshold=0", [f"{KEY}.rollout_is_threshold", "> 0", "2.0"]),
    (f"{KEY}.rollout_is_threshold=-1.5", [f"{KEY}.rollout_is_threshold", "-1.5"]),
    (f"{KEY}.rollout_rs=token_k1", [f"{KEY}.rollout_rs", "rollout_rs_threshold must be given"]),
    (f"{KEY}.rollout_rs=geometric", [f"{KEY}.rollout_rs", "geometric", "seq_mean_k1"]),
    (f"{KEY}.rollout_rs=token_k2", [f"{KEY}.rollout_rs", "rollout_rs_threshold"]),
])
def test_bad_values_name_the_key(load, override, words):
    with pytest.raises(ConfigError) as err:
        load(override)
    for word in words:
        assert word in str(err.value)


def test_pacs_takes_no_weights(load):
    with pytest.raises(ConfigError) as err:
        load(f"{KEY}.rollout_is=token", "pacs.enable=true", "critic.enable=false")
    text = str(err.value)
    assert text.startswith(f"{KEY}.rollout_is: ") and "pacs.enable=false" in text


def test_bypass_mode_of_async_rollout_is_announced(load):
    def lines(*o):
        return [n for n in startup_notices(load(*o)) if n.startswith(f"{KEY}.rollout_is=")]

    assert lines(f"{KEY}.rollout_is=token") == []
    assert lines(f"{KEY}.rollout_is=token", "async_training.staleness_threshold=1",
                 "async_training.use_rollout_log_probs=false") == []
    (line,) = lines(f"{KEY}.rollout_is=token", "async_training.staleness_threshold=1")
    assert "not applied" in line and "use_rollout_log_probs=false" in line
