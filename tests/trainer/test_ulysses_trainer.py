"""The GRPO recipe with verl's ``actor_rollout_ref.actor.ulysses_sequence_parallel_size=2`` on
2 ranks (one sequence-parallel group, DP 1; the reference follows the actor) against a 1-rank
SP=1 run on the embedded demo.

Both runs generate the same rollouts (sampling noise is a function of the seed, prompt, sample
and position, not of the world), so every logged metric of both steps must agree: rollout and
reward metrics exactly, the update's (actor/pg_loss, actor/entropy, actor/kl_loss,
actor/grad_norm, ..., and through step 1's AdamW step all of step 2) within fp32 noise. Bound:
rel 1e-5 / abs 1e-6; measured 3.0e-8 (step 1: actor/grad_norm) and 2.1e-7 (step 2:
actor/grad_norm, relative 6e-7).

Planted: FSDP averaging the gradients over DP x SP instead of summing over SP halves step 1's
actor/grad_norm (0.2449 -> 0.1225) and fails the test.
"""

from __future__ import annotations

import math

import pytest
from trainer_helpers import train, train_rows

pytestmark = pytest.mark.dist

# metrics that measure the machine, not the run
UNCOMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/time_s")


def test_grpo_ulysses_sp2_matches_one_rank(tmp_path, demo_assets):
    steps = "trainer.total_training_steps=2"
    train(tmp_path / "one", "grpo", steps)
    # no trainer.n_gpus_per_node: a layout needing 2 ranks takes the world torchrun started
    sp2 = train(tmp_path / "sp2", "grpo", steps,
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", nproc=2)
    assert "actor_rollout_ref.actor.parallel.ulysses_sequence_parallel_size = 2" in " ".join(
        sp2.stdout.split())
    one, two = train_rows(tmp_path / "one"), train_rows(tmp_path / "sp2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        keys = {k for k, v in a.items() if isinstance(v, (int, float))
                and not k.startswith(UNCOMPARED)}
        assert {"actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"} <= keys
        for k in sorted(keys):
            assert k in b, k
            if math.isnan(a[k]):
                assert math.isnan(b[k]), k
            else:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k)
