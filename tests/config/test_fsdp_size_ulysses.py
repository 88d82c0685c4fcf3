"""verl's ``fsdp_size`` under Ulysses sequence parallelism: verl counts the ranks of an FSDP
group in the whole world (``create_device_mesh(world_size, fsdp_size)`` of its FSDP workers,
beside a separate ("dp", "sp") Ulysses mesh), so its groups hold whole SP groups and shard the
parameters over their ranks too. The ranks of each shard group megarl builds (the resolved
``data_parallel_shard`` and Ulysses size placed by the torch backend's rank order) must be
verl's groups, rank for rank."""

from __future__ import annotations

import pytest

from megarl.backends.torch.layout import Layout
from megarl.config import ConfigError
from megarl.config.loader import resolve_config

A = "actor_rollout_ref"


def verl_groups(world: int, fsdp_size: int) -> set[frozenset[int]]:
    """The rank sets of verl's FSDP shard dimension: mesh (world,) or (world // fsdp_size,
    fsdp_size) over ranks 0..world-1 in row-major order."""
    if fsdp_size < 0 or fsdp_size >= world:
        return {frozenset(range(world))}
    return {frozenset(range(s, s + fsdp_size)) for s in range(0, world, fsdp_size)}


def megarl_groups(world: int, shard: int, ulysses: int) -> set[frozenset[int]]:
    """Shard groups of the torch backend's layout: rank = (dp_idx * ulysses + sp_idx), dp_idx
    = rep * shard_group + shard_idx; a group is one ``rep`` (all shard_idx, all sp_idx)."""
    lay = Layout.resolve(world, dp_shard=shard, ulysses=ulysses)
    g = lay.shard_group
    return {frozenset((rep * g + i) * ulysses + s for i in range(g) for s in range(ulysses))
            for rep in range(lay.dp_replicate)}


@pytest.mark.parametrize("world, ulysses, fsdp_size", [
    (64, 4, 32), (64, 4, 8), (64, 4, 4), (64, 4, -1), (64, 4, 64), (64, 4, 128),
    (16, 2, 8), (16, 2, 2), (8, 1, 2), (8, 8, 8), (4, 2, 2),
])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_shard_groups_are_verls(world, ulysses, fsdp_size, role):
    if role == "actor":
        args = [f"{A}.actor.ulysses_sequence_parallel_size={ulysses}",
                f"{A}.actor.fsdp_config.fsdp_size={fsdp_size}"]
        shard_key = f"{A}.actor.parallel.data_parallel_shard"
    else:
        args = [f"critic.ulysses_sequence_parallel_size={ulysses}",
                f"critic.model.fsdp_config.fsdp_size={fsdp_size}"]
        shard_key = "critic.parallel.data_parallel_shard"
    nodes = world // 8 if world >= 8 else 1
    cfg = resolve_config("ppo", [
        f"{A}.model.path=/models/policy", "data.train_files=/data/train.parquet",
        "critic.model.path=/models/policy", f"trainer.nnodes={nodes}",
        f"trainer.n_gpus_per_node={world // nodes}", f"data.train_batch_size={world * 4}",
        f"{A}.actor.ppo_mini_batch_size={world}", f"critic.ppo_mini_batch_size={world}",
        *args]).config
    shard = cfg
    for part in shard_key.split("."):
        shard = getattr(shard, part)
    assert megarl_groups(world, shard, ulysses) == verl_groups(world, fsdp_size)


def test_fsdp_size_splitting_a_sequence_group_is_refused_naming_the_keys():
    with pytest.raises(ConfigError) as e:
        resolve_config("grpo", [
            f"{A}.model.path=/models/policy", "data.train_files=/data/train.parquet",
            "trainer.n_gpus_per_node=8", f"{A}.actor.ulysses_sequence_parallel_size=4",
            f"{A}.actor.fsdp_config.fsdp_size=2"])
    text = str(e.value)
    assert f"{A}.actor.fsdp_config.fsdp_size=2" in text
    assert "ulysses_sequence_parallel_size=4" in text and "multiple of 4" in text


def test_layout_refuses_a_shard_group_not_dividing_dp():
    with pytest.raises(ValueError, match=r"data_parallel_shard=3.*divisor of 4"):
        Layout.resolve(8, dp_shard=3, ulysses=2)
    lay = Layout.resolve(8, dp_shard=2, ulysses=2)
    assert (lay.dp_shard, lay.shard_group, lay.dp_replicate) == (4, 2, 2)
