"""Rollout rejection sampling at its edges (`megarl.algos.compute_rollout_rejection_mask`,
`parse_rollout_rs`): statistics exactly on a bound, the +-20 clamp on both sides, a batch of
one token, the keep mask's dtype, and every refusal naming what is wrong. The float64 loop of
the general case is test_algos_verl_round2.py's `brute_rs`."""

from __future__ import annotations

import math

import pytest
import torch

from megarl import algos

D = torch.float64
RS = "rollout_corr/rollout_rs_"


def one_row(x: list[float], dtype=D):
    """(old, rollout, mask) of one response whose tokens have x = old - rollout exactly."""
    rollout = torch.zeros(1, len(x), dtype=dtype)
    old = torch.tensor([x], dtype=dtype)
    return old, rollout, torch.ones(1, len(x), dtype=torch.bool)


@pytest.mark.parametrize("rs,threshold,x", [
    # k1 = -x on the lower bound log(lo) and on the upper bound log(hi): kept (closed interval)
    ("token_k1", "0.5_2.0", -math.log(0.5)),
    ("token_k1", "0.5_2.0", -math.log(2.0)),
    # k2 = x^2 / 2 = 0.125 and k3 = exp(x) - 1 - x on the upper bound: kept
    ("token_k2", 0.125, 0.5),
    ("token_k3", math.exp(0.5) - 1.0 - 0.5, 0.5),
])
def test_a_statistic_on_its_bound_is_kept(rs, threshold, x):
    old, rollout, mask = one_row([x, 0.0])
    keep, met = algos.compute_rollout_rejection_mask(old, rollout, mask, rollout_rs=rs,
                                                     threshold=threshold)
    assert keep.tolist() == [[1.0, 1.0]]
    assert met[RS + "masked_fraction"] == 0.0


def test_the_log_ratio_is_clamped_on_both_sides():
    """x = +30 and -30 count as +-20: k2 = 200 on both, k1 = -20 and +20."""
    old, rollout, mask = one_row([30.0, -30.0])
    _, met = algos.compute_rollout_rejection_mask(old, rollout, mask, rollout_rs="token_k2",
                                                  threshold=1e9)
    assert met[RS + "token_k2_max"] == met[RS + "token_k2_min"] == 200.0
    _, met = algos.compute_rollout_rejection_mask(old, rollout, mask, rollout_rs="token_k1",
                                                  threshold="1e-30_1e30")
    assert (met[RS + "token_k1_min"], met[RS + "token_k1_max"]) == (-20.0, 20.0)


@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_one_response_token_is_judged_and_keep_has_the_logprobs_dtype(dtype):
    old, rollout, mask = one_row([1.0], dtype)
    mask = torch.tensor([[True, False]])
    old, rollout = torch.cat([old, old], 1), torch.cat([rollout, rollout], 1)
    keep, met = algos.compute_rollout_rejection_mask(old, rollout, mask, rollout_rs="token_k2",
                                                     threshold=0.1)
    assert keep.dtype == dtype and keep.tolist() == [[0.0, 0.0]]
    assert met[RS + "token_k2_mean"] == 0.5
    assert met[RS + "masked_fraction"] == met[RS + "seq_masked_fraction"] == 1.0


def test_wrong_tensors_are_refused_naming_the_argument():
    old, rollout, mask = one_row([0.1, 0.2])

    def call(o=old, r=rollout, m=mask):
        return algos.compute_rollout_rejection_mask(o, r, m, rollout_rs="token_k2", threshold=1)

    with pytest.raises(TypeError, match=r"\bold_logprob must be a floating-point"):
        call(o=old.long())
    with pytest.raises(ValueError, match=r"\bold_logprob must be \[B, L\]"):
        call(o=old[0])
    with pytest.raises(TypeError, match=r"\brollout_logprob must be a floating-point"):
        call(r=rollout.long())
    with pytest.raises(ValueError, match=r"\brollout_logprob has shape \(1, 3\) but old_logprob "
                                         r"has shape \(1, 2\)"):
        call(r=torch.zeros(1, 3, dtype=D))
    with pytest.raises(ValueError, match=r"\bresponse_mask has shape \(2, 2\) but old_logprob "
                                         r"has shape \(1, 2\)"):
        call(m=torch.ones(2, 2, dtype=torch.bool))


def test_parsing_drops_empty_and_repeated_options():
    assert algos.parse_rollout_rs("token_k1,,token_k2, token_k1", "2.0,0.5") == {
        "token_k1": (0.5, 2.0), "token_k2": (None, 0.5)}


@pytest.mark.parametrize("rs,threshold,message", [
    (None, 2.0, r"rollout_rs must be a non-empty string of options \['token_k1', .*got None"),
    ("token", 2.0, r"unknown rollout_rs option 'token'; valid: \['token_k1'"),
    (" , ", 2.0, r"rollout_rs names no option, got ' , '"),
    ("token_k2", None, r"^rollout_rs_threshold must be given with rollout_rs \(verl has no "
                       r"default\)$"),
    ("token_k2", True, r"rollout_rs_threshold must be a number or a string, got True"),
    ("token_k1,token_k2", "1,2,3", r"rollout_rs_threshold has 3 entries for 2 rollout_rs "
                                   r"options \['token_k1', 'token_k2'\]: give one for all"),
    ("token_k2", "0.1_0.2", r"^rollout_rs_threshold for 'token_k2' is a single upper bound, got "
                            r"'0.1_0.2'$"),
    ("token_k1", "0.5_1_5", r"^rollout_rs_threshold for 'token_k1' is 'lower_upper' or a single "
                            r"upper bound, got '0.5_1_5'$"),
    ("token_k1", "a_2", r"bad rollout_rs_threshold 'a_2' for 'token_k1': could not convert"),
    ("token_k2", 0, r"rollout_rs_threshold bounds for 'token_k2' must be > 0, got '0'"),
    ("token_k1", "0_2", r"rollout_rs_threshold bounds for 'token_k1' must be > 0, got '0_2'"),
    ("token_k1", "-1_2", r"bounds for 'token_k1' must be > 0, got '-1_2'"),
])
def test_bad_options_and_thresholds_are_refused_saying_why(rs, threshold, message):
    with pytest.raises(ValueError, match=message):
        algos.parse_rollout_rs(rs, threshold)
