"""The colocated schedule's order of stages (megarl/trainer/schedules.py) and the weight
publisher (megarl/rollout/publish.py), with recording stages and engines: which stage runs
when, what the publisher sends and with which version label. The trainer-level proof that
the schedules reproduce the loop they replaced bit for bit is bench/recipe_fingerprint.py."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from megarl.rollout.publish import WeightPublisher
from megarl.trainer.schedules import PRODUCERS, colocated_step, fully_async_step, schedule_name


class Calls(list):
    @contextmanager
    def timer(self, name):
        self.append(f"[{name}]")
        yield


class Producer:
    ratio_against_rollout = True

    def __init__(self, calls):
        self.calls = calls

    def produce(self, step, timer):
        self.calls.append(f"produce {step}")
        return "batch", {"rollout": 1.0}

    def step_context(self, timer):
        return "ctx"


class Learner:
    def __init__(self, calls, warmup):
        self.calls, self.warmup = calls, warmup

    def updates_actor(self, step):
        return step > self.warmup

    def prepare(self, batch, ctx):
        self.calls.append(f"prepare {batch} {ctx}")

    def update(self, batch, step, metrics, timer, *, ratio_against_rollout):
        self.calls.append(f"update {step} ratio_against_rollout={ratio_against_rollout}")
        metrics["learner"] = 2.0

    def export_weights(self):
        yield "w", step_weights(self.calls)


def step_weights(calls):
    calls.append("export")
    return 0


class Engine:
    def __init__(self, calls, sleeps_without_weights=False, versions=False):
        self.calls = calls
        self.asleep = False
        self.sleeps_without_weights = sleeps_without_weights
        self.last_sync_bytes = 8
        if versions:
            self.update_weights = self._versioned

    def sleep(self):
        self.calls.append("sleep")
        self.asleep = self.sleeps_without_weights

    def wake(self):
        self.calls.append("wake")
        self.asleep = False

    def update_weights(self, weights):
        self.calls.append(f"update_weights {[n for n, _ in weights]}")

    def _versioned(self, weights, version):
        self.calls.append(f"update_weights {[n for n, _ in weights]} version={version}")


def run(step, *, warmup=0, free_cache=True, sleeps_without_weights=False):
    calls = Calls()
    engine = Engine(calls, sleeps_without_weights)
    publisher = WeightPublisher(engine, free_cache_engine=free_cache)
    batch, metrics = colocated_step(step, Producer(calls), Learner(calls, warmup), publisher,
                                    calls.timer)
    return [c for c in calls if not c.startswith("[")], metrics


def test_a_step_runs_the_stages_in_the_loops_order():
    calls, metrics = run(3)
    assert calls == ["produce 3", "prepare batch ctx", "sleep",
                     "update 3 ratio_against_rollout=True", "export", "update_weights ['w']",
                     "wake"]
    assert metrics == {"rollout": 1.0, "rollout/engine_asleep": 0.0, "learner": 2.0,
                       "rollout/weight_sync_bytes": 8.0}


def test_no_publish_during_the_critic_warmup_unless_the_engine_dropped_its_weights():
    calls, metrics = run(1, warmup=1)
    assert "update_weights ['w']" not in calls and "rollout/weight_sync_bytes" not in metrics
    calls, _ = run(1, warmup=1, sleeps_without_weights=True)
    assert "update_weights ['w']" in calls


class AsyncProducer(Producer):
    def __init__(self, calls, every):
        super().__init__(calls)
        self.every = every

    def sync_due(self, step):
        return step % self.every == 0

    def new_window(self):
        self.calls.append("new window")


@pytest.mark.parametrize("step,warmup,every,expected", [
    (2, 0, 2, ["export", "update_weights ['w']", "new window"]),
    (3, 0, 2, []),
    # the critic warmup: no weights to send, but the window opens (before: it stayed shut and
    # the workers got no prompt for the next step)
    (2, 2, 2, ["new window"]),
])
def test_fully_async_syncs_open_a_window_and_publish_only_updated_weights(step, warmup, every,
                                                                          expected):
    calls = Calls()
    publisher = WeightPublisher(Engine(calls), free_cache_engine=False)
    fully_async_step(step, AsyncProducer(calls, every), Learner(calls, warmup), publisher,
                     calls.timer)
    assert [c for c in calls if not c.startswith("[")] == [
        f"produce {step}", "prepare batch ctx", f"update {step} ratio_against_rollout=True",
        *expected]


def test_without_free_cache_the_engine_never_sleeps():
    calls, metrics = run(2, free_cache=False)
    assert "sleep" not in calls and "wake" not in calls
    assert "rollout/engine_asleep" not in metrics


def test_a_versioned_engine_gets_the_label_of_the_step():
    calls = Calls()
    publisher = WeightPublisher(Engine(calls, versions=True), free_cache_engine=False,
                                version_of=lambda step: max(0, step - 2))
    publisher.publish(iter([("a", 0)]), 5, calls.timer)
    publisher.load(iter([("b", 0)]), 1)
    assert [c for c in calls if not c.startswith("[")] == [
        "update_weights ['a'] version=3", "update_weights ['b'] version=0"]


def test_the_adapter_sender_passes_the_version_on():
    """An engine process synced by LoRA adapters (`AdapterSource`) labels its publishes as the
    plain one does. Before: the label was set on the wrapper and never reached the engine."""
    from megarl.rollout.vllm.lora import AdapterSource

    calls = Calls()
    sender = AdapterSource(Engine(calls, versions=True), lambda: iter([("lora_A", 0)]))
    WeightPublisher(sender, free_cache_engine=False, version_of=lambda step: step).publish(
        iter([("merged", 0)]), 4, calls.timer)
    assert "update_weights ['lora_A'] version=4" in calls


@pytest.mark.parametrize("staleness,name", [(0, "synchronous"), (1, "one_step_off"),
                                            (3, "one_step_off")])
def test_the_staleness_bound_selects_the_schedule(staleness, name):
    from megarl.config.loader import resolve_config

    cfg = resolve_config("grpo", [f"async_training.staleness_threshold={staleness}"]).config
    assert schedule_name(cfg) == name
    assert PRODUCERS[name].__name__ == {"synchronous": "SampleProducer",
                                        "one_step_off": "OneStepOffProducer"}[name]


def test_a_run_leaves_its_validated_config_as_it_was(tmp_path, demo_assets):
    """The config is read, never written, after validation: one PPO step (actor and critic,
    their learning-rate schedules spanning the run) in this process, and the config is the same
    value after. Before: building the run wrote the schedule's length into both roles'
    ``optim.total_training_steps``."""
    import copy
    import dataclasses

    import torch
    from trainer_helpers import FAST

    from megarl.config.loader import resolve_config
    from megarl.trainer.trainer import RLTrainer
    from megarl.utils import dist as mdist

    torch.set_num_threads(1)
    mdist.init_distributed(torch.device("cpu"))
    cfg = resolve_config("ppo", [*FAST, "trainer.total_training_steps=1", "trainer.save_freq=-1",
                                 f"trainer.default_local_dir={tmp_path}"]).config
    before = copy.deepcopy(dataclasses.asdict(cfg))
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.parts.close()  # the world of one stays, as the other in-process trainer tests
    assert dataclasses.asdict(cfg) == before
