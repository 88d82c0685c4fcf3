"""verl's ``fsdp_size``, read as megarl's ``parallel.data_parallel_shard``.

verl builds each FSDP role's device mesh from ``fsdp_config.fsdp_size`` (``create_device_mesh``
of its FSDP workers): below 0, or at least the world size, the parameters are sharded over all
ranks (one ``fsdp`` dimension); otherwise over groups of ``fsdp_size`` ranks, replicated across
the groups (hybrid sharding). megarl's ``parallel.data_parallel_shard`` has the same meaning over
the role's data-parallel ranks, with -1 for all of them: a value of at least the world size is
read as -1, any other value as itself (the layout check then asks for a divisor).
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


def shard_of(fsdp_size: int, world: int) -> int:
    """megarl's data_parallel_shard for verl's ``fsdp_size`` on ``world`` ranks."""
    return -1 if fsdp_size < 0 or fsdp_size >= world else fsdp_size


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
        shard = shard_of(value, world)
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
