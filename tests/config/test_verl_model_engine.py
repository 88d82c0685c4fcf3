"""verl 0.9's ``model_engine`` group (megarl/config/verl_model_engine.py): one value picks the
training engine of the actor, reference and critic, as verl's trainer config composes them.
Before: ``model_engine: unknown key`` on every megatron example of verl 0.9."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.config.loader import resolve_config


@pytest.mark.parametrize("engine, strategy", [
    ("megatron", "megatron"), ("dp", "torch"), ("fsdp", "torch"), ("fsdp2", "torch")])
def test_model_engine_sets_the_strategy_of_actor_and_critic(engine, strategy):
    cfg = resolve_config("ppo", [f"model_engine={engine}"]).config
    assert cfg.actor_rollout_ref.actor.strategy == strategy
    assert cfg.critic.strategy == strategy


def test_model_engine_with_a_verl_megatron_line():
    """A verl 0.9 megatron line: the group override beside the megatron keys it enables."""
    r = resolve_config("grpo", [
        "model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=2"])
    assert r.config.actor_rollout_ref.actor.strategy == "megatron"
    assert r.config.actor_rollout_ref.actor.parallel.tensor_model_parallel_size == 2


def test_another_engine_or_a_contradicting_strategy_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"model_engine='veomni'.*model_engine=dp.*megatron"):
        resolve_config("grpo", ["model_engine=veomni"])
    with pytest.raises(ConfigError, match=r"model_engine='megatron' and "
                       r"actor_rollout_ref\.actor\.strategy='torch'"):
        resolve_config("grpo", ["model_engine=megatron", "actor_rollout_ref.actor.strategy=torch"])
    # the same engine spelled both ways agrees
    cfg = resolve_config("grpo", ["model_engine=dp", "actor_rollout_ref.actor.strategy=fsdp"])
    assert cfg.config.actor_rollout_ref.actor.strategy == "torch"


@pytest.mark.parametrize("engine, strategy", [("megatron", "megatron"), ("fsdp", "torch")])
def test_actor_model_engine_sets_the_actors_strategy(engine, strategy):
    """verl 0.9's scripts write actor_rollout_ref.actor.model_engine beside the actor's strategy:
    it picks the actor's (and the reference's) engine, not the critic's. Before: an unknown
    key."""
    A = "actor_rollout_ref.actor"
    cfg = resolve_config("ppo", [f"{A}.model_engine={engine}", "critic.strategy=torch"]).config
    assert cfg.actor_rollout_ref.actor.strategy == strategy
    assert cfg.critic.strategy == "torch"
    # the verl line: both spellings, agreeing
    cfg = resolve_config("grpo", [f"{A}.strategy=megatron", f"{A}.model_engine=megatron"]).config
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    with pytest.raises(ConfigError, match=rf"{A}\.model_engine='megatron' and {A}\.strategy="
                       r"'fsdp'.*set one of them"):
        resolve_config("grpo", [f"{A}.strategy=fsdp", f"{A}.model_engine=megatron"])
    with pytest.raises(ConfigError, match=rf"{A}\.model_engine='mindspeed'.*not built here"):
        resolve_config("grpo", [f"{A}.model_engine=mindspeed"])
