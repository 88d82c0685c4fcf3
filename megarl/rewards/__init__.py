"""Verifiable rewards: verifiers, bounded scoring pools and reward managers.

`import megarl.rewards` imports neither torch (reward workers stay small) nor ray (an optional
extra, imported only by `make_reward_pool("ray", ...)`); the managers load torch on first use.
"""

from megarl.rewards.extract import extract_boxed
from megarl.rewards.factory import make_reward_pool
from megarl.rewards.overlong import overlong_penalty
from megarl.rewards.pool import RewardFnSpec, RewardPool, RewardRequest, RewardResult
from megarl.rewards.scoring import (
    compute_score,
    load_custom_reward_fn,
    prime_compute_score,
    verifier_name,
)

_MANAGER_NAMES = (
    "BlankRewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardManager",
    "make_reward_manager",
)


def __getattr__(name: str):
    if name in _MANAGER_NAMES:
        from megarl.rewards import managers

        return getattr(managers, name)
    raise AttributeError(f"module 'megarl.rewards' has no attribute {name!r}")


__all__ = [
    "BlankRewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardFnSpec",
    "RewardManager",
    "RewardPool",
    "RewardRequest",
    "RewardResult",
    "compute_score",
    "extract_boxed",
    "load_custom_reward_fn",
    "make_reward_manager",
    "make_reward_pool",
    "overlong_penalty",
    "prime_compute_score",
    "verifier_name",
]
