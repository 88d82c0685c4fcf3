"""Policy-gradient losses (verl names) and `policy_loss`.

All tensors are `[B, L]`: `logprob` (current policy, carries the gradient), `old_logprob`
(behaviour policy), `advantages`, `response_mask`, optional `rollout_is_weights` (multiplies the
per-token loss before aggregation). `d = logprob - old_logprob` is the per-token log-ratio.

Metrics (python floats): `pg_loss` (the returned loss), `pg_clipfrac`, `pg_clipfrac_lower`,
`ppo_kl = masked_mean(-d)`; fractions are `masked_mean` of indicators.
"""

from __future__ import annotations

import torch

from megarl.algos._checks import check_2d, check_float, check_mask, check_same_shape
from megarl.algos.agg import agg_loss, check_norm
from megarl.algos.masked import masked_mean
from megarl.algos.registry import (
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    lookup,
    register_policy_loss,
)

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped to 20 before exp (vanilla, cispo)
GSPO_LOG_RATIO_MAX = 10.0  # GSPO clamps its sequence log-ratio from above only


def _weighted(loss_mat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return loss_mat if weights is None else loss_mat * weights


def _metrics(loss, clipfrac, clipfrac_lower, ppo_kl) -> dict[str, float]:
    def f(x):
        return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)

    return {
        "pg_loss": f(loss),
        "pg_clipfrac": f(clipfrac),
        "pg_clipfrac_lower": f(clipfrac_lower),
        "ppo_kl": f(ppo_kl),
    }


@register_policy_loss("vanilla")
def vanilla(
    *, logprob, old_logprob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, agg_mode, rollout_is_weights, norm,
):
    """PPO clip with clip-higher and dual clip.

    `rho = exp(clamp(d, -20, 20))`; `L1 = -A rho`; `L2 = -A clip(rho, 1 - eps_low, 1 + eps_high)`;
    `Lclip = max(L1, L2)`; for `A < 0` the loss is `min(Lclip, -A c)` (dual clip), else `Lclip`.
    pg_clipfrac = frac(L2 > L1); pg_clipfrac_lower = frac(Lclip > -A c and A < 0).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    mask = response_mask
    log_ratio = torch.clamp(logprob - old_logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    negative = advantages < 0
    loss_mat = _weighted(torch.where(negative, dual, clipped), rollout_is_weights)
    loss = agg_loss(loss_mat, mask, agg_mode, **norm)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(logprob.dtype), mask)
        clipfrac_lower = masked_mean(((clipped > loss3) & negative).to(logprob.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(loss, clipfrac, clipfrac_lower, ppo_kl)


@register_policy_loss("gspo")
def gspo(
    *, logprob, old_logprob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    rollout_is_weights, norm, **_,
):
    """GSPO: sequence-level ratio with per-token gradient.

    `s_i = sum_t m d / max(|y_i|, 1)`; per token `log s = logp - sg(logp) + sg(s_i)` (clamped at
    +10), `s = exp(log s)`; token loss `max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))`.
    Aggregation is always `seq-mean-token-mean` (whatever `agg_mode` says). No dual clip, so
    pg_clipfrac_lower = 0.
    """
    mask = response_mask
    log_ratio = logprob - old_logprob
    kept = torch.where(mask, log_ratio, 0.0)
    lengths = mask.sum(dim=-1).clamp_min(1).to(logprob.dtype)
    seq_log_ratio = kept.sum(dim=-1) / lengths
    token_log_ratio = logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = _weighted(torch.maximum(loss1, loss2), rollout_is_weights)
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean", **norm)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(logprob.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(loss, clipfrac, 0.0, ppo_kl)


@register_policy_loss("geo_mean")
def geo_mean(
    *, logprob, old_logprob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    rollout_is_weights, norm, **_,
):
    """GMPO: the geometric mean of the token ratios, clipped token-wise on the side that can
    only shrink the objective's improvement.

    With `s = sign(A)`: `d_c = s * min(s d, s clip(d, -eps_low, eps_high))`; per sequence
    `r_i = exp(sum_t m d_c / (|y_i| + 1e-8))`, `A_i = sum_t m A / (|y_i| + 1e-8)` (sequence-level
    advantage) and `q_i = -A_i r_i` (times the geometric mean of the rollout IS weights when
    given). The loss is the mean of `q_i` over sequences (`agg_mode` is ignored; with the
    global normaliser, over the global batch). pg_clipfrac = frac(d clipped and A > 0),
    pg_clipfrac_lower = frac(d clipped and A < 0).
    """
    mask = response_mask
    log_ratio = logprob - old_logprob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    d_min = sign * torch.minimum(sign * log_ratio, sign * clamped)
    m = mask.to(logprob.dtype)
    lengths = m.sum(dim=-1)
    ratio = torch.exp((d_min * m).sum(dim=-1) / (lengths + 1e-8))
    seq_adv = (advantages * m).sum(dim=-1) / (lengths + 1e-8)
    seq_loss = -seq_adv * ratio
    if rollout_is_weights is not None:
        seq_loss = seq_loss * torch.exp(
            (torch.log(rollout_is_weights.clamp_min(1e-10)) * m).sum(dim=-1) / (lengths + 1e-8))
    # One value per sequence, spread over its tokens so that a token sum gives it back.
    loss_mat = (seq_loss / lengths.clamp_min(1)).unsqueeze(-1).expand_as(logprob)
    loss = agg_loss(loss_mat, mask, "seq-mean-token-sum", **norm)
    with torch.no_grad():
        clipped = (log_ratio != clamped).to(logprob.dtype)
        clipfrac = masked_mean(clipped * (advantages > 0), mask)
        clipfrac_lower = masked_mean(clipped * (advantages < 0), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(loss, clipfrac, clipfrac_lower, ppo_kl)


@register_policy_loss("cispo")
def cispo(
    *, logprob, old_logprob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    agg_mode, rollout_is_weights, norm, **_,
):
    """CISPO: `loss_t = -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp` with
    `rho = exp(clamp(d, -20, 20))`; every token keeps its gradient. pg_clipfrac = frac(rho clipped),
    pg_clipfrac_lower = 0.
    """
    mask = response_mask
    log_ratio = torch.clamp(logprob - old_logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = _weighted(-clipped_ratio * advantages * logprob, rollout_is_weights)
    loss = agg_loss(loss_mat, mask, agg_mode, **norm)
    with torch.no_grad():
        clipfrac = masked_mean((ratio != clipped_ratio).to(logprob.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(loss, clipfrac, 0.0, ppo_kl)


@register_policy_loss("reinforce", ratio=False)
def reinforce(
    *, logprob, old_logprob, advantages, response_mask, agg_mode, rollout_is_weights, norm, **_,
):
    """REINFORCE: `loss_t = -A * logp` (times the rollout IS weights when given). No ratio, so
    both clip fractions are 0; ppo_kl is still reported from `old_logprob`.
    """
    loss_mat = _weighted(-advantages * logprob, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, agg_mode, **norm)
    with torch.no_grad():
        ppo_kl = masked_mean(-(logprob - old_logprob), response_mask)
    return loss, _metrics(loss, 0.0, 0.0, ppo_kl)


SAPO_TAU_POS = 1.0  # verl's actor.tau_pos
SAPO_TAU_NEG = 1.05  # verl's actor.tau_neg


@register_policy_loss("sapo", options={"tau_pos": SAPO_TAU_POS, "tau_neg": SAPO_TAU_NEG})
def sapo(
    *, logprob, old_logprob, advantages, response_mask, rollout_is_weights, norm, tau_pos,
    tau_neg, **_,
):
    """SAPO (soft adaptive policy optimisation, verl's `compute_policy_loss_sapo`): a smooth
    sigmoid gate on the ratio instead of a hard clip.

    `rho = exp(clamp(d, -20, 20))`; `tau = tau_pos` where `A > 0`, else `tau_neg` (A = 0
    included); gate `f = sigmoid(tau (rho - 1)) * 4 / tau`; token loss `-f A` (times the
    rollout IS weights when given). Aggregation is always `seq-mean-token-mean` (verl forces
    it, whatever `agg_mode` says). pg_clipfrac = pg_clipfrac_lower = 0 (nothing is clipped);
    ppo_kl = masked_mean(-d) of the clamped d. At rho = 1 the gate is 2/tau and its slope 1,
    so the gradient equals the unclipped PPO gradient on-policy.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    mask = response_mask
    log_ratio = torch.clamp(logprob - old_logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pos, neg = (torch.tensor(v, dtype=logprob.dtype, device=logprob.device)
                for v in (tau_pos, tau_neg))
    tau = torch.where(advantages > 0, pos, neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = _weighted(-gate * advantages, rollout_is_weights)
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean", **norm)
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(loss, 0.0, 0.0, ppo_kl)


@register_policy_loss("gpg", ratio=False)
def gpg(*, logprob, old_logprob, advantages, response_mask, agg_mode, rollout_is_weights, norm,
        **_):
    """GPG (verl's `compute_policy_loss_gpg`): `loss_t = -logp * A` (times the rollout IS
    weights when given), aggregated with `agg_mode`. No ratio (registered with ratio=False).
    verl returns no metrics; megarl reports both clip fractions as 0 and ppo_kl from
    `old_logprob` (as for reinforce)."""
    loss_mat = _weighted(-logprob * advantages, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, agg_mode, **norm)
    with torch.no_grad():
        ppo_kl = masked_mean(-(logprob - old_logprob), response_mask)
    return loss, _metrics(loss, 0.0, 0.0, ppo_kl)


def policy_loss(
    mode: str,
    *,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    options: dict[str, float] | None = None,
    **norm,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the registered policy loss `mode` (see POLICY_LOSSES) and return (loss, metrics).

    Args:
        logprob: [B, L] log-probs of the sampled tokens under the current policy (grad flows).
        old_logprob: [B, L] log-probs under the behaviour policy (treated as a constant).
        advantages: [B, L] (treated as a constant).
        response_mask: [B, L] 0/1 or bool.
        clip_ratio_low / clip_ratio_high: PPO clip range `[1 - low, 1 + high]` (clip-higher).
        clip_ratio_c: dual-clip bound (> 1), vanilla only.
        agg_mode: one of agg.AGG_MODES (gspo and sapo force seq-mean-token-mean).
        rollout_is_weights: optional [B, L] per-token weights multiplying the loss.
        options: settings of particular losses (`POLICY_LOSS_OPTIONS`: sapo's tau_pos,
            tau_neg); each loss gets those it declared (defaults where not given), others none.
        **norm: dp_size, batch_num_tokens, global_batch_size, loss_scale_factor (see agg_loss).

    Returns:
        (scalar loss in logprob's dtype, metrics dict of floats: pg_loss, pg_clipfrac,
        pg_clipfrac_lower, ppo_kl).
    """
    fn = lookup(POLICY_LOSSES, "policy loss", mode)
    check_2d("logprob", check_float("logprob", logprob))
    check_same_shape(
        "logprob", logprob, old_logprob=old_logprob, advantages=advantages,
        rollout_is_weights=rollout_is_weights,
    )
    mask = check_mask("response_mask", response_mask, "logprob", logprob)
    dtype = logprob.dtype

    def clean(t: torch.Tensor) -> torch.Tensor:
        # padding never reaches a loss or a gradient, even when it holds NaN or inf
        return torch.where(mask, t, torch.zeros((), dtype=dtype, device=t.device))

    old = clean(check_float("old_logprob", old_logprob).detach().to(dtype))
    adv = clean(check_float("advantages", advantages).detach().to(dtype))
    weights = None
    if rollout_is_weights is not None:
        weights = clean(check_float("rollout_is_weights", rollout_is_weights).detach().to(dtype))
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, "
            f"clip_ratio_high={clip_ratio_high}"
        )
    own = {k: float((options or {}).get(k, v)) for k, v in POLICY_LOSS_OPTIONS.get(mode, {}).items()}
    return fn(
        **own,
        logprob=clean(logprob),
        old_logprob=old,
        advantages=adv,
        response_mask=mask,
        clip_ratio_low=float(clip_ratio_low),
        clip_ratio_high=float(clip_ratio_high),
        clip_ratio_c=float(clip_ratio_c),
        agg_mode=agg_mode,
        rollout_is_weights=weights,
        norm=check_norm(norm),
    )
