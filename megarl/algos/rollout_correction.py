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

`logprob_diff_metrics`: the gap itself, |engine - trainer| logprob per token
(``rollout/logprob_abs_diff_{mean,max}``, ``rollout.check_logprobs``).
"""

from __future__ import annotations

import math
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


# ---------------------------------------------------------------------------------------------
# Rejection sampling (verl's ``algorithm.rollout_correction.rollout_rs``,
# `rollout_corr_helper.compute_rollout_rejection_mask`)

ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                      "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                      "seq_max_k3")


def parse_rollout_rs(rollout_rs: str, threshold: str | float | None) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` (comma-separated options of `ROLLOUT_RS_OPTIONS`, duplicates dropped, in
    order) and ``rollout_rs_threshold`` (one entry for all options, or one per option, comma
    separated) -> {option: (lower, upper)} as verl parses them: a ``*_k1`` option takes
    ``"lower_upper"`` or a single upper bound with lower = 1/upper; k2/k3 take a single upper
    bound (lower None). Every bound must be > 0. ValueError otherwise, also for a k1 entry
    with two '_' (verl would read ``"0.5_1_5"`` as lower 0.5 and upper ``float("1_5")`` = 15)."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise ValueError(f"rollout_rs must be a non-empty string of options "
                         f"{list(ROLLOUT_RS_OPTIONS)}, got {rollout_rs!r}")
    options: list[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {opt!r}; valid: {list(ROLLOUT_RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError(f"rollout_rs names no option, got {rollout_rs!r}")
    if threshold is None:
        raise ValueError("rollout_rs_threshold must be given with rollout_rs (verl has no default)")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {threshold!r}")
    specs = [str(threshold)] if not isinstance(threshold, str) else [
        p.strip() for p in threshold.split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries for {len(options)} "
                         f"rollout_rs options {options}: give one for all, or one per option")
    out: dict[str, tuple[float | None, float]] = {}
    for opt, spec in zip(options, specs):
        k1, parts = opt.endswith("k1"), spec.split("_")
        if len(parts) > (2 if k1 else 1):
            shape = "'lower_upper' or a single upper bound" if k1 else "a single upper bound"
            raise ValueError(f"rollout_rs_threshold for {opt!r} is {shape}, got {spec!r}")
        try:
            hi = float(parts[-1])
            lo = (float(parts[0]) if len(parts) == 2 else 1.0 / hi) if k1 else None
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"bad rollout_rs_threshold {spec!r} for {opt!r}: {e}") from None
        if not hi > 0 or (lo is not None and not lo > 0):
            raise ValueError(f"rollout_rs_threshold bounds for {opt!r} must be > 0, got {spec!r}")
        out[opt] = (lo, hi)
    return out


def compute_rollout_rejection_mask(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_rs: str,
    threshold: str | float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling on the rollout/trainer gap: which response tokens keep their loss.

    With `x_t = clamp(old_logprob_t - rollout_logprob_t, -20, 20)` (log pi_old/mu) per response
    token, the per-token statistics are `k1 = -x`, `k2 = x^2 / 2`, `k3 = exp(x) - 1 - x`; an
    option `token_kN` judges each token by its kN, `seq_sum_kN` / `seq_mean_kN` / `seq_max_kN`
    each response by the sum / mean / max of its tokens' kN (the verdict applies to all its
    tokens). k2/k3 options keep `stat <= upper`. k1 options keep
    `log(lower) <= stat <= log(upper)`: as verl, the bounds are compared with `-x`, i.e. they
    bound `mu / pi_old` (the inverse ratio), which is the same as bounding `pi_old / mu` only
    for symmetric bounds (lower = 1/upper, the single-number form). Several options (comma
    separated) must all keep a token. Empty responses are never judged.

    Returns (keep [B, L] in old_logprob's dtype, 1 where the token stays in the loss, 0 on
    rejected tokens and on padding; metrics ``rollout_corr/rollout_rs_*`` (python floats):
    per option ``{opt}_mean`` (token mean of the statistic, a response's value on each of its
    tokens at sequence level), ``{opt}_max`` / ``_min`` (over tokens, or over non-empty
    responses at sequence level), ``{opt}_masked_fraction`` (tokens rejected by it) and
    ``{opt}_seq_masked_fraction`` (non-empty responses with a token rejected by it), and over
    all options ``masked_fraction`` and ``seq_masked_fraction`` (the rejected share of tokens,
    and of all responses, empty ones counted as kept, as verl)). A batch without response tokens keeps nothing and has no metrics.
    """
    specs = parse_rollout_rs(rollout_rs, threshold)
    check_2d("old_logprob", check_float("old_logprob", old_logprob))
    check_same_shape("old_logprob", old_logprob,
                     rollout_logprob=check_float("rollout_logprob", rollout_logprob))
    mask = check_mask("response_mask", response_mask, "old_logprob", old_logprob)
    zero = torch.zeros((), dtype=torch.float64, device=old_logprob.device)
    m = mask.to(torch.float64)
    x = torch.where(mask, old_logprob.detach().double() - rollout_logprob.detach().double(), zero)
    x = x.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token_stats = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.exp(x) - 1.0 - x}
    lengths = m.sum(-1)
    rows = lengths > 0
    n = m.sum()
    keep = mask.clone()
    metrics: dict[str, float] = {}
    prefix = "rollout_corr/rollout_rs_"
    for opt, (lo, hi) in specs.items():
        stat = torch.where(mask, token_stats[opt[-2:]], zero)
        if opt.startswith("seq_sum"):
            per_row = stat.sum(-1)
        elif opt.startswith("seq_mean"):
            per_row = stat.sum(-1) / (lengths + 1e-8)
        elif opt.startswith("seq_max"):
            per_row = torch.where(mask, stat, float("-inf")).amax(-1)
            per_row = torch.where(rows, per_row, zero)
        else:
            per_row = None
        value = stat if per_row is None else per_row.unsqueeze(-1).expand_as(stat)
        if lo is None:
            ok = value <= hi
        else:
            ok = (value >= math.log(lo)) & (value <= math.log(hi))
        ok = ok | ~mask
        keep = keep & ok
        if n > 0:
            on = value[mask]
            metrics[f"{prefix}{opt}_mean"] = float(on.mean())
            if per_row is None:
                metrics[f"{prefix}{opt}_max"] = float(on.max())
                metrics[f"{prefix}{opt}_min"] = float(on.min())
            else:
                metrics[f"{prefix}{opt}_max"] = float(per_row[rows].max())
                metrics[f"{prefix}{opt}_min"] = float(per_row[rows].min())
            metrics[f"{prefix}{opt}_masked_fraction"] = float((~ok & mask).double().sum() / n)
            metrics[f"{prefix}{opt}_seq_masked_fraction"] = float(
                (~ok & mask).any(-1)[rows].double().mean())
    if n > 0:
        metrics[f"{prefix}masked_fraction"] = float((mask & ~keep).double().sum() / n)
        # as verl: over all responses, empty ones included (the per-option one skips them)
        metrics[f"{prefix}seq_masked_fraction"] = float((mask & ~keep).any(-1).double().mean())
    return keep.to(old_logprob.dtype), metrics


# --- the engine / trainer logprob gap (``rollout.check_logprobs``) ----------------------

METRIC_MEAN = "rollout/logprob_abs_diff_mean"
METRIC_MAX = "rollout/logprob_abs_diff_max"


def logprob_diff_metrics(
    rollout_logprob: torch.Tensor, recomputed: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """{rollout/logprob_abs_diff_mean, rollout/logprob_abs_diff_max} of |rollout - recomputed|
    over the tokens where ``mask`` is set. All three are [B, L]; with no masked-in token both
    metrics are 0."""
    if rollout_logprob.shape != recomputed.shape or recomputed.shape != mask.shape:
        raise ValueError(
            f"shapes differ: rollout_logprob {tuple(rollout_logprob.shape)}, recomputed "
            f"{tuple(recomputed.shape)}, mask {tuple(mask.shape)}"
        )
    diff = (rollout_logprob.double() - recomputed.double()).abs()[mask.bool()]
    if diff.numel() == 0:
        return {METRIC_MEAN: 0.0, METRIC_MAX: 0.0}
    return {METRIC_MEAN: float(diff.mean()), METRIC_MAX: float(diff.max())}
