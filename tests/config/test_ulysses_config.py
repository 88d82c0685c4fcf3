"""``parallel.ulysses_sequence_parallel_size`` (Ulysses sequence parallelism, torch backend):
verl's spellings land on it, the reference follows the actor, and bad layouts are errors that
name the key and the fix.

Planted: the old ``rejected`` rules in megarl/config/verl_compat.py fail
test_verl_spellings_map_to_the_parallel_key ("not supported by megarl"); leaving the Ulysses
factor out of the data-parallel size in validate.py fails test_sp_must_divide_the_world (no
error) and test_data_parallel_is_world_over_sp (2 prompts over "4" DP ranks: an error).
"""

from __future__ import annotations

import pytest

from megarl.backends.torch.config import backend_kwargs
from megarl.config import ConfigError
from megarl.config.loader import resolve_config
from megarl.trainer.settings import role_settings

A = "actor_rollout_ref"
KEY = "parallel.ulysses_sequence_parallel_size"


def _load(*overrides: str):
    return resolve_config("grpo", list(overrides))


@pytest.mark.parametrize("spelling, target", [
    (f"{A}.actor.ulysses_sequence_parallel_size", f"{A}.actor"),
    (f"{A}.actor.fsdp_config.ulysses_sequence_parallel_size", f"{A}.actor"),
    (f"{A}.actor.{KEY}", f"{A}.actor"),
    ("critic.ulysses_sequence_parallel_size", "critic"),
    ("critic.fsdp.ulysses_sequence_parallel_size", "critic"),
])
def test_verl_spellings_map_to_the_parallel_key(spelling, target):
    r = _load("launch.nproc_per_node=2", f"{spelling}=2", "algorithm.adv_estimator=gae")
    section = r.config.critic if target == "critic" else r.config.actor_rollout_ref.actor
    assert section.parallel.ulysses_sequence_parallel_size == 2
    assert r.notices == []


def test_reference_follows_the_actor():
    r = _load("launch.nproc_per_node=2", f"{A}.actor.ulysses_sequence_parallel_size=2",
              f"{A}.ref.ulysses_sequence_parallel_size=2")
    assert r.notices == []  # verl's default for the ref is the actor's value
    kw = {role: backend_kwargs(role_settings(role, r.config, "m"))[1]["ulysses"]
          for role in ("actor", "ref")}
    assert kw == {"actor": 2, "ref": 2}
    r = _load(f"{A}.ref.ulysses_sequence_parallel_size=2")
    assert len(r.notices) == 1 and "actor's layout" in r.notices[0]


def test_sp_must_divide_the_world():
    with pytest.raises(ConfigError) as e:
        _load("launch.nproc_per_node=2", f"{A}.actor.ulysses_sequence_parallel_size=4")
    assert f"{A}.actor.{KEY}" in str(e.value) and "does not divide the 2 ranks" in str(e.value)


def test_data_parallel_is_world_over_sp():
    """4 ranks, SP 2: 2 data-parallel ranks, so 3 prompts cannot be split (at SP 1: 4 ranks)."""
    _load("launch.nproc_per_node=4", f"{A}.actor.ulysses_sequence_parallel_size=2",
          "data.train_batch_size=2", f"{A}.actor.ppo_mini_batch_size=2")
    with pytest.raises(ConfigError, match="over 2 data-parallel ranks"):
        _load("launch.nproc_per_node=4", f"{A}.actor.ulysses_sequence_parallel_size=2",
              "data.train_batch_size=3", f"{A}.actor.ppo_mini_batch_size=3")


def test_megatron_strategy_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as e:
        _load("launch.nproc_per_node=2", f"{A}.actor.strategy=megatron",
              f"{A}.actor.ulysses_sequence_parallel_size=2")
    text = str(e.value)
    assert f"{A}.actor.{KEY}" in text and "torch backend only" in text
    assert f"{A}.actor.parallel.context_parallel_size" in text  # megatron's counterpart


def test_tp_or_pp_with_sp_is_refused():
    with pytest.raises(ConfigError) as e:
        _load("launch.nproc_per_node=4", f"{A}.actor.ulysses_sequence_parallel_size=2",
              f"{A}.actor.megatron.tensor_model_parallel_size=2")
    assert f"{A}.actor.{KEY}" in str(e.value) and "FSDP only" in str(e.value)


def test_non_positive_sp_is_an_error():
    with pytest.raises(ConfigError, match=f"{A}.actor.parallel.ulysses_sequence_parallel_size"):
        _load(f"{A}.actor.ulysses_sequence_parallel_size=0")
