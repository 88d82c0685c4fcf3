"""bench/async_sim.py, the schedules' simulator, against cases worked out by hand (constant
response lengths, so every engine step and learner step has a known cost)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.async_sim import (
    EngineCost,
    LengthSampler,
    TrainCost,
    Workload,
    simulate_fully_async,
    simulate_one_step_off,
    simulate_synchronous,
)

D0, TRAIN = 0.01, 2.0  # s per decode step (any batch), s per learner step


def _workload(length: int, steps: int = 12, warmup: int = 2) -> Workload:
    # geometric with p = 1 and a cap: every response exactly `length` tokens when p = 1e-12
    return Workload(prompts=4, n=2, prompt_len=5, steps=steps, warmup=warmup,
                    lengths=LengthSampler(max_len=length, stop_p=1e-12))


ENG = EngineCost(d0=D0, d1=0.0, d2=0.0, p=0.0)
TRAINER = TrainCost(t0=TRAIN, t1=0.0)


def test_synchronous_is_generation_then_training():
    # 8 sequences of 100 tokens in 16 slots: 100 steps of 0.01 s, then 2 s of training
    got = simulate_synchronous(_workload(100), ENG, TRAINER, slots=16)
    assert got == pytest.approx(8 / (100 * D0 + TRAIN))
    # 4 slots: two waves of 100 steps
    assert simulate_synchronous(_workload(100), ENG, TRAINER, slots=4) == \
        pytest.approx(8 / (200 * D0 + TRAIN))


@pytest.mark.parametrize("length", [100, 400])
def test_one_step_off_hides_the_shorter_side(length):
    gen = length * D0  # 1 s or 4 s against 2 s of training
    got = simulate_one_step_off(_workload(length), ENG, TRAINER, slots=16)
    assert got == pytest.approx(8 / max(gen, TRAIN))


def test_fully_async_with_no_staleness_is_synchronous_on_the_workers():
    got = simulate_fully_async(_workload(100), ENG, TRAINER, workers=1, slots=16, capacity=32,
                               staleness=0.0, sync_every=1, partial=False)
    assert got["samples_per_s"] == pytest.approx(8 / (100 * D0 + TRAIN))
    assert got["lag_mean"] == 0


@pytest.mark.parametrize("partial", [False, True])
def test_fully_async_runs_ahead_by_its_window(partial):
    # staleness 1: the next step's prompts generate while this one trains: 1 s of generation
    # hides behind 2 s of training, and each batch is one version behind after the first
    got = simulate_fully_async(_workload(100), ENG, TRAINER, workers=1, slots=16, capacity=32,
                               staleness=1.0, sync_every=1, partial=partial)
    assert got["samples_per_s"] == pytest.approx(8 / TRAIN)
    assert got["trainer_wait"] == pytest.approx(0.0)
    assert 0.9 <= got["lag_mean"] <= 1.0


def test_partial_rollout_does_not_wait_for_the_longest_request():
    # one prompt of a step runs 10x longer than the rest; staleness 1 and a sync every step:
    # without partial rollout each sync waits for the long requests to end before the next
    # window's prompts start; with it they go on under the new weights
    class Tail(LengthSampler):
        def draw(self, k):
            self.calls = getattr(self, "calls", 0) + 1
            return np.full(k, 400 if self.calls % 4 == 0 else 40, dtype=np.int64)

    w = _workload(40)
    runs = {}
    for partial in (False, True):
        w.lengths = Tail(max_len=400)
        runs[partial] = simulate_fully_async(w, ENG, TRAINER, workers=1, slots=16, capacity=32,
                                             staleness=1.0, sync_every=1,
                                             partial=partial)["samples_per_s"]
    assert runs[True] > 1.2 * runs[False], runs
