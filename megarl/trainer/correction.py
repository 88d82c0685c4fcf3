"""The step's rollout correction (``algorithm.rollout_correction.rollout_is``): truncated
importance weights on the engine/trainer logprob gap, put in the batch for the actor's loss.

Which logprobs are paired (verl's modes; `megarl.algos.rollout_correction` has the math):

- ``old_logprob`` is the ratio's denominator (the synchronous loop; asynchronous rollout with
  ``async_training.use_rollout_log_probs=false``): the weights are
  `exp(old_logprob - rollout_logprob)` (verl's decoupled mode) and go to the loss as
  ``rollout_is_weights``.
- the ratio is taken against the engine's logprobs (asynchronous rollout with
  ``use_rollout_log_probs=true``: `lagged_logprobs` moved the recomputation to
  ``prox_logprob``): a loss with a ratio already corrects for the behaviour policy (verl's
  bypass mode), so the weights `exp(prox_logprob - rollout_logprob)` are only measured
  (metrics), not applied, and the config's startup notice says so. A loss without a ratio
  (``policy_loss.loss_mode=reinforce``: `megarl.algos.policy_loss_has_ratio`) has nothing
  else correcting it: the same weights are applied.

Bypass mode (``algorithm.rollout_correction.bypass_mode``, verl's meaning: the ratio is taken
against the engine's sampling logprobs, no recomputed old logprobs): in the synchronous loop
`bypass_logprobs` gives the step the pairing asynchronous rollout's
``use_rollout_log_probs=true`` has (``old_logprob`` = the engine's; a recomputation, run only
when something else reads it: truncated weights, rejection, KL in the reward, the logprob
check, goes to ``prox_logprob``), and the update is never treated as on-policy (verl's new
engine; its legacy worker's on-policy shortcut would replace the rollout logprobs by the
current ones and make the ratio 1). ``loss_type=reinforce`` trains ``loss_mode=reinforce``
(`megarl.trainer.settings.actor_loss_settings`); with ``rollout_is`` its weights are then
applied, as verl's bypass REINFORCE. verl computes bypass mode's weights and rejection per
micro-batch from the evolving policy; megarl from the recomputation before the update, which
is the same policy for a single update per step.

Rejection sampling (``rollout_rs``, `add_rollout_rejection`): tokens or whole responses whose
statistic of `log pi_prox/mu` (`megarl.algos.compute_rollout_rejection_mask`) is out of bounds
leave the actor's and the critic's losses (their response mask and token counts, as verl's
modified ``response_mask``); the advantages are computed on the full mask (verl's estimators
read the rejected mask too: group scores are the same, token-whitened estimators' statistics
and a rejected token's own advantage differ, neither reaches the loss).

A loss without a ratio on samples of older policy versions (asynchronous rollout) with
``rollout_is=null`` would train them uncorrected: `check_lagged_correction` refuses that run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl import algos
from megarl.errors import UserInputError
from megarl.trainer.batch import RolloutBatch

KEY = "algorithm.rollout_correction.rollout_is"
LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
STALENESS_KEY = "async_training.staleness_threshold"


def require_rollout_logprobs(batch: RolloutBatch, level: Any, key: str = KEY) -> None:
    """Importance weights (rejection, bypass mode) need the engine's sampling logprobs of every
    response."""
    if "rollout_logprob" not in batch.tensors:
        raise UserInputError(
            f"{key}={level!r} needs the rollout engine's logprobs of the sampled tokens, and "
            "this engine returned none for some responses; use an engine that returns them "
            "(actor_rollout_ref.rollout.name=torch, vllm or sglang) or set "
            f"{key}={'false' if isinstance(level, bool) else 'null'}")


def check_lagged_correction(staleness: float, loss_mode: str, loss_has_ratio: bool,
                            rollout_is: str | None) -> None:
    """Refuse asynchronous rollout (``staleness > 0``, ``async_training.staleness_threshold``)
    with a policy loss that takes no ratio (``loss_mode``, ``loss_has_ratio`` false) and no
    importance weights (``rollout_is`` None): nothing would correct for the older policy
    versions that sampled (module doc)."""
    if staleness > 0 and not loss_has_ratio and rollout_is is None:
        raise UserInputError(
            f"{LOSS_KEY}={loss_mode!r} takes no importance ratio, so with "
            f"{STALENESS_KEY}={staleness} and {KEY}=null the samples of older policy versions "
            f"would train uncorrected; set {KEY}=token (truncated weights pi/mu on each token), or a loss with a ratio "
            f"({LOSS_KEY}=vanilla), or {STALENESS_KEY}=0")


def bypass_logprobs(batch: RolloutBatch) -> None:
    """Bypass mode in the synchronous loop (module doc): the engine's logprobs become
    ``old_logprob``, a recomputation (when one ran) ``prox_logprob``."""
    require_rollout_logprobs(batch, True, "algorithm.rollout_correction.bypass_mode")
    t = batch.tensors
    if "old_logprob" in t:
        t["prox_logprob"] = t["old_logprob"]
    t["old_logprob"] = t["rollout_logprob"]


def lagged_logprobs(batch: RolloutBatch, ratio_against_rollout: bool) -> dict[str, float]:
    """Pair the logprobs of a batch sampled by an earlier policy version (asynchronous
    rollout, `megarl.trainer.async_rollout`), after ``old_logprob`` was recomputed with the
    trainer's current weights (or not: then the engine's become ``old_logprob``): measure the
    gap to the behaviour policy (`mismatch_metrics`) and choose the ratio's denominator. With
    ``ratio_against_rollout`` (``async_training.use_rollout_log_probs``) the engine's logprobs
    become ``old_logprob`` and the recomputation moves to ``prox_logprob`` (the truncated
    weights and the KL in the reward read it there)."""
    t = batch.tensors
    if "old_logprob" not in t:  # no recomputed pass this step: the ratio needs none
        t["old_logprob"] = t["rollout_logprob"]
        return {}
    behaviour, prox = t["rollout_logprob"], t["old_logprob"]
    metrics = mismatch_metrics(behaviour, prox, batch.response_mask)
    if ratio_against_rollout:
        t["prox_logprob"] = prox
        t["old_logprob"] = behaviour
    return metrics


def mismatch_metrics(behaviour: torch.Tensor, current: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Behaviour (rollout) logprobs vs the trainer's current ones, both [B, L], over the
    response ``mask`` [B, L]: ``rollout_corr/kl`` (k1 estimate of KL(behaviour || current),
    mean over tokens), ``rollout_corr/k3_kl``, and the token ratio current / behaviour
    (``ratio_mean``, ``ratio_min``, ``ratio_max``)."""
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1)
    log_ratio = (current.double() - behaviour.double()) * m
    ratio = torch.exp(log_ratio)
    on = m.bool()
    if not on.any():
        return {}
    return {
        "rollout_corr/kl": float((-log_ratio).sum() / n),
        "rollout_corr/k3_kl": float(((ratio - 1 - log_ratio) * m).sum() / n),
        "rollout_corr/ratio_mean": float((ratio * m).sum() / n),
        "rollout_corr/ratio_min": float(ratio[on].min()),
        "rollout_corr/ratio_max": float(ratio[on].max()),
    }


def add_rollout_rejection(batch: RolloutBatch, rc: Any) -> dict[str, float]:
    """Rejection sampling (``rc.rollout_rs``) on the recomputation (``prox_logprob`` where the
    ratio is taken against the engine's logprobs, else ``old_logprob``) against the engine's
    logprobs: stores ``batch.tensors["rollout_rs_keep"]`` [B, L] (1 = the token stays in the
    losses) and returns the ``rollout_corr/rollout_rs_*`` metrics."""
    require_rollout_logprobs(batch, rc.rollout_rs, "algorithm.rollout_correction.rollout_rs")
    t = batch.tensors
    proximal = t["prox_logprob"] if "prox_logprob" in t else t["old_logprob"]
    keep, metrics = algos.compute_rollout_rejection_mask(
        proximal, t["rollout_logprob"], batch.response_mask, rollout_rs=rc.rollout_rs,
        threshold=rc.rollout_rs_threshold)
    t["rollout_rs_keep"] = keep
    return metrics


def without_rejected(batch: RolloutBatch) -> RolloutBatch:
    """The batch the updates train on: with rejection sampling, its response mask lacks the
    rejected tokens (the forward's attention mask, ``response_padding_mask``, is unchanged);
    else ``batch`` itself."""
    keep = batch.tensors.get("rollout_rs_keep")
    if keep is None:
        return batch
    tensors = {**batch.tensors, "response_padding_mask": batch.response_padding_mask}
    return dataclasses.replace(batch, response_mask=batch.response_mask * keep.to(
        batch.response_mask.dtype), tensors=tensors)


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
