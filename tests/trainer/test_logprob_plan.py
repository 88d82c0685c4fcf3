"""megarl.trainer.logprob_plan: which logprob passes a step runs, scenario by scenario.

Each expectation is stated from what reads the recomputation (the module doc and
megarl/trainer/correction.py), not computed by the function under test; every input is flipped
alone from a base case so that a condition read from the wrong fact fails."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.trainer.logprob_plan import (
    CorrectionFacts,
    LogprobPlan,
    StepFacts,
    plan_logprob_passes,
)

# synchronous GRPO after its first step: one update, the engine's logprobs returned, nothing
# reads the recomputation
SYNC = StepFacts(step=2, lagged=False, has_rollout_logprobs=True, one_update=True)
# asynchronous rollout, ratio against the engine's logprobs, one update
ASYNC = StepFacts(step=2, lagged=True, has_rollout_logprobs=True, one_update=True,
                  ratio_against_rollout=True)
NONE = CorrectionFacts()


def plan(facts=SYNC, correction=NONE, ratio=True, spq=False) -> LogprobPlan:
    return plan_logprob_passes(facts, correction, loss_has_ratio=ratio, needs_sum_pi_squared=spq)


def test_on_policy_step_runs_no_pass():
    """The update's own forward gives old_logprob: no pass, on-policy, nothing measured."""
    assert plan() == LogprobPlan(old_logprob_pass=False, on_policy=True, check_gap=False,
                                 pairing="sampled")


def test_the_first_step_measures_the_gap_when_the_engine_returned_logprobs():
    first = dataclasses.replace(SYNC, step=1)
    assert plan(first) == LogprobPlan(old_logprob_pass=True, on_policy=True, check_gap=True,
                                      pairing="sampled")
    # nothing to compare with: the first step stays on-policy without a pass
    blind = dataclasses.replace(first, has_rollout_logprobs=False)
    assert plan(blind) == plan()
    # rollout.check_logprobs measures it on every step
    assert plan(correction=CorrectionFacts(check_logprobs=True)).check_gap


def test_several_updates_need_the_recomputation():
    p = plan(dataclasses.replace(SYNC, one_update=False))
    assert p.old_logprob_pass and not p.on_policy and not p.check_gap


@pytest.mark.parametrize("correction", [
    CorrectionFacts(use_kl_in_reward=True), CorrectionFacts(rollout_is="token"),
    CorrectionFacts(rollout_rs="token")], ids=["kl_in_reward", "rollout_is", "rollout_rs"])
def test_readers_before_the_update_bring_the_pass_back_and_stay_on_policy(correction):
    p = plan(correction=correction)
    assert p.old_logprob_pass and p.on_policy and not p.check_gap and p.pairing == "sampled"


def test_sum_pi_squared_comes_from_the_pass():
    p = plan(spq=True)
    assert p.old_logprob_pass and p.sum_pi_squared and p.on_policy
    assert not plan().sum_pi_squared


def test_routing_replay_r2_records_only_when_the_pass_runs():
    """R2 asks the pass to record its routing; it does not call for a pass of its own."""
    r2 = CorrectionFacts(record_routing=True)
    p = plan(correction=r2)
    assert not p.old_logprob_pass and p.record_routing
    p = plan(dataclasses.replace(SYNC, one_update=False), r2)
    assert p.old_logprob_pass and p.record_routing


def test_bypass_mode_pairs_with_the_engine_logprobs_and_is_never_on_policy():
    bypass = CorrectionFacts(bypass_mode=True)
    assert plan(correction=bypass) == LogprobPlan(old_logprob_pass=False, on_policy=False,
                                                  check_gap=False, pairing="bypass")
    # with several updates the ratio is still taken against the engine's logprobs: no pass
    assert not plan(dataclasses.replace(SYNC, one_update=False), bypass).old_logprob_pass
    # the first step measures the gap: the recomputation then becomes prox_logprob
    assert plan(dataclasses.replace(SYNC, step=1), bypass).old_logprob_pass
    # lagged samples are paired by the asynchronous schedule instead
    assert plan(ASYNC, bypass).pairing == "lagged"


def test_lagged_samples_with_their_own_ratio_need_no_pass():
    assert plan(ASYNC) == LogprobPlan(old_logprob_pass=False, on_policy=False, check_gap=False,
                                      pairing="lagged")


@pytest.mark.parametrize("change,ratio", [
    ({"ratio_against_rollout": False}, True),  # the ratio against the recomputation
    ({"one_update": False}, True),  # several updates
    ({}, False),  # a loss without a ratio: importance weights on the recomputation
], ids=["ratio_vs_recomputation", "several_updates", "loss_without_ratio"])
def test_lagged_samples_otherwise_are_recomputed(change, ratio):
    p = plan(dataclasses.replace(ASYNC, **change), ratio=ratio)
    assert p.old_logprob_pass and not p.on_policy and p.pairing == "lagged"
