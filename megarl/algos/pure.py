"""PURE (Cheng et al., "Stop Summation: Min-Form Credit Assignment Is All Process Reward Model
Needs for Reasoning"): credit assignment of PRM step rewards and the RLOO advantage pipeline of
PURE's main (OpenRLHF) branch, which produced its published numbers.

Inputs are `[B, L]` response-aligned tensors: `step_rewards` holds the PRM score
`p(correct) - p(incorrect)` on each step-end token (0 elsewhere), `step_mask` marks the step-end
tokens (every token whose text ends with the separator, plus the last response token; for
multi-turn trajectories, the last model token of each turn, `megarl.trainer.prm.turn_end_mask`).
`response_mask` is 1 on the tokens the policy generated only, so tool responses appended between
turns get no reward, no return and no share of the per-token baseline.
"""

from __future__ import annotations

import math

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
from megarl.algos.groups import group_sum, leave_one_out_mean, make_groups
from megarl.algos.registry import register_advantage_pipeline

MIN_ALIASES = ("min", "strict min-form")
SUM_ALIASES = ("sum", "gamma-decay")
PURE_MODES = ("prm", "vr", "prm_vr")
NORM_VAR_FLOOR = 1e-8  # replay-buffer normalisation: rsqrt(max(var, 1e-8))


def _parse_credit_mode(mode: float | str) -> float | str:
    """Return a float temperature T > 0, "min" or "sum"."""
    if isinstance(mode, bool):
        raise ValueError(f"credit assignment mode must be a temperature or a name, got {mode!r}")
    if isinstance(mode, str):
        if mode in MIN_ALIASES:
            return "min"
        if mode in SUM_ALIASES:
            return "sum"
        try:
            mode = float(mode)
        except ValueError:
            raise ValueError(
                f"unknown credit assignment mode {mode!r}; valid: a temperature T > 0 (float), "
                f"{list(MIN_ALIASES)} or {list(SUM_ALIASES)}"
            ) from None
    if isinstance(mode, (int, float)):
        if not (math.isfinite(mode) and mode > 0):
            raise ValueError(f"credit assignment temperature must be a finite float > 0, got {mode}")
        return float(mode)
    raise ValueError(f"credit assignment mode must be a float or a string, got {type(mode).__name__}")


def pure_credit_assignment(
    step_rewards: torch.Tensor, step_mask: torch.Tensor, mode: float | str = 0.1
) -> torch.Tensor:
    """Transform PRM step rewards into token rewards `[B, L]` (non-zero only at step ends).

    Returns are then taken in the sum form (`G_t = sum_{t' >= t} token_reward_t'`):

    - `mode = T` (float > 0, PURE's default 0.1): approximate min-form. `w = softmax(-r / T)` over
      all step ends of the response; step end k gets `w_k * r_k`, so `G_0` is a soft minimum of
      the step rewards.
    - `mode = "min"` (alias "strict min-form"): strict min-form as the paper defines it: the
      return at token t is `min{r_k : step k ends at or after t}` (0 after the last step end).
      With `m_k = min_{j >= k} r_j`, step end k gets `m_k - m_{k+1}` and the last step `r_K`,
      so the sum-form return telescopes to the minimum. (The verl-branch code instead takes a
      running minimum over every token, zeros included; that is not reproduced.)
    - `mode = "sum"` (alias "gamma-decay"): no transform, `r_k` at step end k.

    A response with no step end gets all zeros. Same dtype as `step_rewards`.
    """
    check_2d("step_rewards", check_float("step_rewards", step_rewards))
    steps = check_mask("step_mask", step_mask, "step_rewards", step_rewards)
    mode = _parse_credit_mode(mode)
    dtype = step_rewards.dtype
    r = torch.where(steps, step_rewards, 0.0).to(work_dtype(dtype))
    if mode == "sum":
        out = r
    elif mode == "min":
        inf = torch.full_like(r, float("inf"))
        future_min = torch.where(steps, r, inf).flip(-1).cummin(dim=-1).values.flip(-1)  # m at t
        after = torch.cat([future_min[:, 1:], inf[:, :1]], dim=-1)  # min over step ends > t
        last = torch.isinf(after)
        step_value = future_min - torch.where(last, 0.0, after)
        out = torch.where(steps, step_value, 0.0)
    else:
        has_step = steps.any(dim=-1, keepdim=True)
        logits = torch.where(steps, -r / mode, float("-inf"))
        logits = torch.where(has_step, logits, 0.0)  # rows without steps: avoid softmax of all -inf
        weights = torch.softmax(logits, dim=-1)
        out = torch.where(steps, weights * r, 0.0)
    return out.to(dtype)


def _tokens_per_step(steps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, L]`: at each step end, the number of response tokens of that step excluding the
    step-end token itself (PURE's `num_tokens_per_step`); 0 elsewhere."""
    count = mask.long().cumsum(dim=-1)  # valid tokens up to and including t
    at_ends = torch.where(steps, count, 0)
    previous = torch.cat([torch.zeros_like(at_ends[:, :1]), at_ends[:, :-1]], dim=-1).cummax(-1).values
    return torch.where(steps, count - previous - 1, 0)


def _replay_buffer_normalize(
    adv: torch.Tensor, mask: torch.Tensor, mask_separator: bool
) -> torch.Tensor:
    """OpenRLHF `NaiveReplayBuffer.normalize` as PURE uses it, over all valid tokens.

    With `mask_separator`, entries that are exactly 0 (the zeroed step ends, plus any accidental
    exact zero) are left out of the count `N'` and reset to 0 afterwards, but stay in the
    variance numerator: `mu = sum A / N'`, `var = sum_valid (A - mu)^2 / N'`,
    `A <- (A - mu) * rsqrt(max(var, 1e-8))`.
    """
    zeros = (adv == 0) & mask if mask_separator else torch.zeros_like(mask)
    count = mask.sum() - zeros.sum()
    if count.item() == 0:
        return torch.zeros_like(adv)
    valid = torch.where(mask, adv, 0.0)
    mean = valid.sum() / count
    var = torch.where(mask, (adv - mean).square(), 0.0).sum() / count
    out = (adv - mean) * torch.rsqrt(var.clamp_min(NORM_VAR_FLOOR))
    return torch.where(mask & ~zeros, out, 0.0)


def pure_rloo_advantages(
    *,
    step_rewards: torch.Tensor,
    step_mask: torch.Tensor,
    response_mask: torch.Tensor,
    verifiable_rewards: torch.Tensor,
    group_index: torch.Tensor,
    mode: str = "prm_vr",
    credit_assignment: float | str = 0.1,
    vr_coef: float = 1.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    mask_separator: bool = True,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PURE main-branch RLOO advantages (OpenRLHF `process_experiences` + replay buffer).

    Pipeline, per response i of a group (groups by `group_index`, any order):

    1. PRM (modes `prm`, `prm_vr`): token rewards `x = pure_credit_assignment(step_rewards,
       step_mask, credit_assignment)`, outcome `o_i = sum_t x`. Token baseline
       `a_i = sum_{j != i} o_j / sum_{j != i} |y_j|` (others' reward per valid token); at step end
       k subtract `a_i * ntok_k`, ntok_k = the step's tokens excluding its end token.
    2. VR (modes `vr`, `prm_vr`): `verifiable_rewards` are {0, 1} correctness scores and become
       `v = score - 1` in {-1, 0} (PURE's encoding); add `vr_coef * (v_i - mean_{j != i} v_j)`
       at the last response token (EOS).
    3. Subtract `kl_coef * kl` on every response token (`kl` [B, L], e.g. k1 of actor vs ref).
    4. `returns` = reverse cumulative sum of the rewards; with `mask_separator` the returns at
       every step end and at EOS are set to 0 (those tokens get no policy gradient).
    5. `advantages` = returns, then (if `normalize`) the replay-buffer normalisation over all
       valid tokens of the batch (see `_replay_buffer_normalize`).

    A singleton group has no others: its PRM baseline is 0 and its VR term is 0.

    Returns:
        (advantages [B, L], returns [B, L]), zero outside `response_mask`, dtype of step_rewards.
    """
    check_2d("step_rewards", check_float("step_rewards", step_rewards))
    steps = check_mask("step_mask", step_mask, "step_rewards", step_rewards)
    mask = check_mask("response_mask", response_mask, "step_rewards", step_rewards)
    batch = step_rewards.shape[0]
    scores = check_per_row("verifiable_rewards", check_float("verifiable_rewards", verifiable_rewards), batch)
    group_index = check_group_index(group_index, batch)
    if (steps & ~mask).any():
        raise ValueError("step_mask marks tokens outside response_mask; step ends must be response tokens")
    if mode not in PURE_MODES:
        raise ValueError(f"unknown PURE reward mode {mode!r}; valid: {list(PURE_MODES)}")
    if kl is not None:
        check_same_shape("step_rewards", step_rewards, kl=check_float("kl", kl))
    out_dtype = step_rewards.dtype
    dtype = work_dtype(out_dtype)
    groups = make_groups(group_index)

    with torch.no_grad():
        rewards = torch.zeros(step_rewards.shape, dtype=dtype, device=step_rewards.device)
        if mode in ("prm", "prm_vr"):
            token_rewards = pure_credit_assignment(step_rewards.to(dtype), steps, credit_assignment)
            outcome = token_rewards.sum(dim=-1)
            length = mask.sum(dim=-1).to(dtype)
            others_reward = group_sum(outcome, groups) - outcome
            others_length = group_sum(length, groups) - length
            per_token = torch.where(
                others_length > 0, others_reward / others_length.clamp_min(1.0), 0.0
            )
            ntok = _tokens_per_step(steps, mask).to(dtype)
            rewards = token_rewards - torch.where(steps, per_token.unsqueeze(-1) * ntok, 0.0)

        has_token = mask.any(dim=-1)
        last = mask.shape[1] - 1 - mask.long().flip(-1).argmax(dim=-1)
        eos = torch.zeros_like(mask)
        eos[torch.arange(batch, device=mask.device), last] = True
        eos &= has_token.unsqueeze(-1)
        if mode in ("vr", "prm_vr"):
            if ((scores < 0) | (scores > 1)).any():
                raise ValueError("verifiable_rewards must be correctness scores in [0, 1] (1 = correct)")
            v = scores.to(dtype) - 1.0
            others, _ = leave_one_out_mean(v, groups)  # singleton: others == v, term is 0
            rewards = rewards + torch.where(eos, (vr_coef * (v - others)).unsqueeze(-1), 0.0)

        if kl is not None and kl_coef != 0:
            rewards = rewards - kl_coef * torch.where(mask, kl.to(dtype), 0.0)

        rewards = torch.where(mask, rewards, 0.0)
        returns = rewards.flip(-1).cumsum(dim=-1).flip(-1)
        if mask_separator:
            returns = torch.where(steps | eos, 0.0, returns)
        returns = torch.where(mask, returns, 0.0)
        advantages = returns.clone()
        if normalize:
            advantages = _replay_buffer_normalize(advantages, mask, mask_separator)
    return advantages.to(out_dtype), returns.to(out_dtype)


# algorithm.adv_estimator=pure_rloo: megarl.trainer.algorithm's PURE entry calls it
register_advantage_pipeline("pure_rloo", needs=("groups",), traits=("step_scores",),
                            config_block="algorithm.pure")(pure_rloo_advantages)
