"""Truncated importance sampling (TIS) on the rollout / trainer logprob mismatch (verl's
``algorithm.rollout_correction.rollout_is``, `rollout_corr_helper.compute_rollout_correction_weights`).

The engine samples with its own numerics (and, with asynchronous rollout, possibly older
weights): its logprobs ``rollout_logprob`` are those of the behaviour policy mu. The trainer's
recomputation ``old_logprob`` is the proximal policy pi_old that the PPO ratio is taken against.
The weights re-weight each token's loss by ``pi_old / mu``, truncated from above:

| level (`ROLLOUT_IS_LEVELS`) | log-weight of token t of response i                            |
|-----------------------------|----------------------------------------------------------------|
| `token`                     | `d_it = old_logprob_it - rollout_logprob_it`                   |
| `sequence`                  | `sum_t m_it d_it` (one value per response, broadcast to its tokens) |

`w = min(exp(clamp(log-weight, -20, 20)), rollout_is_threshold)` on response tokens, 0 on
padding; computed in float64 (the clamp before `exp` keeps it finite: `exp(20) = 4.9e8`),
returned detached in the inputs' dtype. `token` is biased with low variance; `sequence` is the
unbiased product of the token ratios with high variance (verl's words). With
``batch_normalize`` (verl's ``rollout_is_batch_normalize``) the truncated weights are divided by
their mean (token level: over the batch's response tokens; sequence level: over its non-empty
responses, one weight each), so that they average 1.

Which pair of logprobs the trainer passes (verl's two modes):

- decoupled (the synchronous loop, and asynchronous rollout with
  ``async_training.use_rollout_log_probs=false``): the PPO ratio is `pi / pi_old` with pi_old the
  trainer's recomputation, and the weights are `pi_old / mu` with mu the engine's logprobs of the
  version that sampled. Both the numeric engine/trainer gap and a version lag are corrected here.
- bypass (asynchronous rollout with ``use_rollout_log_probs=true``): the ratio is already taken
  against mu (`pi / mu`), so it carries the correction itself; multiplying by `pi_old / mu` too
  would count it twice. As verl's bypass mode with its PPO-clip loss, the weights are then
  computed for the metrics only and not applied.

Metrics (python floats; verl's names under ``rollout_corr/``), with `w_raw` the weights before
truncation (after the +-20 log clamp), token-weighted over response tokens:
``rollout_is_mean`` / ``_max`` / ``_min`` of `w_raw` (sequence level: max/min over responses,
min without the log clamp, as verl), ``rollout_is_ratio_fraction_high`` (the fraction truncated:
`w_raw > threshold`; sequence level: over non-empty responses) and ``_fraction_low``
(`w_raw < 1 / threshold`), ``rollout_is_std`` and ``rollout_is_eff_sample_size`` of `w_raw`
clamped to `[1/threshold, threshold]` (ESS = `1 / mean((w / mean w)^2)`, a fraction in (0, 1],
1 when all weights are equal), ``rollout_is_truncated_mean`` (mean of the weights applied, a
megarl addition) and ``rollout_is_batch_norm_factor`` (with ``batch_normalize``). A batch
without response tokens gives zero weights and no metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.algos._checks import check_2d, check_float, check_mask, check_same_shape

SAFETY_BOUND = 20.0  # |log-weight| is clamped to 20 before exp (verl's bound)
NORMALIZE_MIN = 1e-8  # batch normalisation is skipped when the mean weight is below this


def _token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _sequence_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (log_ratio * mask).sum(dim=-1, keepdim=True).expand_as(log_ratio)


# level name -> (log_ratio [B, L] zero on padding, mask [B, L] float64) -> log-weights [B, L]
ROLLOUT_IS_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_weights,
    "sequence": _sequence_log_weights,
}


def compute_rollout_is_weights(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights `pi_old / mu` (module doc).

    Args:
        old_logprob: [B, L] log-probs of the sampled tokens under the proximal policy (the
            trainer's recomputation).
        rollout_logprob: [B, L] log-probs under the behaviour policy (the engine's).
        response_mask: [B, L] 0/1 or bool; padding may hold anything (NaN included).
        level: one of `ROLLOUT_IS_LEVELS` ("token", "sequence").
        threshold: upper truncation bound of the weights (> 0; verl's default 2.0).
        batch_normalize: divide the truncated weights by their batch mean.

    Returns:
        (weights [B, L] in old_logprob's dtype, detached, 0 on padding; metrics dict of floats
        named ``rollout_corr/rollout_is_*``).
    """
    fn = ROLLOUT_IS_LEVELS.get(level) if isinstance(level, str) else None
    if fn is None:
        raise ValueError(f"level (algorithm.rollout_correction.rollout_is) must be one of "
                         f"{sorted(ROLLOUT_IS_LEVELS)}, got {level!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold (algorithm.rollout_correction.rollout_is_threshold) must be "
                         f"a number > 0, got {threshold!r}; verl's default is 2.0")
    check_2d("old_logprob", check_float("old_logprob", old_logprob))
    check_same_shape("old_logprob", old_logprob,
                     rollout_logprob=check_float("rollout_logprob", rollout_logprob))
    mask = check_mask("response_mask", response_mask, "old_logprob", old_logprob)
    threshold = float(threshold)
    m = mask.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=old_logprob.device)
    log_ratio = torch.where(mask, old_logprob.detach().double() - rollout_logprob.detach().double(),
                            zero)
    log_w = fn(log_ratio, m)
    raw = torch.where(mask, torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)), zero)
    weights = torch.where(mask, raw.clamp(max=threshold), zero)
    metrics: dict[str, float] = {}
    n = m.sum()
    if n > 0:
        metrics = _metrics(raw, weights, log_w, mask, m, level, threshold)
    if batch_normalize and n > 0:
        if level == "token":
            mean = weights.sum() / n
        else:
            rows = mask.any(dim=-1)
            mean = weights.max(dim=-1).values[rows].mean()
        factor = float(mean) if float(mean) > NORMALIZE_MIN else 1.0
        weights = weights / factor
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
    return weights.to(old_logprob.dtype), metrics


def _metrics(raw: torch.Tensor, weights: torch.Tensor, log_w: torch.Tensor, mask: torch.Tensor,
             m: torch.Tensor, level: str, threshold: float) -> dict[str, float]:
    n = m.sum()
    on = mask

    def mean(x: torch.Tensor) -> float:
        return float((x * m).sum() / n)

    out = {"rollout_corr/rollout_is_mean": mean(raw),
           "rollout_corr/rollout_is_truncated_mean": mean(weights)}
    low = 1.0 / threshold
    if level == "sequence":
        rows = mask.any(dim=-1)
        seq_log = log_w[:, 0][rows]
        out["rollout_corr/rollout_is_max"] = float(torch.exp(seq_log.max().clamp(max=SAFETY_BOUND)))
        out["rollout_corr/rollout_is_min"] = float(torch.exp(seq_log.min()))
        out["rollout_corr/rollout_is_ratio_fraction_high"] = float(
            (seq_log > torch.log(torch.tensor(threshold, dtype=torch.float64))).double().mean())
        out["rollout_corr/rollout_is_ratio_fraction_low"] = float(
            (seq_log < torch.log(torch.tensor(low, dtype=torch.float64))).double().mean())
    else:
        out["rollout_corr/rollout_is_max"] = float(raw[on].max())
        out["rollout_corr/rollout_is_min"] = float(raw[on].min())
        out["rollout_corr/rollout_is_ratio_fraction_high"] = mean((raw > threshold).double())
        out["rollout_corr/rollout_is_ratio_fraction_low"] = mean((raw < low).double())
    bounded = raw.clamp(low, threshold)
    mu = mean(bounded)
    var = mean(bounded.square()) - mu * mu
    out["rollout_corr/rollout_is_std"] = max(var, 0.0) ** 0.5 if n > 1 else 0.0
    out["rollout_corr/rollout_is_eff_sample_size"] = 1.0 / mean((bounded / mu).square())
    return out
