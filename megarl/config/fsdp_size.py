"""verl's ``fsdp_size``, read as megarl's ``parallel.data_parallel_shard``.

verl builds each FSDP role's device mesh from ``fsdp_config.fsdp_size`` (``create_device_mesh``
of its FSDP workers): below 0, or at least the world size, the parameters are sharded over all
ranks (one ``fsdp`` dimension); otherwise over groups of ``fsdp_size`` ranks, replicated across
the groups (hybrid sharding). verl's groups are counted in ranks of the whole world: under
Ulysses sequence parallelism a group of ``fsdp_size`` consecutive ranks holds ``fsdp_size /
ulysses`` whole sequence-parallel groups, and the parameters are sharded over their ranks too.
megarl's ``parallel.data_parallel_shard`` counts the role's data-parallel ranks per shard group,
with -1 for all of them, and the torch backend shards over those ranks times the role's
``parallel.ulysses_sequence_parallel_size`` (the same ranks as verl's group): a value of at least
the world size is read as -1, any other value as ``fsdp_size / ulysses`` (the layout check then
asks for a divisor of the data-parallel size). An ``fsdp_size`` that splits a sequence-parallel
group (not a multiple of the Ulysses size) has no megarl layout and is refused.
"""

from __future__ import annotations

from typing import Any

from megarl.config.aliases import get_path, set_path
from megarl.config.provenance import Sources

_ARR = "actor_rollout_ref"
# verl's key -> megarl's key
FSDP_SIZE: dict[str, str] = {
    f"{_ARR}.actor.fsdp_config.fsdp_size": f"{_ARR}.actor.parallel.data_parallel_shard",
    "critic.fsdp.fsdp_size": "critic.parallel.data_parallel_shard",
    "critic.model.fsdp_config.fsdp_size": "critic.parallel.data_parallel_shard",
}


def shard_of(fsdp_size: int, world: int, ulysses: int = 1) -> int:
    """megarl's data_parallel_shard for verl's ``fsdp_size`` on ``world`` ranks with Ulysses
    sequence-parallel groups of ``ulysses`` ranks (``fsdp_size`` a multiple of it when below
    the world size)."""
    if fsdp_size < 0 or fsdp_size >= world:
        return -1
    return fsdp_size // ulysses


def _ulysses(tree: dict, target: str) -> int:
    """The role's Ulysses size (1 when not a positive int: validation reports it)."""
    u = get_path(tree, target.rsplit(".", 1)[0] + ".ulysses_sequence_parallel_size")
    return u if isinstance(u, int) and not isinstance(u, bool) and u > 0 else 1


def convert(values: dict[str, tuple[Any, str]], tree: dict, raw: dict,
            sources: Sources) -> list[str]:
    """Read the ``fsdp_size`` keys among ``values`` (verl-only keys: {dotted: (value, source)};
    the ones handled are removed) into ``tree`` (the resolved config) and ``raw`` (the user's
    layers merged); returns the problems, one line each."""
    problems: list[str] = []
    sizes = [get_path(tree, k) for k in ("launch.nnodes", "launch.nproc_per_node")]
    world = sizes[0] * sizes[1] if all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes) else None
    for key in [k for k in FSDP_SIZE if k in values]:
        value, source = values.pop(key)
        target = FSDP_SIZE[key]
        said = f"{key}={value!r} (from {source})"
        if not isinstance(value, int) or isinstance(value, bool) or value == 0:
            problems.append(f"{said}: must be -1 (shard over all ranks) or a positive number of "
                            f"ranks per shard group, or set {target} instead")
            continue
        if world is None:
            continue  # the world size itself is reported by the validation
        ulysses = _ulysses(tree, target)
        if 0 < value < world and value % ulysses:
            u_key = target.rsplit(".", 1)[0] + ".ulysses_sequence_parallel_size"
            problems.append(f"{said}: with {u_key}={ulysses} a shard group of {value} ranks "
                            f"would split a sequence-parallel group; use a multiple of "
                            f"{ulysses} or -1 (shard over all ranks), or set {target}")
            continue
        shard = shard_of(value, world, ulysses)
        own = get_path(raw, target)
        if own is not None and value == -1:
            continue  # verl's default says nothing next to megarl's own key
        if own is not None and own != shard:
            problems.append(f"{said} and {target}={own!r}{sources(target)} are both set: the "
                            f"first is verl's spelling of the second; set one of them")
            continue
        set_path(tree, target, shard)
        set_path(raw, target, shard)
        sources.source[target] = sources.leaf[target] = source
    return problems
