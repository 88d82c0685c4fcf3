"""`make_reward_pool`: a pool by name ("local": subprocess workers, `megarl.rewards.local_pool`;
"ray": actors, `megarl.rewards.ray_pool`, imported only when asked for). Lives beside the pools,
not in `megarl.rewards.pool`, which they import."""

from __future__ import annotations

from typing import Any

from megarl.rewards.pool import RewardPool


def make_reward_pool(
    kind: str = "local",
    num_workers: int = 2,
    timeout_s: float = 10.0,
    memory_mb: int = 2048,
    ray_address: str | None = None,
    **kwargs: Any,
) -> RewardPool:
    """Build a pool: kind "local" (subprocess workers) or "ray" (actors; `ray_address` of a
    running cluster, or None for a local one). kwargs go to the implementation."""
    if num_workers < 1:
        raise ValueError(f"reward_model.num_workers={num_workers}; need >= 1")
    if timeout_s <= 0:
        raise ValueError(f"reward_model.timeout_s={timeout_s}; need > 0 seconds")
    if memory_mb < 64:
        raise ValueError(f"reward_model.memory_mb={memory_mb}; need >= 64 (MiB per worker)")
    if kind == "local":
        from megarl.rewards.local_pool import LocalRewardPool

        return LocalRewardPool(num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb, **kwargs)
    if kind == "ray":
        from megarl.rewards.ray_pool import RayRewardPool

        return RayRewardPool(
            num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb, address=ray_address, **kwargs
        )
    raise ValueError(f"reward_model.pool={kind!r}; use 'local' or 'ray'")
