"""Boundaries, defaults and rarely taken branches of megarl.algos, against float64 brute force.

Each test here closes a gap that mutation testing (docs/mutation.md) found: a changed constant, a
flipped comparison or a dropped argument that the rest of tests/algos let through. The planted
bug each one catches is named in its docstring.
"""

from __future__ import annotations

import math

import algos_bruteforce as bf
import pytest
import torch

from megarl import algos
from megarl.algos._checks import check_same_shape

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- value loss


def _value_loss_loop(vpreds, returns, values, mask, c):
    """0.5 * token-mean of max((v - R)^2, (clip(v, V - c, V + c) - R)^2), one token at a time."""
    total, n = 0.0, 0
    for vr, rr, vv, mm in zip(vpreds.tolist(), returns.tolist(), values.tolist(), mask.tolist()):
        for v, r, old, m in zip(vr, rr, vv, mm):
            if m:
                clipped = min(max(v, old - c), old + c)
                total += max((v - r) ** 2, (clipped - r) ** 2)
                n += 1
    return 0.5 * total / n


def test_value_clipping_below_and_verl_default_range():
    """Predictions far below the old values are clipped up to `V - c` (planted: dropping the
    lower bound changes the loss from 2.30 to 1.43 here); the default c is verl's 0.5 and c = 0
    is allowed (planted `c <= 0` rejection: ValueError)."""
    vpreds = t([[-3.0, 0.2, 1.0], [-2.0, 4.0, 0.0]])
    values = t([[1.0, 0.0, 1.0], [0.5, 1.0, 0.0]])
    returns = t([[-2.5, 0.3, 0.0], [0.0, 1.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]], torch.long)
    for c in (0.5, 0.0, 2.0):
        loss, _ = algos.value_loss(vpreds, returns, values, mask, cliprange_value=c)
        assert loss.item() == pytest.approx(_value_loss_loop(vpreds, returns, values, mask, c), rel=1e-12)
    default, _ = algos.value_loss(vpreds, returns, values, mask)
    assert default.item() == pytest.approx(_value_loss_loop(vpreds, returns, values, mask, 0.5), rel=1e-12)


# ---------------------------------------------------------------- agg_loss and policy loss


def test_agg_default_mode_is_token_mean_and_totals_of_one_are_valid():
    """No mode = verl's token-mean; a total of exactly 1 is a valid normaliser (planted `> 1`
    check: ValueError)."""
    loss_mat = torch.randn(3, 4, generator=_gen(0), dtype=D)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], torch.long)
    kept = [v for r, m in zip(loss_mat.tolist(), mask.tolist()) for v, k in zip(r, m) if k]
    assert algos.agg_loss(loss_mat, mask).item() == pytest.approx(sum(kept) / len(kept), rel=1e-12)
    assert algos.agg_loss(loss_mat, mask, batch_num_tokens=1).item() == pytest.approx(sum(kept), rel=1e-12)
    row_sums = [sum(v for v, k in zip(r, m) if k) for r, m in zip(loss_mat.tolist(), mask.tolist())]
    got = algos.agg_loss(loss_mat, mask, "seq-mean-token-sum", global_batch_size=1)
    assert got.item() == pytest.approx(sum(row_sums), rel=1e-12)
    got = algos.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=torch.tensor(1.0))
    assert got.item() == pytest.approx(sum(row_sums), rel=1e-12)


def _vanilla_loop(logprob, old, adv, mask, low, high):
    """PPO clipped surrogate (no dual clip reached: |adv| small ratios), token-mean."""
    total, n = 0.0, 0
    for lr, orow, ar, mm in zip(logprob.tolist(), old.tolist(), adv.tolist(), mask.tolist()):
        for lp, o, a, m in zip(lr, orow, ar, mm):
            if m:
                ratio = math.exp(lp - o)
                clipped = min(max(ratio, 1 - low), 1 + high)
                total += min(max(-a * ratio, -a * clipped), 3.0 * abs(a)) if a < 0 else max(-a * ratio, -a * clipped)
                n += 1
    return total / n


@pytest.mark.parametrize("low,high", [(0.0, 0.2), (0.2, 0.0), (0.0, 0.0)])
def test_zero_clip_ratio_is_a_valid_range(low, high):
    """A zero clip ratio (no movement on that side) is allowed and clips there (planted `<= 0`
    rejection: ValueError)."""
    g = _gen(1)
    old = -torch.rand(3, 5, generator=g, dtype=D)
    logprob = old + 0.3 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.randn(3, 5, generator=g, dtype=D)
    mask = torch.ones(3, 5, dtype=torch.bool)
    loss, _ = algos.policy_loss("vanilla", logprob=logprob, old_logprob=old, advantages=adv,
                                response_mask=mask, clip_ratio_low=low, clip_ratio_high=high)
    assert loss.item() == pytest.approx(_vanilla_loop(logprob, old, adv, mask, low, high), rel=1e-12)


# ---------------------------------------------------------------- PACS


def _pacs_case(seed):
    g = _gen(seed)
    old = -torch.rand(6, 4, generator=g, dtype=D)
    logprob = old + 0.2 * torch.randn(6, 4, generator=g, dtype=D)
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[1, 2:] = 0
    scores = t([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 1, 0, 1, 0, 1])
    return logprob, old, mask, scores, groups


def test_pacs_defaults_and_data_parallel_scale():
    """Defaults are PACS's (beta 1, std normalisation on): the default call equals the brute force
    at beta 1 with std (planted beta 2: rloo loss 0.523 vs 0.562; planted norm off: grpo loss
    0.594 vs 0.561). `dp_size` multiplies the loss as in agg_loss (planted division: 1/4 of
    it) and a global batch of 1 is valid (planted `> 1`: ValueError)."""
    logprob, old, mask, scores, groups = _pacs_case(0)
    kw = dict(logprob=logprob, old_logprob=old, response_mask=mask, scores=scores, group_index=groups)
    for estimator in ("grpo", "rloo"):
        loss, _ = algos.pacs_loss(adv_estimator=estimator, **kw)
        ref, _, _ = bf.pacs(bf.rows(logprob), bf.rows(old), bf.rows(mask), scores.tolist(),
                            groups.tolist(), 1.0, "1", estimator, "question", norm=True)
        assert loss.item() == pytest.approx(ref, rel=1e-10)
        loss2, _ = algos.pacs_loss(adv_estimator=estimator, dp_size=2, global_batch_size=1, **kw)
        assert loss2.item() == pytest.approx(ref * 6 * 2, rel=1e-10)


# ---------------------------------------------------------------- KL controllers and KL in reward


def test_kl_controller_defaults_are_verls():
    """verl's algorithm.kl_ctrl defaults: fixed, kl_coef 0.001, target_kl 0.1, horizon 10000
    (planted 1.001 / 1.1 / 10001: the state differs)."""
    assert algos.build_kl_controller().state_dict() == {"type": "fixed", "value": 0.001}
    assert algos.FixedKLController().state_dict() == {"type": "fixed", "value": 0.001}
    expected = {"type": "adaptive", "value": 0.001, "target": 0.1, "horizon": 10000.0}
    assert algos.AdaptiveKLController().state_dict() == expected
    assert algos.build_kl_controller("adaptive").state_dict() == expected


def test_built_adaptive_controller_follows_the_formula():
    """build_kl_controller passes kl_coef, target_kl and horizon in that order: the coefficient
    after two updates equals the hand formula (planted dropped/shifted argument: differs)."""
    c = algos.build_kl_controller("adaptive", kl_coef=0.3, target_kl=0.05, horizon=200)
    value = 0.3
    for kl, n in ((0.06, 8), (0.01, 16)):
        c.update(kl, n)
        value *= 1.0 + min(max(kl / 0.05 - 1.0, -0.2), 0.2) * n / 200
    assert c.value == pytest.approx(value, rel=1e-14)
    assert (c.target, c.horizon) == (0.05, 200.0)


def test_controller_state_types_are_checked_and_partial_states_load():
    """A state of the other kind is refused naming its type; a state without "type" (or without
    target / horizon) loads and keeps the configured values (planted key or default changes:
    refused or TypeError)."""
    fixed, adaptive = algos.FixedKLController(0.2), algos.AdaptiveKLController(0.1, 0.05, 300)
    with pytest.raises(ValueError, match=r"state of a 'fixed' controller given to AdaptiveKLController"):
        adaptive.load_state_dict(fixed.state_dict())
    with pytest.raises(ValueError, match=r"state of a 'adaptive' controller given to FixedKLController"):
        fixed.load_state_dict(adaptive.state_dict())
    adaptive.load_state_dict({"value": 0.7})
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.7, 0.05, 300.0)
    fixed.load_state_dict({"value": 0.4})
    assert fixed.value == 0.4


def test_kl_in_reward_default_kind_and_empty_batch():
    """The default kind is verl's "kl" (k1 = old - ref; planted "KL": ValueError); an empty batch
    gives current_kl 0.0 (planted: NaN or 1.0)."""
    scores = t([[0.0, 1.0], [0.5, 0.0]])
    old, ref = t([[-1.0, -2.0], [-0.5, -0.1]]), t([[-1.5, -1.0], [-0.5, -0.3]])
    mask = t([[1, 1], [1, 0]], torch.long)
    rewards, current = algos.apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.5)
    torch.testing.assert_close(rewards, t([[-0.25, 1.5], [0.5, 0.0]]), rtol=0, atol=1e-15)
    assert current == pytest.approx(((0.5 - 1.0) / 2 + 0.0) / 2, rel=1e-7)  # masked_mean's + 1e-8
    empty = torch.zeros(0, 3, dtype=D)
    rewards, current = algos.apply_kl_in_reward(empty, empty, empty, empty.bool(), kl_coef=0.5)
    assert rewards.shape == (0, 3) and current == 0.0


# ---------------------------------------------------------------- PURE


def _pure_case(seed, batch=6, width=7):
    g = _gen(seed)
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[1, 5:] = False
    mask[4, 3:] = False
    steps = (torch.rand(batch, width, generator=g) < 0.4) & mask
    last = mask.long().cumsum(-1).argmax(-1)
    steps[torch.arange(batch), last] = True
    sr = torch.where(steps, torch.rand(batch, width, generator=g, dtype=D) * 2 - 1, 0.0)
    vr = t([1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    g_index = torch.tensor([0, 0, 0, 1, 1, 1])
    kl = torch.randn(batch, width, generator=g, dtype=D) * 0.1
    return sr, steps, mask, vr, g_index, kl


def _pure_bf(sr, steps, mask, vr, g_index, kl, mode="prm_vr", temperature=0.1, kl_coef=0.0,
             mask_separator=True, normalize=True):
    ea, er = bf.pure_main(bf.rows(sr), bf.rows(steps), bf.rows(mask), vr.tolist(), g_index.tolist(),
                          mode, temperature, 1.0, bf.rows(kl), kl_coef, mask_separator, normalize)
    return t(ea), t(er)


def test_pure_defaults_are_the_papers_and_kl_coef_one_applies():
    """Default credit assignment is PURE's T = 0.1 (planted 1.1: differs) and kl_coef 0 ignores a
    given kl (planted 1.0: differs); kl_coef = 1 subtracts kl (planted `!= 1` skip: differs);
    a kl_coef without kl changes nothing (planted `or`: AttributeError on None)."""
    sr, steps, mask, vr, g_index, kl = _pure_case(0)
    base = dict(step_rewards=sr, step_mask=steps, response_mask=mask, verifiable_rewards=vr,
                group_index=g_index)
    adv, ret = algos.pure_rloo_advantages(kl=kl, **base)
    ea, er = _pure_bf(sr, steps, mask, vr, g_index, kl)
    torch.testing.assert_close(ret, er)
    torch.testing.assert_close(adv, ea)
    adv, ret = algos.pure_rloo_advantages(kl=kl, kl_coef=1.0, **base)
    ea, er = _pure_bf(sr, steps, mask, vr, g_index, kl, kl_coef=1.0)
    torch.testing.assert_close(ret, er)
    torch.testing.assert_close(adv, ea)
    adv_none, _ = algos.pure_rloo_advantages(kl=None, kl_coef=0.5, **base)
    adv_zero, _ = algos.pure_rloo_advantages(kl=None, **base)
    torch.testing.assert_close(adv_none, adv_zero, rtol=0, atol=0)
    torch.testing.assert_close(algos.pure_credit_assignment(sr, steps),
                               algos.pure_credit_assignment(sr, steps, 0.1), rtol=0, atol=0)
    x = algos.pure_credit_assignment(sr, steps)
    for i in range(sr.shape[0]):
        ends = [k for k in range(sr.shape[1]) if steps[i, k]]
        rs = [sr[i, k].item() for k in ends]
        w = [math.exp(-r / 0.1) for r in rs]
        for k, r, wk in zip(ends, rs, w):
            assert x[i, k].item() == pytest.approx(wk / sum(w) * r, rel=1e-12, abs=1e-15)


def test_pure_normalisation_without_separator_masking_counts_exact_zeros():
    """`mask_separator=False`: exact-zero returns (a group whose answers are all correct has no
    VR term) stay in the count of the replay-buffer normalisation (planted: counting them out
    changes the advantages by up to 36% of their largest value)."""
    sr, steps, mask, _, g_index, kl = _pure_case(1)
    vr = t([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # group 0 all correct: zero VR returns
    adv, ret = algos.pure_rloo_advantages(
        step_rewards=sr, step_mask=steps, response_mask=mask, verifiable_rewards=vr,
        group_index=g_index, mode="vr", mask_separator=False)
    ea, er = _pure_bf(sr, steps, mask, vr, g_index, kl, mode="vr", mask_separator=False)
    assert (ret[:3][mask[:3]] == 0).all()
    torch.testing.assert_close(ret, er)
    torch.testing.assert_close(adv, ea)


# ---------------------------------------------------------------- advantages and checks


def test_gae_defaults_are_verls_gamma_and_lambda_one():
    """verl's algorithm.gamma and lam default to 1.0 (planted 2.0: differs)."""
    g = _gen(3)
    rewards = torch.randn(3, 5, generator=g, dtype=D)
    values = torch.randn(3, 5, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], torch.long)
    adv, ret = algos.compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values)
    ea, er = bf.gae(bf.rows(rewards), bf.rows(values), bf.rows(mask), 1.0, 1.0)
    torch.testing.assert_close(adv, t(ea))
    torch.testing.assert_close(ret, t(er))
    rewards = torch.randn(3, 5, generator=g, dtype=D)
    adv, ret = algos.compute_advantages("reinforce_plus_plus", token_rewards=rewards, response_mask=mask)
    er = bf.rpp_returns(bf.rows(rewards), bf.rows(mask), 1.0)
    torch.testing.assert_close(ret, t(er))


def test_shape_check_skips_a_missing_argument_and_checks_the_next():
    """An optional argument given as None is skipped, not the end of the check (planted `break`:
    the mismatched `c` passes)."""
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shape mismatch: c has shape \(2, 4\) but x has shape"):
        check_same_shape("x", x, b=None, c=torch.zeros(2, 4))


def test_pure_normalisation_of_a_batch_without_a_trained_token_is_zero():
    """Every response is one token (its own step end and EOS): with separator masking no token
    keeps a return, so the normalisation has nothing to count and returns zeros (this branch
    was never run before; planted `torch.zeros_like(None)`: TypeError)."""
    mask = t([[1, 0, 0], [1, 0, 0], [1, 0, 0]], torch.long).bool()
    adv, ret = algos.pure_rloo_advantages(
        step_rewards=t([[0.5, 0.0, 0.0], [-0.2, 0.0, 0.0], [0.1, 0.0, 0.0]]), step_mask=mask,
        response_mask=mask, verifiable_rewards=t([1.0, 0.0, 1.0]), group_index=torch.tensor([0, 0, 0]))
    assert (adv == 0).all() and (ret == 0).all()
