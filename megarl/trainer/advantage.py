"""From scores to advantages: reward placement, PURE credit assignment, KL in reward.

Inputs live in ``batch.tensors``:
  verifiable  [B]     verifiable reward of each response (0 where the manager is blank)
  step_rewards [B, L] PRM score p(correct) - p(incorrect) at step-end tokens, 0 elsewhere
  step_mask   [B, L]  1 at step-end tokens (PRM enabled only)
  old_logprob, ref_logprob [B, L]; values [B, L] (critic)
Outputs written back: token_level_scores, token_level_rewards, advantages, returns [B, L]
(and ``scores`` [B] for PACS, which computes its own advantage inside the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl import algos
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
    pure_mask_separator: bool = True
    pure_normalize: bool = True
    pacs: bool = False


def last_token_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] one-hot at each response's last valid token (all zero for empty responses)."""
    lengths = response_mask.sum(-1).long()
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = 1.0
    return out


def pure_mode(s: AdvantageSettings) -> str:
    if s.prm_enabled and s.vr_enabled:
        return "prm_vr"
    return "prm" if s.prm_enabled else "vr"


def compute_step_advantages(batch: RolloutBatch, s: AdvantageSettings,
                            kl_coef: float) -> dict[str, float]:
    """Fill token_level_scores / token_level_rewards / advantages / returns; return metrics."""
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
        kl = algos.kl_penalty(t["old_logprob"], t["ref_logprob"], s.kl_penalty) * mask
        rewards, cur_kl = algos.apply_kl_in_reward(scores, t["old_logprob"], t["ref_logprob"],
                                                   mask, kl_coef, kind=s.kl_penalty)
        metrics["actor/reward_kl_penalty"] = cur_kl
        metrics["actor/reward_kl_penalty_coeff"] = kl_coef
        metrics["_kl_for_controller"] = cur_kl
    else:
        rewards = scores
    t["token_level_rewards"] = rewards

    if s.pacs:
        t["scores"] = vr
        return metrics

    if s.estimator == "pure_rloo":
        step_rewards = t.get("step_rewards", torch.zeros_like(mask))
        step_mask = t.get("step_mask", eos)
        adv, ret = algos.pure_rloo_advantages(
            step_rewards=step_rewards, step_mask=step_mask, response_mask=mask,
            verifiable_rewards=vr, group_index=batch.group_index, mode=pure_mode(s),
            credit_assignment=s.credit_assignment, vr_coef=s.verifiable_reward_coef,
            kl=kl, kl_coef=kl_coef if kl is not None else 0.0,
            mask_separator=s.pure_mask_separator, normalize=s.pure_normalize)
    else:
        adv, ret = algos.compute_advantages(
            s.estimator, token_rewards=rewards, response_mask=mask,
            group_index=batch.group_index, values=t.get("values"), gamma=s.gamma, lam=s.lam,
            norm_adv_by_std=s.norm_adv_by_std_in_grpo, baselines=t.get("reward_baselines"))
    t["advantages"] = adv
    t["returns"] = ret
    return metrics
