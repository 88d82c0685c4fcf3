"""PACS (Li et al., "Implicit Actor Critic Coupling via a Supervised Learning Framework for RLVR"):
the policy is trained as a classifier of its own responses' correctness.

Faithful to PACS `compute_pacs_loss`, with two deliberate differences that give the same numbers
on PACS's own inputs: sums over tokens are masked by `response_mask` (PACS relies on zero-padded
log-probs) and groups come from `group_index` in any order (PACS needs contiguous blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.algos._checks import (
    check_2d,
    check_float,
    check_group_index,
    check_mask,
    check_per_row,
    check_same_shape,
)
from megarl.algos.groups import group_mean_std, group_sum, leave_one_out_mean, make_groups

PACS_REWARD_METHODS = ("1", "2")
PACS_ADV_ESTIMATORS = ("rloo", "grpo", "naive")
PACS_WEIGHT_MODES = ("question", "only_positive", "only_negative", None)
PACS_GRPO_EPS = 1e-6


def _class_weights(labels: torch.Tensor, groups, mode: str | None) -> torch.Tensor:
    """Per-sample BCE weights `[B]`.

    `question`: within each group where both labels occur, class c gets `n / (2 * count_c)`
    (sklearn's "balanced"); otherwise 1. `only_positive` / `only_negative`: 1 for label 1 / 0.
    """
    ones = torch.ones_like(labels)
    if mode is None:
        return ones
    positive = labels > 0.5
    if mode == "only_positive":
        return positive.to(labels.dtype)
    if mode == "only_negative":
        return (~positive).to(labels.dtype)
    n = groups.size.to(labels.dtype)
    n_pos = group_sum(positive.to(labels.dtype), groups)
    n_neg = n - n_pos
    both = (n_pos > 0) & (n_neg > 0)
    count_own = torch.where(positive, n_pos, n_neg).clamp_min(1.0)
    return torch.where(both, n / (2.0 * count_own), ones)


def pacs_loss(
    *,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_index: torch.Tensor,
    beta: float = 1.0,
    reward_method: str = "1",
    adv_estimator: str = "rloo",
    weight_mode: str | None = "question",
    norm_adv_by_std: bool = True,
    global_batch_size: int | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PACS loss: weighted BCE-with-logits of a policy-derived score psi against correctness.

    1. Reward proxy `[B]` (differentiable in `logprob`):
       method "1": `r_i = beta * sum_t m (logp - old_logp)`;
       method "2": `r_i = beta * sum_t m logp / |y_i|`.
    2. Score psi per group (`group_index`): `rloo`: `r_i - mean_{j != i} r_j` (a singleton gets
       0); `grpo`: `(r_i - mean_g) / (std_g + 1e-6)` or `r_i - mean_g` without std (a singleton
       uses mean 0, std 1, as megarl's grpo); `naive`: `r_i`.
    3. Labels y = `scores` [B] in [0, 1] (the verifier's correctness).
    4. Weights: see `_class_weights` (`weight_mode=None`: all 1).
    5. `loss = sum_i w_i BCE(psi_i, y_i) / B` (PACS's mean divides by B, not by sum w);
       `B` may be replaced by `global_batch_size` (times `dp_size`) so micro-batches holding
       whole groups accumulate to the full mini-batch loss.

    On-policy with method "1" (logp == old_logp) psi = 0, so with balanced or no weights the loss
    is exactly ln 2.

    Returns:
        (loss scalar, {"pacs_loss", "reward_mean" (mean r), "adv_mean" (mean psi)} as floats).
    """
    check_2d("logprob", check_float("logprob", logprob))
    check_same_shape("logprob", logprob, old_logprob=check_float("old_logprob", old_logprob))
    mask = check_mask("response_mask", response_mask, "logprob", logprob)
    batch = logprob.shape[0]
    labels = check_per_row("scores", check_float("scores", scores), batch).detach().to(logprob.dtype)
    groups = make_groups(check_group_index(group_index, batch))
    if reward_method not in PACS_REWARD_METHODS:
        raise ValueError(f"unknown PACS reward_method {reward_method!r}; valid: {list(PACS_REWARD_METHODS)}")
    if adv_estimator not in PACS_ADV_ESTIMATORS:
        raise ValueError(f"unknown PACS adv_estimator {adv_estimator!r}; valid: {list(PACS_ADV_ESTIMATORS)}")
    if weight_mode not in PACS_WEIGHT_MODES:
        raise ValueError(f"unknown PACS weight_mode {weight_mode!r}; valid: {list(PACS_WEIGHT_MODES)}")
    if ((labels < 0) | (labels > 1)).any():
        raise ValueError("scores must be correctness labels in [0, 1] (1 = correct)")
    if global_batch_size is not None and not global_batch_size > 0:
        raise ValueError(f"global_batch_size must be > 0, got {global_batch_size}")

    zero = torch.zeros((), dtype=logprob.dtype, device=logprob.device)
    logp = torch.where(mask, logprob, zero)
    old = torch.where(mask, old_logprob.detach().to(logprob.dtype), zero)
    if reward_method == "1":
        reward = beta * (logp - old).sum(dim=-1)
    else:
        length = mask.sum(dim=-1).clamp_min(1).to(logprob.dtype)
        reward = beta * logp.sum(dim=-1) / length

    if adv_estimator == "rloo":
        others, _ = leave_one_out_mean(reward, groups)
        psi = reward - others
    elif adv_estimator == "grpo":
        mean, std = group_mean_std(reward, groups)
        psi = (reward - mean) / (std + PACS_GRPO_EPS) if norm_adv_by_std else reward - mean
    else:
        psi = reward

    weights = _class_weights(labels, groups, weight_mode)
    per_sample = F.binary_cross_entropy_with_logits(psi, labels, weight=weights, reduction="none")
    denom = global_batch_size if global_batch_size is not None else batch
    loss = per_sample.sum() / denom * dp_size
    metrics = {
        "pacs_loss": float(loss.detach().item()),
        "reward_mean": float(reward.detach().mean().item()),
        "adv_mean": float(psi.detach().mean().item()),
    }
    return loss, metrics
