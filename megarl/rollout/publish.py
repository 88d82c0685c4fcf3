"""The weight publisher: the stage that gives the rollout engine the actor's new weights.

A colocated step around its training part (docs/design.md, "Three schedules of the same three
stages"):

    publisher.release(timer)            the engine's memory goes to the training forwards
                                        (``rollout.free_cache_engine``: engine.sleep)
    ... learner: logprobs, advantages, updates ...
    publisher.publish(weights, step)    engine.update_weights(actor.export_weights())
    publisher.reacquire(timer)          engine.wake

The engine in a process of its own (one-step-off) labels each publish with a version, the
actor updates behind the weights; ``version_of(step)`` gives it (the engine's own count of
publishes otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

Timer = Callable[[str], AbstractContextManager[Any]]  # name -> a span timed under it


class WeightPublisher:
    """Publishes the trainer's weights into ``engine`` (a `RolloutEngine`).

    free_cache_engine: the engine sleeps while the trainer trains (its weights and KV cache
    freed where the engine can) and wakes after the publish. version_of: step -> the version
    label of the weights after that step, for engines that take one (``update_weights(...,
    version=)``); None for the others."""

    def __init__(self, engine: Any, *, free_cache_engine: bool,
                 version_of: Callable[[int], int] | None = None) -> None:
        self.engine = engine
        self.free_cache_engine = free_cache_engine
        self.version_of = version_of

    @property
    def engine_needs_weights(self) -> bool:
        """An asleep engine may have dropped its weights: it gets them even when the actor did
        not change."""
        return bool(self.engine.asleep)

    def release(self, timer: Timer) -> dict[str, float]:
        """Put the engine to sleep before the training forwards (with free_cache_engine)."""
        if not self.free_cache_engine:
            return {}
        with timer("engine_sleep"):
            self.engine.sleep()
        return {"rollout/engine_asleep": float(self.engine.asleep)}

    def publish(self, weights: Iterable[Any], step: int, timer: Timer) -> dict[str, float]:
        """Send the (HF name, tensor) stream ``weights`` (the actor's after ``step``) to the
        engine; collective over the trainer's ranks. Metrics: the bytes an engine that counts
        them received."""
        with timer("update_weights"):
            self.load(weights, step)
        sync_bytes = getattr(self.engine, "last_sync_bytes", None)
        return {} if sync_bytes is None else {"rollout/weight_sync_bytes": float(sync_bytes)}

    def load(self, weights: Iterable[Any], step: int) -> None:
        """The publish itself, untimed (a resumed run's first one)."""
        if self.version_of is None:
            self.engine.update_weights(weights)
        else:
            self.engine.update_weights(weights, version=self.version_of(step))

    def reacquire(self, timer: Timer) -> None:
        """Wake the engine after the publish (with free_cache_engine)."""
        if self.free_cache_engine:
            with timer("engine_wake"):
                self.engine.wake()
