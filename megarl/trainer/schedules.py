"""Schedules: the order in which a run's three stages (sample producer, learner, weight
publisher) run (docs/design.md, "Three schedules of the same three stages").

Both colocated schedules run one step as `colocated_step`; they differ in the producer only.
The disaggregated one runs `fully_async_step`: no engine to release, weights published every
``trigger_parameter_sync_step`` steps.

| schedule       | keys                                                | producer                        |
|----------------|-----------------------------------------------------|---------------------------------|
| synchronous    | ``async_training.staleness_threshold=0``            | `SampleProducer`: generated now |
| one-step-off   | ``staleness_threshold=k`` >= 1 (whole steps)        | `OneStepOffProducer`: queued k steps ahead in the engine process |
| fully async    | ``actor_rollout_ref.hybrid_engine=false``           | `FullyAsyncProducer`: rollout workers generating continuously |
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config import disaggregated
from megarl.config.schema import Config
from megarl.rollout.publish import WeightPublisher
from megarl.trainer.async_rollout import OneStepOffProducer
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.fully_async import FullyAsyncProducer
from megarl.trainer.learner import Learner
from megarl.trainer.metrics import Timer
from megarl.trainer.parts import async_settings
from megarl.trainer.producer import SampleProducer

PRODUCERS: dict[str, type[SampleProducer]] = {
    "synchronous": SampleProducer,
    "one_step_off": OneStepOffProducer,
    "fully_async": FullyAsyncProducer,
}


def schedule_name(cfg: Config) -> str:
    """The run's schedule: "fully_async" with rollout workers of their own, "one_step_off"
    with a staleness bound of whole steps, else "synchronous"."""
    if disaggregated.is_disaggregated(cfg):
        return "fully_async"
    staleness, _, _ = async_settings(cfg)
    return "one_step_off" if staleness > 0 else "synchronous"


def colocated_step(step: int, producer: SampleProducer, learner: Learner,
                   publisher: WeightPublisher, timer: Timer
                   ) -> tuple[RolloutBatch, dict[str, float]]:
    """One step on devices shared by the engine and the trainer: the batch, the algorithm's
    prepare hook (it may still generate), the engine released, the learner's update, the new
    weights published (after a step that updated the actor, or into an engine that slept),
    the engine back. Returns the batch and the step's metrics so far."""
    batch, metrics = producer.produce(step, timer)
    learner.prepare(batch, producer.step_context(timer))
    metrics.update(publisher.release(timer))
    learner.update(batch, step, metrics, timer,
                   ratio_against_rollout=producer.ratio_against_rollout)
    if learner.updates_actor(step) or publisher.engine_needs_weights:
        metrics.update(publisher.publish(learner.export_weights(), step, timer))
    publisher.reacquire(timer)
    return batch, metrics


def fully_async_step(step: int, producer: FullyAsyncProducer, learner: Learner,
                     publisher: WeightPublisher, timer: Timer
                     ) -> tuple[RolloutBatch, dict[str, float]]:
    """One learner step beside rollout workers that never stop: the next ready batch, the
    update, and every ``trigger_parameter_sync_step`` steps a sync: the new weights streamed to
    the workers (after a step that updated the actor: none during the critic warmup) and the
    next window of prompts opened."""
    batch, metrics = producer.produce(step, timer)
    learner.prepare(batch, producer.step_context(timer))
    learner.update(batch, step, metrics, timer,
                   ratio_against_rollout=producer.ratio_against_rollout)
    if producer.sync_due(step):
        if learner.updates_actor(step):
            metrics.update(publisher.publish(learner.export_weights(), step, timer))
        producer.new_window()
    return batch, metrics


StepFn = Callable[[int, SampleProducer, Learner, WeightPublisher, Timer],
                  tuple[RolloutBatch, dict[str, float]]]
SCHEDULES: dict[str, StepFn] = {
    "synchronous": colocated_step,
    "one_step_off": colocated_step,
    "fully_async": fully_async_step,
}
