"""From scores to advantages: reward placement, PRM credit assignment, KL in reward, and the
registered advantage estimators (``megarl.algos.compute_advantages``).

Inputs live in ``batch.tensors``:
  verifiable  [B]     verifiable reward of each response (0 where the manager is blank)
  step_rewards [B, L] PRM score p(correct) - p(incorrect) at step-end tokens, 0 elsewhere
  step_mask   [B, L]  1 at step-end tokens (PRM enabled only)
  old_logprob, ref_logprob [B, L]; values [B, L] (critic); reward_baselines [B] (greedy scores)
  prox_logprob [B, L] the trainer's recomputation where asynchronous rollout put the engine's
              logprobs in old_logprob (``megarl.trainer.async_rollout``)
Outputs written back: token_level_scores, token_level_rewards (``place_rewards``), advantages,
returns [B, L] (``estimator_advantages``). Algorithms with an advantage stage of their own
(``megarl.trainer.algorithm``) start from ``place_rewards`` too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from megarl import algos
from megarl.backends.protocol import SequenceBatch
from megarl.trainer.batch import RolloutBatch


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    prm_enabled: bool = False
    vr_enabled: bool = True  # False for reward_manager=blank
    credit_assignment: float | str = 0.1
    verifiable_reward_coef: float = 1.0


def last_token_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] one-hot at each response's last token inside the mask (all zero for empty
    responses): the last token the model generated, also where a multi-turn mask has holes
    (tool responses) or ends on appended tokens."""
    valid = response_mask > 0
    cols = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(valid, cols, -1).amax(-1)  # the position of the last 1, -1 if none
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = 1.0
    return out


def reward_kl_policy(batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy logprobs [B, L] the KL in the reward measures against the reference: the
    trainer's recomputation with its weights before the update (``prox_logprob`` where
    asynchronous rollout moved it there, else ``old_logprob``), never the engine's sampling
    logprobs, whose KL to an identical reference is the engine/trainer gap and, with a version
    lag, the older policy's. For batches of asynchronous rollout (``policy_version``) the metric
    ``actor/reward_kl_source_trainer`` says which it was: 1.0 the trainer's, 0.0 the engine's
    (``old_logprob`` is the engine's when no recomputation ran)."""
    t = batch.tensors
    policy = t["prox_logprob"] if "prox_logprob" in t else t["old_logprob"]
    if "policy_version" not in t:
        return policy, {}
    engine = policy is t.get("rollout_logprob")
    return policy, {"actor/reward_kl_source_trainer": 0.0 if engine else 1.0}


def place_rewards(batch: RolloutBatch, s: AdvantageSettings,
                  kl_coef: float) -> tuple[dict[str, float], torch.Tensor | None]:
    """Fill token_level_scores (the verifiable reward at the last token, times
    ``verifiable_reward_coef`` with a PRM, plus the PRM's credit-assigned step rewards, kept as
    ``prm_token_rewards``) and token_level_rewards (the scores minus ``kl_coef`` x the KL of
    the trainer's policy (`reward_kl_policy`) to the reference per token, with
    ``use_kl_in_reward``). Returns (metrics, the masked KL [B, L] or
    None when none is in the reward); ``_kl_for_controller`` in the metrics is the step's KL for
    the adaptive controller."""
    t = batch.tensors
    mask = batch.response_mask
    eos = last_token_mask(mask)
    vr = t["verifiable"].to(torch.float32)
    metrics: dict[str, float] = {}

    # token_level_scores: verifiable reward at the last token (+ PRM credit-assigned rewards)
    vr_coef = s.verifiable_reward_coef if s.prm_enabled else 1.0
    scores = eos * (vr * vr_coef)[:, None]
    if s.prm_enabled:
        prm_tokens = algos.pure_credit_assignment(t["step_rewards"], t["step_mask"],
                                                  mode=s.credit_assignment)
        t["prm_token_rewards"] = prm_tokens
        scores = scores + prm_tokens
        metrics["critic/outcome_reward/mean"] = float(prm_tokens.sum(-1).mean())
    t["token_level_scores"] = scores

    kl = None
    if "ref_logprob" in t and s.use_kl_in_reward:
        policy, source = reward_kl_policy(batch)
        kl = algos.kl_penalty(policy, t["ref_logprob"], s.kl_penalty) * mask
        rewards, cur_kl = algos.apply_kl_in_reward(scores, policy, t["ref_logprob"],
                                                   mask, kl_coef, kind=s.kl_penalty)
        metrics.update(source)
        metrics["actor/reward_kl_penalty"] = cur_kl
        metrics["actor/reward_kl_penalty_coeff"] = kl_coef
        metrics["_kl_for_controller"] = cur_kl
    else:
        rewards = scores
    t["token_level_rewards"] = rewards
    return metrics, kl


def estimator_advantages(batch: RolloutBatch, s: AdvantageSettings) -> None:
    """advantages, returns [B, L] from token_level_rewards by the registered estimator
    ``s.estimator`` (group_index, critic values and greedy baselines passed when present)."""
    t = batch.tensors
    adv, ret = algos.compute_advantages(
        s.estimator, token_rewards=t["token_level_rewards"], response_mask=batch.response_mask,
        group_index=batch.group_index, values=t.get("values"), gamma=s.gamma, lam=s.lam,
        norm_adv_by_std=s.norm_adv_by_std_in_grpo, baselines=t.get("reward_baselines"))
    t["advantages"] = adv
    t["returns"] = ret


def compute_step_advantages(batch: RolloutBatch, s: AdvantageSettings,
                            kl_coef: float) -> dict[str, float]:
    """The PPO family's advantage stage: ``place_rewards`` then ``estimator_advantages``;
    returns the metrics."""
    metrics, _ = place_rewards(batch, s, kl_coef)
    estimator_advantages(batch, s)
    return metrics


def old_logprob_pass(actor: Any, seq: SequenceBatch, temperature: float = 1.0, *,
                     sum_pi_squared: bool = False, record_routing: bool = False
                     ) -> dict[str, torch.Tensor]:
    """The actor's old-logprob pass of a step: ``old_logprob`` and ``entropy`` [B, L]; with
    ``sum_pi_squared`` also ``sum_pi_squared`` [B, L] (sum_v pi_v^2 at each position, what
    ``optimal_token_baseline`` reads); with ``record_routing`` (routing replay R2) also
    ``routed_experts`` [B, P + L, n_sparse, k]: the experts the routers chose in this pass, for
    the update to replay (the backend's ``recording_routing``). Collective."""
    ctx = (actor.recording_routing(seq) if record_routing
           else contextlib.nullcontext((seq, {})))
    with ctx as (batch, recorded):
        if sum_pi_squared:
            stats = actor.logprob_stats(batch, temperature)
            out = {"old_logprob": stats["logprob"], "entropy": stats["entropy"],
                   "sum_pi_squared": stats["sum_pi_squared"]}
        else:
            lp, ent = actor.logprobs(batch, temperature=temperature, with_entropy=True)
            out = {"old_logprob": lp, "entropy": ent}
    out.update(recorded)
    return out
