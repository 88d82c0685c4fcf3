"""Advantage estimators (verl names) and `compute_advantages`.

Shapes: `token_rewards`, `response_mask`, `values` are `[B, L]` (B responses, L padded response
length); `group_index` and `baselines` are `[B]`. Every estimator returns `(advantages, returns)`,
both `[B, L]`, zero outside `response_mask`, in the dtype of `token_rewards`, computed without
gradient.

The sequence score is `S_i = sum_t r_{i,t} * m_{i,t}`. Rewards sit inside the mask in verl, so this
equals verl's plain row sum; the mask only makes padding garbage harmless.

Whitening (gae, reinforce_plus_plus, reinforce_plus_plus_baseline) is `masked_whiten`: batch-wide,
token-weighted, unbiased variance, `+1e-8` inside the rsqrt. It needs at least 2 valid tokens in
the batch.
"""

from __future__ import annotations

import torch

from megarl.algos._checks import (
    check_2d,
    check_float,
    check_group_index,
    check_mask,
    check_per_row,
    check_same_shape,
    work_dtype,
)
from megarl.algos.groups import group_mean_std, group_sum, leave_one_out_mean, make_groups
from megarl.algos.masked import masked_whiten
from megarl.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    lookup,
    register_advantage_estimator,
    register_advantage_pipeline,
)


def _score(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, token_rewards, 0.0).sum(dim=-1)


def _tile(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, per_row.unsqueeze(-1), 0.0)


def _need_groups(name: str, group_index: torch.Tensor | None, batch: int):
    if group_index is None:
        raise ValueError(f"advantage estimator {name!r} needs group_index (int64 [B])")
    return make_groups(group_index)


@register_advantage_estimator("gae", needs=("values",))
def gae(*, token_rewards, response_mask, values, gamma, lam, **_):
    """Generalised advantage estimation (needs `values` [B, L] from the critic).

    Backward recursion that skips masked positions (they carry the value and advantage from their
    right): `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`.
    `returns = A + V` (before whitening); advantages are then whitened batch-wide.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values ([B, L] critic values)")
    _, length = token_rewards.shape
    m = response_mask
    r = torch.where(m, token_rewards, 0.0)
    v = torch.where(m, values, 0.0)
    next_value = torch.zeros_like(r[:, 0])
    last_adv = torch.zeros_like(r[:, 0])
    advs = [None] * length
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * last_adv
        next_value = torch.where(m[:, t], v[:, t], next_value)
        last_adv = torch.where(m[:, t], adv, last_adv)
        advs[t] = last_adv
    adv = torch.stack(advs, dim=1)
    returns = torch.where(m, adv + v, 0.0)
    adv = torch.where(m, masked_whiten(adv, m), 0.0)
    return adv, returns


@register_advantage_estimator("grpo", needs=("groups",), traits=("singleton_groups",))
def grpo(*, token_rewards, response_mask, group_index, norm_adv_by_std, eps, **_):
    """GRPO: `A_i = (S_i - mean_g) / (std_g + eps)` (unbiased std), or `S_i - mean_g` when
    `norm_adv_by_std=False` (Dr.GRPO). A singleton group uses mean 0 and std 1 (as verl), so it
    gets `S_i / (1 + eps)`. Broadcast to the response tokens; returns = advantages.
    """
    groups = _need_groups("grpo", group_index, token_rewards.shape[0])
    score = _score(token_rewards, response_mask)
    mean, std = group_mean_std(score, groups)
    adv = (score - mean) / (std + eps) if norm_adv_by_std else score - mean
    adv = _tile(adv, response_mask)
    return adv, adv.clone()


@register_advantage_estimator("rloo", needs=("groups",))
def rloo(*, token_rewards, response_mask, group_index, **_):
    """RLOO: `A_i = S_i - mean_{j != i in group} S_j`. A singleton group gives 0 (a lone sample
    has no baseline to compare with; verl's loop version keeps the raw score instead).
    """
    groups = _need_groups("rloo", group_index, token_rewards.shape[0])
    score = _score(token_rewards, response_mask)
    others, _ = leave_one_out_mean(score, groups)
    adv = _tile(score - others, response_mask)
    return adv, adv.clone()


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(*, token_rewards, response_mask, gamma, **_):
    """REINFORCE++: discounted return-to-go `G_t = r_t + gamma * G_{t+1}` that restarts at every
    masked position; returns = G; advantages = batch-wide whitened G.
    """
    m = response_mask
    r = torch.where(m, token_rewards, 0.0)
    carry = torch.zeros_like(r[:, 0])
    rets = [None] * r.shape[1]
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * carry
        rets[t] = g
        carry = torch.where(m[:, t], g, 0.0)
    returns = torch.where(m, torch.stack(rets, dim=1), 0.0)
    adv = torch.where(m, masked_whiten(returns, m), 0.0)
    return adv, returns


@register_advantage_estimator("reinforce_plus_plus_baseline", needs=("groups",))
def reinforce_plus_plus_baseline(*, token_rewards, response_mask, group_index, **_):
    """REINFORCE++ with group baseline: `a_i = S_i - mean_g` (a singleton group uses mean 0),
    broadcast to tokens, then whitened batch-wide over tokens (token-weighted statistics).
    returns = advantages.
    """
    groups = _need_groups("reinforce_plus_plus_baseline", group_index, token_rewards.shape[0])
    score = _score(token_rewards, response_mask)
    mean, _ = group_mean_std(score, groups)
    tiled = _tile(score - mean, response_mask)
    adv = torch.where(response_mask, masked_whiten(tiled, response_mask), 0.0)
    return adv, adv.clone()


@register_advantage_estimator("remax", needs=("baselines",))
def remax(*, token_rewards, response_mask, baselines, **_):
    """ReMax: `returns_t = sum_{t' >= t} r_t' m_t'`, `A_t = returns_t - b_i`, where `b_i`
    (`baselines` [B]) is the score of a greedy rollout of the same prompt. No whitening.
    """
    if baselines is None:
        raise ValueError("advantage estimator 'remax' needs baselines ([B] greedy-rollout scores)")
    m = response_mask
    r = torch.where(m, token_rewards, 0.0)
    returns = torch.where(m, r.flip(-1).cumsum(-1).flip(-1), 0.0)
    adv = returns - _tile(baselines, m)
    return adv, returns


@register_advantage_estimator("opo", needs=("groups",))
def opo(*, token_rewards, response_mask, group_index, **_):
    """OPO: baseline = length-weighted group mean `sum_j |y_j| S_j / sum_j |y_j|` (the row
    itself included); `A_i = S_i - b`. A singleton group uses baseline 0 (as verl), so A_i = S_i.
    """
    groups = _need_groups("opo", group_index, token_rewards.shape[0])
    score = _score(token_rewards, response_mask)
    length = response_mask.sum(dim=-1).to(score.dtype)
    num = group_sum(length * score, groups)
    den = group_sum(length, groups)
    baseline = torch.where((groups.size > 1) & (den > 0), num / den.clamp_min(1.0), 0.0)
    adv = _tile(score - baseline, response_mask)
    return adv, adv.clone()


@register_advantage_estimator("grpo_passk", needs=("groups",))
def grpo_passk(*, token_rewards, response_mask, group_index, norm_adv_by_std, eps, **_):
    """Pass@k GRPO: in each group only the best response gets `A = S_max - S_second`, divided by
    `(std_g + eps)` when `norm_adv_by_std` (taken from the argument); everyone else gets 0. Ties
    give 0 (max == second). A singleton group gives 0 (no second response to compare with).
    """
    groups = _need_groups("grpo_passk", group_index, token_rewards.shape[0])
    score = _score(token_rewards, response_mask)
    batch = score.shape[0]
    inv = groups.inverse
    neg_inf = torch.full((groups.num_groups,), float("-inf"), dtype=score.dtype, device=score.device)
    gmax = neg_inf.scatter_reduce(0, inv, score, reduce="amax")[inv]
    rows = torch.arange(batch, device=score.device)
    first = torch.full((groups.num_groups,), batch, dtype=torch.long, device=score.device)
    first = first.scatter_reduce(0, inv, torch.where(score == gmax, rows, batch), reduce="amin")
    is_best = rows == first[inv]
    rest = torch.where(is_best, float("-inf"), score)
    second = neg_inf.scatter_reduce(0, inv, rest, reduce="amax")[inv]
    multi = groups.size > 1
    gap = torch.where(multi, gmax - torch.where(multi, second, gmax), 0.0)
    if norm_adv_by_std:
        _, std = group_mean_std(score, groups)
        gap = gap / (std + eps)
    adv = _tile(torch.where(is_best & multi, gap, 0.0), response_mask)
    return adv, adv.clone()


@register_advantage_estimator("gpg", needs=("groups",))
def gpg(*, token_rewards, response_mask, group_index, **_):
    """GPG (Group Policy Gradient, verl's `compute_gpg_outcome_advantage`):
    `A_i = alpha * (S_i - mean_g)` with a singleton group using mean 0, broadcast to the tokens;
    returns = advantages.

    verl's quirk, kept: its `alpha` argument is overwritten with a **batch-level** factor
    `alpha = B / max(#{i : S_i != 0}, 1)`, B the number of responses in the whole batch (not
    the group), so a batch where few responses score non-zero scales every advantage up.
    `f_norm` is 1 (verl's default; the trainer passes none) and the group std verl computes is
    unused. Scores count inside the response mask (verl's row sum: rewards sit there).
    """
    groups = _need_groups("gpg", group_index, token_rewards.shape[0])
    score = _score(token_rewards, response_mask)
    nonzero = (score != 0).sum().clamp_min(1).to(score.dtype)
    alpha = score.shape[0] / nonzero
    mean, _ = group_mean_std(score, groups)
    adv = _tile(alpha * (score - mean), response_mask)
    return adv, adv.clone()


@register_advantage_pipeline("optimal_token_baseline", needs=("groups",))
def optimal_token_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    old_logprob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (verl's `compute_optimal_token_baseline_advantage`): a baseline
    per group and per position, weighted by a cumulative path-variance proxy.

    `G_t = sum_{t' >= t} r m` (return to go); `w_t = 1 - 2 pi_t + sum_v pi_v^2` with
    `pi_t = exp(old_logprob_t)` and `sum_pi_squared` [B, L] the actor's `sum_v pi_v^2` at each
    position (verl's `actor.calculate_sum_pi_squared`), times `rho_t^2` when
    `rollout_is_weights` are given; `W_t = cumsum_t(w m)`. Per group and position
    `B_t = sum_j G_jt W_jt m_jt / (sum_j W_jt m_jt + eps)`; `A = (G - B) m`. A singleton group
    has no baseline (A = G). ``handle_zero_tail``: in a group whose longest response is
    uniquely longest, its baseline is 0 from the second-longest length on. returns = G.

    Registered as a pipeline (its inputs are not `compute_advantages`'): with
    `algorithm.adv_estimator=optimal_token_baseline` the actor's old-logprob pass also computes
    `sum_pi_squared` (both backends, fused kernel included) and the trainer algorithm of that
    name (`megarl.trainer.algorithm`) calls this. Computed in float64 or the inputs' float
    dtype, without gradient.
    """
    check_2d("token_rewards", check_float("token_rewards", token_rewards))
    check_same_shape("token_rewards", token_rewards,
                     old_logprob=check_float("old_logprob", old_logprob),
                     sum_pi_squared=check_float("sum_pi_squared", sum_pi_squared),
                     rollout_is_weights=rollout_is_weights)
    mask = check_mask("response_mask", response_mask, "token_rewards", token_rewards)
    groups = make_groups(check_group_index(group_index, token_rewards.shape[0]))
    out_dtype = token_rewards.dtype
    dtype = work_dtype(out_dtype)
    zero = torch.zeros((), dtype=dtype, device=token_rewards.device)
    with torch.no_grad():
        m = mask.to(dtype)
        r = torch.where(mask, token_rewards.to(dtype), zero)
        returns = r.flip(-1).cumsum(-1).flip(-1) * m
        w = 1.0 - 2.0 * torch.exp(old_logprob.to(dtype)) + sum_pi_squared.to(dtype)
        if rollout_is_weights is not None:
            w = w * rollout_is_weights.to(dtype).square()
        cum_w = torch.where(mask, w, zero).cumsum(-1) * m
        inv = groups.inverse
        num = torch.zeros((groups.num_groups, r.shape[1]), dtype=dtype, device=r.device)
        den = torch.zeros_like(num)
        num = num.index_add(0, inv, returns * cum_w)
        den = den.index_add(0, inv, cum_w)
        base = (num / (den + eps))[inv]
        base = torch.where((groups.size > 1).unsqueeze(-1), base, zero)
        if handle_zero_tail:
            base = _zero_tail(base, mask, groups)
        adv = (returns - base) * m
    return adv.to(out_dtype), returns.to(out_dtype)


def _zero_tail(base: torch.Tensor, mask: torch.Tensor, groups) -> torch.Tensor:
    """Zero the baseline of each multi-row group's uniquely longest response from the
    second-longest length on (verl's ``handle_zero_tail``)."""
    lengths = mask.sum(-1)
    cols = torch.arange(base.shape[1], device=base.device)
    for g in range(groups.num_groups):
        rows = torch.nonzero(groups.inverse == g).squeeze(-1)
        if rows.numel() < 2:
            continue
        top2 = torch.topk(lengths[rows], 2)
        first, second = top2.values.tolist()
        if first > second:  # a uniquely longest response
            longest = rows[top2.indices[0]]
            base[longest] = torch.where(cols >= second, 0.0, base[longest])
    return base


def compute_advantages(
    estimator: str,
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the registered advantage estimator `estimator` (see ADVANTAGE_ESTIMATORS).

    Args:
        token_rewards: [B, L] float rewards (outcome scores on the last valid token, PRM/KL terms
            on their tokens).
        response_mask: [B, L] 0/1 or bool, 1 on response tokens.
        group_index: [B] int64; rows with equal values are one prompt's group, in any order.
            Needed by grpo, rloo, reinforce_plus_plus_baseline, opo, grpo_passk.
        values: [B, L] critic values (gae only).
        gamma, lam: discount and GAE lambda (gae; gamma also for reinforce_plus_plus).
        norm_adv_by_std: grpo / grpo_passk divide by the group std (False = Dr.GRPO).
        eps: added to the group std (grpo, grpo_passk).
        baselines: [B] greedy-rollout scores (remax only).

    Returns:
        (advantages [B, L], returns [B, L]), zero outside the mask, dtype of token_rewards.
    """
    fn = lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", estimator)
    check_2d("token_rewards", check_float("token_rewards", token_rewards))
    mask = check_mask("response_mask", response_mask, "token_rewards", token_rewards)
    batch = token_rewards.shape[0]
    out_dtype = token_rewards.dtype
    dtype = work_dtype(out_dtype)
    if values is not None:
        check_same_shape("token_rewards", token_rewards, values=check_float("values", values))
        values = values.to(dtype)
    if group_index is not None:
        group_index = check_group_index(group_index, batch)
    if baselines is not None:
        baselines = check_per_row("baselines", check_float("baselines", baselines), batch).to(dtype)
    with torch.no_grad():
        adv, ret = fn(
            token_rewards=token_rewards.to(dtype),
            response_mask=mask,
            group_index=group_index,
            values=values,
            gamma=float(gamma),
            lam=float(lam),
            norm_adv_by_std=bool(norm_adv_by_std),
            eps=float(eps),
            baselines=baselines,
        )
    return adv.to(out_dtype), ret.to(out_dtype)
