"""Which logprob passes a training step runs before its updates, decided in one place.

The actor's *old-logprob pass* recomputes ``old_logprob`` [B, L] (and its entropy) with the
weights that are about to be updated. A step needs it unless the update's own forward can stand
in for it (on-policy: one update per step, samples of the current weights, the ratio taken
against the recomputation, ``old_logprob = logprob.detach()``) or the ratio is taken against the
engine's behaviour logprobs with a single update following (off-policy samples corrected by
their own ratio). Something else reading the recomputation before the update brings it back:
the engine/trainer gap check, the KL in the reward, importance weights or rejection on the
engine/trainer gap, and the ``sum_pi_squared`` an algorithm reads (OTB). Routing replay R2
records the pass's routing for the update when the pass runs; it does not call for one.

`plan_logprob_passes` is a pure function of what the schedule, the algorithm and the
correction settings say about this step; the trainer runs what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pairing = Literal["sampled", "lagged", "bypass"]


@dataclass(frozen=True)
class StepFacts:
    """What a step knows before its logprob passes."""

    step: int  # the learner step being run, 1-based
    lagged: bool  # the samples carry the policy version that sampled them (async schedule)
    has_rollout_logprobs: bool  # the engine returned its sampling logprobs
    one_update: bool  # one epoch and one mini-batch: a single optimizer step follows
    # the schedule takes the ratio against the engine's behaviour logprobs (async with
    # async_training.use_rollout_log_probs)
    ratio_against_rollout: bool = False


@dataclass(frozen=True)
class CorrectionFacts:
    """The settings that read the recomputation (``algorithm.*``, ``actor_rollout_ref.*``)."""

    bypass_mode: bool = False  # algorithm.rollout_correction.bypass_mode
    rollout_is: str | None = None  # algorithm.rollout_correction.rollout_is
    rollout_rs: str | None = None  # algorithm.rollout_correction.rollout_rs
    use_kl_in_reward: bool = False  # algorithm.use_kl_in_reward
    check_logprobs: bool = False  # actor_rollout_ref.rollout.check_logprobs
    record_routing: bool = False  # actor.router_replay.mode == "R2"


@dataclass(frozen=True)
class LogprobPlan:
    """What the step runs: the old-logprob pass or not (with which extras), whether the update
    is on-policy, whether the engine/trainer gap is measured, and how the behaviour logprobs are
    paired with the recomputation: ``sampled`` (they are the recomputation's policy), ``lagged``
    (`correction.lagged_logprobs`), ``bypass`` (`correction.bypass_logprobs`)."""

    old_logprob_pass: bool
    on_policy: bool
    check_gap: bool
    pairing: Pairing
    sum_pi_squared: bool = False
    record_routing: bool = False


def plan_logprob_passes(facts: StepFacts, correction: CorrectionFacts, *,
                        loss_has_ratio: bool, needs_sum_pi_squared: bool) -> LogprobPlan:
    """The step's `LogprobPlan` (module doc). ``loss_has_ratio``: the policy loss takes an
    importance ratio; ``needs_sum_pi_squared``: the algorithm reads the pass's sum_v pi_v^2."""
    # bypass mode: the ratio against the engine's logprobs, never on-policy; lagged samples are
    # paired by the async schedule instead
    bypass = correction.bypass_mode and not facts.lagged
    on_policy = facts.one_update and not facts.lagged and not bypass
    # lagged samples whose ratio is taken against the engine's own logprobs need no
    # recomputation when a single update follows; a loss without a ratio is corrected by
    # importance weights on the recomputation instead
    behaviour_only = (facts.lagged and facts.one_update and facts.ratio_against_rollout
                      and loss_has_ratio)
    # the gap is measured on the first step (a wrong sync shows at once) and with check_logprobs
    check = facts.has_rollout_logprobs and (correction.check_logprobs or facts.step == 1)
    read_elsewhere = (check or correction.use_kl_in_reward or correction.rollout_is is not None
                      or correction.rollout_rs is not None or needs_sum_pi_squared)
    run_pass = (not on_policy and not behaviour_only and not bypass) or read_elsewhere
    pairing: Pairing = "lagged" if facts.lagged else "bypass" if bypass else "sampled"
    return LogprobPlan(old_logprob_pass=run_pass, on_policy=on_policy, check_gap=check,
                       pairing=pairing, sum_pi_squared=needs_sum_pi_squared,
                       record_routing=correction.record_routing)
