"""verl's ``fsdp_size`` read as megarl's ``parallel.data_parallel_shard`` by verl's mesh rule
(``create_device_mesh`` of verl's FSDP workers: below 0 or at least the world size, one shard
group over all ranks; otherwise groups of ``fsdp_size`` ranks)."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.config.loader import resolve_config

BASE = ["actor_rollout_ref.model.path=/models/policy", "data.train_files=/data/train.parquet",
        "trainer.n_gpus_per_node=4"]
SHARD = "actor_rollout_ref.actor.parallel.data_parallel_shard"


def verl_mesh_shape(world: int, fsdp_size: int) -> tuple[int, ...]:
    """verl 0.9's create_device_mesh, as the shape it builds."""
    if fsdp_size < 0 or fsdp_size >= world:
        return (world,)
    return (world // fsdp_size, fsdp_size)


@pytest.mark.parametrize("fsdp_size", [-1, 1, 2, 4, 8, 32])
@pytest.mark.parametrize("key,role", [
    ("actor_rollout_ref.actor.fsdp_config.fsdp_size", "actor_rollout_ref.actor"),
    ("critic.model.fsdp_config.fsdp_size", "critic"),
])
def test_fsdp_size_shards_as_verls_mesh(fsdp_size, key, role):
    r = resolve_config("ppo", [*BASE, f"{key}={fsdp_size}"])
    node = r.config.actor_rollout_ref.actor if role.endswith("actor") else r.config.critic
    shard = node.parallel.data_parallel_shard
    group = 4 if shard == -1 else shard  # megarl: -1 = all 4 data-parallel ranks
    assert verl_mesh_shape(4, fsdp_size) == ((4,) if group == 4 else (4 // group, group))
    assert not r.notices


def test_fsdp_size_and_megarls_key_disagreeing_is_one_error():
    with pytest.raises(ConfigError) as e:
        resolve_config("grpo", [*BASE, "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
                                f"{SHARD}=4"])
    assert str(e.value).count("\n") == 0 and "set one of them" in str(e.value)
    cfg = resolve_config("grpo", [*BASE, "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
                                  f"{SHARD}=2"]).config
    assert cfg.actor_rollout_ref.actor.parallel.data_parallel_shard == 2  # verl's default: silent


def test_fsdp_size_zero_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.fsdp_config.fsdp_size=0"):
        resolve_config("grpo", [*BASE, "actor_rollout_ref.actor.fsdp_config.fsdp_size=0"])
