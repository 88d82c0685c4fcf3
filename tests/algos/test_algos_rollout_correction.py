"""Truncated importance sampling on the rollout/trainer mismatch (compute_rollout_is_weights)
against a float64 brute-force loop over python floats, written from verl's definitions
(rollout_corr_helper.compute_rollout_correction_weights / compute_is_metrics), not from the
vectorised code.

Planted while writing (each made the named tests fail):
- no truncation (`weights = raw`): test_token_weights_and_metrics_match_the_loop (weight 7.39 =
  e^2 where the loop has 2.0), test_sequence_weights_and_metrics_match_the_loop (e^1.9 = 6.69
  vs 2.0 on the first response) and test_truncation_caps_at_the_threshold (7.39 vs 1.5);
- sequence level with the mean instead of the sum of the token log-ratios:
  test_sequence_weights_and_metrics_match_the_loop (first response e^(1.9/7) = 1.31 vs the
  loop's min(e^1.9, 2) = 2.0) and test_sequence_weight_is_the_product_of_ratios (e^0.5 = 1.65
  vs e^1.5 = 4.48);
- padding not masked before the sequence sum: test_padding_never_matters (NaN weights) and the
  sequence test (0.275 vs 0.310 where padding holds finite logprobs);
- ESS of the raw instead of the [1/c, c]-clamped weights: the token test's
  rollout_is_eff_sample_size 0.455 vs the loop's 0.807 (c = 2).
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos import ROLLOUT_IS_LEVELS, compute_rollout_is_weights

D = torch.float64
P = "rollout_corr/rollout_is_"


def brute(old, rollout, mask, level, c, normalize=False):
    """(weights, metrics) by loops over python floats."""
    B, L = len(old), len(old[0])
    raw = [[0.0] * L for _ in range(B)]
    logs = []  # (log-weight, counted tokens) per response with tokens
    for i in range(B):
        toks = [t for t in range(L) if mask[i][t]]
        if level == "token":
            for t in toks:
                d = old[i][t] - rollout[i][t]
                raw[i][t] = math.exp(min(max(d, -20.0), 20.0))
        else:
            s = 0.0
            for t in toks:
                s += old[i][t] - rollout[i][t]
            for t in toks:
                raw[i][t] = math.exp(min(max(s, -20.0), 20.0))
            if toks:
                logs.append(s)
    w = [[min(raw[i][t], c) if mask[i][t] else 0.0 for t in range(L)] for i in range(B)]
    vals = [raw[i][t] for i in range(B) for t in range(L) if mask[i][t]]
    trunc = [w[i][t] for i in range(B) for t in range(L) if mask[i][t]]
    n = len(vals)
    m = {P + "mean": sum(vals) / n, P + "truncated_mean": sum(trunc) / n}
    if level == "token":
        m[P + "max"], m[P + "min"] = max(vals), min(vals)
        m[P + "ratio_fraction_high"] = sum(v > c for v in vals) / n
        m[P + "ratio_fraction_low"] = sum(v < 1 / c for v in vals) / n
    else:
        m[P + "max"] = math.exp(min(max(logs), 20.0))
        m[P + "min"] = math.exp(min(logs))
        m[P + "ratio_fraction_high"] = sum(s > math.log(c) for s in logs) / len(logs)
        m[P + "ratio_fraction_low"] = sum(s < math.log(1 / c) for s in logs) / len(logs)
    b = [min(max(v, 1 / c), c) for v in vals]
    mu = sum(b) / n
    m[P + "std"] = math.sqrt(max(sum(x * x for x in b) / n - mu * mu, 0.0))
    m[P + "eff_sample_size"] = 1.0 / (sum((x / mu) ** 2 for x in b) / n)
    if normalize:
        if level == "token":
            f = sum(trunc) / n
        else:
            per = [max(w[i]) for i in range(B) if any(mask[i])]
            f = sum(per) / len(per)
        w = [[x / f for x in row] for row in w]
        m[P + "batch_norm_factor"] = f
    return w, m


def _inputs(seed=0, B=5, L=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=g, dtype=D) * 3
    rollout = old + torch.randn(B, L, generator=g, dtype=D) * 0.6
    lengths = [7, 4, 1, 6, 3][:B]
    mask = torch.tensor([[t < n for t in range(L)] for n in lengths])
    return old, rollout, mask


def flat(rows):
    return [x for row in (rows.tolist() if isinstance(rows, torch.Tensor) else rows) for x in row]


def _check(weights, metrics, expected_w, expected_m):
    assert flat(weights) == pytest.approx(flat(expected_w), rel=1e-12, abs=1e-15)
    assert set(metrics) == set(expected_m)
    for k, v in expected_m.items():
        assert metrics[k] == pytest.approx(v, rel=1e-10, abs=1e-14), k


def test_token_weights_and_metrics_match_the_loop():
    old, rollout, mask = _inputs()
    old[0, 0], rollout[0, 0] = -0.1, -2.1  # ratio e^2 = 7.39: truncated to 2
    for c in (2.0, 1.3, 5.0):
        w, m = compute_rollout_is_weights(old, rollout, mask, level="token", threshold=c)
        _check(w, m, *brute(old.tolist(), rollout.tolist(), mask.tolist(), "token", c))
        if c == 1.3:  # both tails are present
            assert m[P + "ratio_fraction_high"] > 0 and m[P + "ratio_fraction_low"] > 0


def test_sequence_weights_and_metrics_match_the_loop():
    old, rollout, mask = _inputs(seed=1)
    rollout[0] = old[0] - 1.9 / 7  # first response: sum of log-ratios 1.9, mean 0.27
    for c in (2.0, 1.5, 10.0):
        w, m = compute_rollout_is_weights(old, rollout, mask, level="sequence", threshold=c)
        _check(w, m, *brute(old.tolist(), rollout.tolist(), mask.tolist(), "sequence", c))
        assert w[0, 0] == pytest.approx(min(math.exp(1.9), c), rel=1e-12)


def test_sequence_weight_is_the_product_of_ratios():
    """Three tokens with ratio e^0.5 each: the sequence weight is e^1.5 (not e^0.5, the
    geometric mean), on every token of the response."""
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], dtype=D)
    rollout = old - 0.5
    mask = torch.tensor([[1, 1, 1, 0]])
    w, _ = compute_rollout_is_weights(old, rollout, mask, level="sequence", threshold=100.0)
    assert flat(w) == pytest.approx([math.exp(1.5)] * 3 + [0.0], rel=1e-14)


def test_truncation_caps_at_the_threshold():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=D)
    rollout = torch.tensor([[-2.0, 0.3, -0.5]], dtype=D)
    w, m = compute_rollout_is_weights(old, rollout, torch.ones(1, 3), level="token", threshold=1.5)
    assert flat(w) == pytest.approx([1.5, math.exp(-0.3), 1.5], rel=1e-14)
    assert m[P + "max"] == pytest.approx(math.exp(2.0), rel=1e-14)  # before truncation, as verl
    assert m[P + "ratio_fraction_high"] == pytest.approx(2 / 3)


def test_padding_never_matters():
    """NaN / inf in the padding give the same weights as zeros there; padding weights are 0."""
    old, rollout, mask = _inputs(seed=2)
    dirty_old, dirty_ro = old.clone(), rollout.clone()
    dirty_old[~mask] = float("nan")
    dirty_ro[~mask] = float("inf")
    for level in ROLLOUT_IS_LEVELS:
        clean_w, clean_m = compute_rollout_is_weights(old, rollout, mask, level=level)
        w, m = compute_rollout_is_weights(dirty_old, dirty_ro, mask, level=level)
        assert torch.equal(w, clean_w) and m == clean_m
        assert (w[~mask] == 0).all() and (w[mask] > 0).all()


def test_extreme_log_ratios_stay_finite():
    """Log-ratios of +-1000 (a broken engine) give finite weights: clamp to +-20 before exp."""
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float32)
    rollout = torch.tensor([[-1000.0, 1000.0], [-600.0, -600.0]], dtype=torch.float32)
    for level in ROLLOUT_IS_LEVELS:
        w, m = compute_rollout_is_weights(old, rollout, torch.ones(2, 2), level=level)
        assert torch.isfinite(w).all() and all(math.isfinite(v) for v in m.values())
    w, m = compute_rollout_is_weights(old, rollout, torch.ones(2, 2), level="token")
    assert flat(w) == pytest.approx([2.0, math.exp(-20.0), 2.0, 2.0], rel=1e-6)
    assert m[P + "max"] == pytest.approx(math.exp(20.0), rel=1e-12)


def test_batch_normalize_gives_mean_one():
    old, rollout, mask = _inputs(seed=3)
    for level in ROLLOUT_IS_LEVELS:
        w, m = compute_rollout_is_weights(old, rollout, mask, level=level, batch_normalize=True)
        _check(w, m, *brute(old.tolist(), rollout.tolist(), mask.tolist(), level, 2.0, True))
        if level == "token":
            assert float(w[mask].mean()) == pytest.approx(1.0, rel=1e-12)


def test_dtype_detached_and_inputs_untouched():
    old, rollout, mask = _inputs(seed=4)
    old32 = old.float().requires_grad_()
    before = old32.detach().clone()
    w, _ = compute_rollout_is_weights(old32, rollout.float(), mask.float(), level="token")
    assert w.dtype == torch.float32 and not w.requires_grad
    assert torch.equal(old32.detach(), before)
    ref, _ = compute_rollout_is_weights(old32.detach().double(), rollout.float().double(), mask)
    assert flat(w.double()) == pytest.approx(flat(ref), rel=1e-6)


def test_on_policy_weights_are_one():
    """Engine and trainer agree exactly: every weight is 1, ESS 1, nothing truncated."""
    old, _, mask = _inputs(seed=5)
    for level in ROLLOUT_IS_LEVELS:
        w, m = compute_rollout_is_weights(old, old.clone(), mask, level=level)
        assert torch.equal(w, mask.to(D))
        assert m[P + "eff_sample_size"] == 1.0 and m[P + "std"] == 0.0
        assert m[P + "ratio_fraction_high"] == 0.0 and m[P + "mean"] == 1.0


def test_no_response_token_gives_zeros_and_no_metrics():
    x = torch.zeros(2, 3, dtype=D)
    w, m = compute_rollout_is_weights(x, x - 1, torch.zeros(2, 3), level="sequence")
    assert torch.equal(w, x) and m == {}


@pytest.mark.parametrize("kwargs, words", [
    (dict(level="tok"), ["level", "rollout_is", "'sequence'", "'token'", "'tok'"]),
    (dict(level=None), ["level", "rollout_is", "None"]),
    (dict(threshold=0.0), ["threshold", "rollout_is_threshold", "> 0", "0.0"]),
    (dict(threshold=-2), ["threshold", "> 0", "-2"]),
    (dict(threshold=True), ["threshold", "True"]),
])
def test_bad_settings_name_the_argument(kwargs, words):
    x = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError) as err:
        compute_rollout_is_weights(x, x, torch.ones(1, 2), **kwargs)
    for word in words:
        assert word in str(err.value)


def test_shape_mismatch_names_the_tensors():
    x = torch.zeros(2, 3, dtype=D)
    with pytest.raises(ValueError, match=r"rollout_logprob has shape \(2, 4\).*old_logprob"):
        compute_rollout_is_weights(x, torch.zeros(2, 4, dtype=D), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"response_mask has shape \(2, 2\)"):
        compute_rollout_is_weights(x, x, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"old_logprob must be \[B, L\]"):
        compute_rollout_is_weights(torch.zeros(3, dtype=D), torch.zeros(3, dtype=D),
                                   torch.ones(3))
    with pytest.raises(TypeError, match="rollout_logprob must be a floating-point"):
        compute_rollout_is_weights(x, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))


def test_an_unhashable_level_is_refused_by_name():
    """A level that is not a string (a list from a YAML typo) is a ValueError naming the levels,
    not a TypeError from the lookup."""
    x = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError, match=r"level \(algorithm.rollout_correction.rollout_is\) "
                                         r"must be one of \['sequence', 'token'\], got \['token'\]"):
        compute_rollout_is_weights(x, x, torch.ones(1, 2), level=["token"])


def test_a_threshold_below_one_is_accepted():
    """Any threshold > 0 is valid (the doc's rule): 0.5 caps every weight at 0.5."""
    old, rollout, mask = _inputs(seed=6)
    for level in ROLLOUT_IS_LEVELS:
        w, m = compute_rollout_is_weights(old, rollout, mask, level=level, threshold=0.5)
        _check(w, m, *brute(old.tolist(), rollout.tolist(), mask.tolist(), level, 0.5))


def test_input_errors_name_both_tensors_in_full():
    """The messages name the argument at fault and the one it is compared with, as whole words
    (a renamed or dropped name fails)."""
    x = torch.zeros(2, 3, dtype=D)
    with pytest.raises(TypeError) as err:
        compute_rollout_is_weights(torch.zeros(2, 3, dtype=torch.long), x, torch.ones(2, 3))
    assert str(err.value) == ("old_logprob must be a floating-point tensor (float32 or float64), "
                              "got torch.int64")
    with pytest.raises(ValueError) as err:
        compute_rollout_is_weights(x, torch.zeros(2, 4, dtype=D), torch.ones(2, 3))
    assert str(err.value) == ("shape mismatch: rollout_logprob has shape (2, 4) but old_logprob "
                              "has shape (2, 3); they must match")
    with pytest.raises(ValueError) as err:
        compute_rollout_is_weights(x, x, torch.ones(2, 2))
    assert str(err.value) == ("shape mismatch: response_mask has shape (2, 2) but old_logprob "
                              "has shape (2, 3); they must match")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_single_response_token(level):
    """One response token in the batch: metrics as for any batch (std 0, ESS 1), and with
    batch_normalize its weight divided by itself (1) and the factor reported. Planted bugs:
    metrics or normalisation only from two tokens on (`n > 1`); the std of one token 1."""
    old = torch.tensor([[0.0, -1.0], [0.0, 0.0]], dtype=D)
    rollout = torch.tensor([[0.0, -1.4], [0.0, 0.0]], dtype=D)
    mask = torch.tensor([[0, 1], [0, 0]])
    w, m = compute_rollout_is_weights(old, rollout, mask, level=level)
    _check(w, m, *brute(old.tolist(), rollout.tolist(), mask.tolist(), level, 2.0))
    assert flat(w) == pytest.approx([0.0, math.exp(0.4), 0.0, 0.0], rel=1e-14)
    assert m[P + "std"] == 0.0 and m[P + "eff_sample_size"] == pytest.approx(1.0, rel=1e-14)
    w, m = compute_rollout_is_weights(old, rollout, mask, level=level, batch_normalize=True)
    assert flat(w) == pytest.approx([0.0, 1.0, 0.0, 0.0], rel=1e-14)
    assert m[P + "batch_norm_factor"] == pytest.approx(math.exp(0.4), rel=1e-14)


def test_two_tokens_have_a_std():
    """Two tokens of weights 1 and e^0.5 (below c = 2): std = |e^0.5 - 1| / 2 (population std),
    not 0 (planted: the std only from three tokens on)."""
    old = torch.tensor([[0.0, 0.5]], dtype=D)
    w, m = compute_rollout_is_weights(old, torch.zeros(1, 2, dtype=D), torch.ones(1, 2))
    assert m[P + "std"] == pytest.approx((math.exp(0.5) - 1) / 2, rel=1e-12)


def test_no_response_token_with_batch_normalize():
    """No response token and batch_normalize: zero weights, no metrics at all (no factor: the
    mean of nothing is not taken)."""
    x = torch.zeros(2, 3, dtype=D)
    for level in ROLLOUT_IS_LEVELS:
        w, m = compute_rollout_is_weights(x, x - 1, torch.zeros(2, 3), level=level,
                                          batch_normalize=True)
        assert torch.equal(w, x) and m == {}


def test_sequence_level_skips_empty_responses():
    """Sequence level with an empty response: it has no weight, so the batch-norm factor (the
    mean of the responses' weights), max / min and the truncated and low fractions are over the
    three non-empty responses only (an empty row counted would add a weight 0 and a log-sum 0).
    Log-sums 1.0, 0.3, -0.9 with c = 2: max e^1, min e^-0.9, one of three truncated (e^1 > 2)
    and one low (e^-0.9 = 0.41 < 1/2)."""
    old = torch.tensor([[0.5, 0.5], [0.0, 0.0], [0.3, 0.0], [-0.9, 0.0]], dtype=D)
    rollout = torch.zeros(4, 2, dtype=D)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1]])
    for c in (3.0, 2.0):
        w, m = compute_rollout_is_weights(old, rollout, mask, level="sequence", threshold=c,
                                          batch_normalize=True)
        _check(w, m, *brute(old.tolist(), rollout.tolist(), mask.tolist(), "sequence", c, True))
    ws = [min(math.exp(s), 2.0) for s in (1.0, 0.3, -0.9)]
    assert m[P + "batch_norm_factor"] == pytest.approx(sum(ws) / 3, rel=1e-12)
    assert m[P + "min"] == pytest.approx(math.exp(-0.9), rel=1e-12)
    assert m[P + "max"] == pytest.approx(math.exp(1.0), rel=1e-12)
    assert m[P + "ratio_fraction_low"] == pytest.approx(1 / 3)
    assert m[P + "ratio_fraction_high"] == pytest.approx(1 / 3)


def test_sequence_level_with_one_token_responses():
    """Responses of length L = 1 (a single column): the sequence weight is the token's."""
    old = torch.tensor([[0.2], [-0.3]], dtype=D)
    w, m = compute_rollout_is_weights(old, torch.zeros(2, 1, dtype=D), torch.ones(2, 1),
                                      level="sequence")
    _check(w, m, *brute(old.tolist(), [[0.0], [0.0]], [[1], [1]], "sequence", 2.0))


def test_weights_exactly_at_the_bounds_are_not_counted():
    """threshold = 1 on-policy: every weight is exactly 1 = c = 1/c, neither truncated (w > c)
    nor low (w < 1/c); both fractions 0 at both levels (planted: >= / <=)."""
    old, _, mask = _inputs(seed=7)
    for level in ROLLOUT_IS_LEVELS:
        _, m = compute_rollout_is_weights(old, old.clone(), mask, level=level, threshold=1.0)
        assert m[P + "ratio_fraction_high"] == 0.0 and m[P + "ratio_fraction_low"] == 0.0


def test_sequence_fractions_compare_in_float64():
    """Log-sums 1e-9 above log 2 and 1e-9 below log(1/2): w_raw just above c = 2 and just below
    1/c, one response truncated and one low of two. float32 log(2) is 1.9e-9 above the float64
    one, so comparing in float32 counts neither (planted: the bounds as float32 tensors)."""
    old = torch.tensor([[math.log(2.0) + 1e-9], [math.log(0.5) - 1e-9]], dtype=D)
    _, m = compute_rollout_is_weights(old, torch.zeros(2, 1, dtype=D), torch.ones(2, 1),
                                      level="sequence", threshold=2.0)
    assert m[P + "ratio_fraction_high"] == 0.5 and m[P + "ratio_fraction_low"] == 0.5


def test_batch_normalize_is_skipped_for_a_vanishing_mean():
    """Every log-ratio -25 (clamped to -20): the mean weight e^-20 = 2e-9 is below 1e-8, the
    weights are left as they are and the factor reported is 1 (planted: dividing anyway, by
    2e-9, or reporting another factor)."""
    old = torch.full((2, 3), -25.0, dtype=D)
    for level in ROLLOUT_IS_LEVELS:
        w, m = compute_rollout_is_weights(old, torch.zeros(2, 3, dtype=D), torch.ones(2, 3),
                                          level=level, batch_normalize=True)
        want = math.exp(-20.0)  # -25 per token, -75 per response: both clamp to -20
        assert flat(w) == pytest.approx([want] * 6, rel=1e-12)
        assert m[P + "batch_norm_factor"] == 1.0
