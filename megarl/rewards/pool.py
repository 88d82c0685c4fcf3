"""Bounded reward scoring: request/result types and the RewardPool interface.

Model output is untrusted, so scoring runs in worker processes that the pool can kill: every
call gets a wall-clock bound (timeout_s) and every worker an address-space bound (memory_mb).
Implementations: `local` (worker subprocesses, `megarl.rewards.local_pool`) and `ray` (Ray
actors, `megarl.rewards.ray_pool`); `megarl.rewards.factory.make_reward_pool` picks one.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Status = Literal["ok", "timeout", "error"]


@dataclass(frozen=True)
class RewardFnSpec:
    """Which score function a worker runs; picklable (a file path and name, never a function).

    kind: "default" = `compute_score` (dispatch on data_source), "prime" = PURE's {0,1}
    verifiable reward (`prime_compute_score`), "custom" = `name` from the file `path`
    called with `kwargs` bound.
    """

    kind: Literal["default", "prime", "custom"] = "default"
    path: str | None = None
    name: str = "compute_score"
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("default", "prime", "custom"):
            raise ValueError(f"RewardFnSpec.kind={self.kind!r}; use 'default', 'prime' or 'custom'")
        if self.kind == "custom" and not self.path:
            raise ValueError("RewardFnSpec(kind='custom') needs path (reward_model.custom_reward_function.path)")

    def cache_key(self) -> tuple:
        return (self.kind, self.path, self.name, repr(sorted(dict(self.kwargs).items())))


DEFAULT_FN = RewardFnSpec()


class RewardRequest(NamedTuple):
    """One response to score. `ground_truth` is a str (or a list of accepted answers, or a
    dict for countdown); `extra_info` is passed through to the function."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Mapping[str, Any] | None = None
    fn: RewardFnSpec = DEFAULT_FN


class RewardResult(NamedTuple):
    """score: the reward (0.0 unless status == "ok"); extra: other numbers a dict-returning
    function gave, or {"error": message}; status: "ok" | "timeout" | "error"."""

    score: float
    extra: dict[str, Any]
    status: Status


class RewardPool(abc.ABC):
    """Scores requests in worker processes; results keep the order of the requests.

    `stats` counts, since the pool was built: reward/timeouts, reward/errors,
    reward/crash_retries, reward/worker_restarts.
    """

    num_workers: int
    timeout_s: float
    memory_mb: int

    def __init__(self) -> None:
        self.stats = {
            "reward/timeouts": 0,
            "reward/errors": 0,
            "reward/crash_retries": 0,
            "reward/worker_restarts": 0,
        }

    def _count_status(self, status: Status) -> None:
        """Count a worker's result: "error" and "timeout" (math-verify out of time) ones."""
        if status in ("error", "timeout"):
            self.stats[f"reward/{status}s"] += 1

    @abc.abstractmethod
    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in request order. Never raises for a bad response."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers; idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
