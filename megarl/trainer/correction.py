"""The step's rollout correction (``algorithm.rollout_correction.rollout_is``): truncated
importance weights on the engine/trainer logprob gap, put in the batch for the actor's loss.

Which logprobs are paired (verl's modes; `megarl.algos.rollout_correction` has the math):

- ``old_logprob`` is the ratio's denominator (the synchronous loop; asynchronous rollout with
  ``async_training.use_rollout_log_probs=false``): the weights are
  `exp(old_logprob - rollout_logprob)` (verl's decoupled mode) and go to the loss as
  ``rollout_is_weights``.
- the ratio is taken against the engine's logprobs (asynchronous rollout with
  ``use_rollout_log_probs=true``: `AsyncRLTrainer.behaviour_logprobs` moved the recomputation
  to ``prox_logprob``): a loss with a ratio already corrects for the behaviour policy (verl's
  bypass mode), so the weights `exp(prox_logprob - rollout_logprob)` are only measured
  (metrics), not applied, and the config's startup notice says so. A loss without a ratio
  (``policy_loss.loss_mode=reinforce``: `megarl.algos.policy_loss_has_ratio`) has nothing
  else correcting it: the same weights are applied.

A loss without a ratio on samples of older policy versions (asynchronous rollout) with
``rollout_is=null`` would train them uncorrected: `check_lagged_correction` refuses that run.
"""

from __future__ import annotations

from typing import Any

from megarl import algos
from megarl.errors import UserInputError
from megarl.trainer.batch import RolloutBatch

KEY = "algorithm.rollout_correction.rollout_is"
LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
STALENESS_KEY = "async_training.staleness_threshold"


def require_rollout_logprobs(batch: RolloutBatch, level: str) -> None:
    """Importance weights need the engine's sampling logprobs of every response."""
    if "rollout_logprob" not in batch.tensors:
        raise UserInputError(
            f"{KEY}={level!r} needs the rollout engine's logprobs of the sampled tokens, and "
            "this engine returned none for some responses; use an engine that returns them "
            "(actor_rollout_ref.rollout.name=torch, vllm or sglang) or set "
            f"{KEY}=null")


def check_lagged_correction(cfg: Any, loss_has_ratio: bool) -> None:
    """Refuse asynchronous rollout (``staleness_threshold > 0``) with a policy loss that takes no
    ratio (``loss_has_ratio`` false) and no importance weights (``rollout_is=null``): nothing
    would correct for the older policy versions that sampled (module doc)."""
    staleness = cfg.async_training.staleness_threshold
    if staleness > 0 and not loss_has_ratio and cfg.algorithm.rollout_correction.rollout_is is None:
        mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
        raise UserInputError(
            f"{LOSS_KEY}={mode!r} takes no importance ratio, so with {STALENESS_KEY}={staleness} "
            f"and {KEY}=null the samples of older policy versions would train uncorrected; set "
            f"{KEY}=token (truncated weights pi/mu on each token), or a loss with a ratio "
            f"({LOSS_KEY}=vanilla), or {STALENESS_KEY}=0")


def add_rollout_is_weights(batch: RolloutBatch, rc: Any,
                           loss_has_ratio: bool = True) -> dict[str, float]:
    """Compute the weights of ``batch`` (``rc``: the ``algorithm.rollout_correction`` section)
    from its recomputed and engine logprobs (module doc); store them as
    ``batch.tensors["rollout_is_weights"]`` [B, L] unless the ratio of the loss (``loss_has_ratio``)
    is taken against the engine's logprobs. Returns the ``rollout_corr/rollout_is_*`` metrics."""
    require_rollout_logprobs(batch, rc.rollout_is)
    t = batch.tensors
    bypass = "prox_logprob" in t
    proximal = t["prox_logprob"] if bypass else t["old_logprob"]
    weights, metrics = algos.compute_rollout_is_weights(
        proximal, t["rollout_logprob"], batch.response_mask, level=rc.rollout_is,
        threshold=rc.rollout_is_threshold, batch_normalize=rc.rollout_is_batch_normalize)
    if not (bypass and loss_has_ratio):
        t["rollout_is_weights"] = weights
    return metrics
