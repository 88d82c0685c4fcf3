"""PURE: credit assignment (approx / strict min-form / sum) and the main-branch RLOO pipeline."""

import math

import algos_bruteforce as bf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos import pure_credit_assignment, pure_rloo_advantages

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def sum_form_return(token_rewards):
    """G_t = sum_{t' >= t} x_t', by a double loop."""
    rows = token_rewards.tolist()
    return [[sum(row[u] for u in range(k, len(row))) for k in range(len(row))] for row in rows]


# ---------------------------------------------------------------- credit assignment by hand

R = t([[0.5, 7.0, -0.2, 0.9, 0.0]])  # 7.0 sits on a non-step token and must be ignored
S = t([[1, 0, 1, 1, 0]], torch.long)


def test_approx_min_form_hand():
    out = pure_credit_assignment(R, S, 0.1)
    e = [math.exp(-0.5 / 0.1), math.exp(0.2 / 0.1), math.exp(-0.9 / 0.1)]
    w = [x / sum(e) for x in e]
    torch.testing.assert_close(out, t([[w[0] * 0.5, 0.0, w[1] * -0.2, w[2] * 0.9, 0.0]]))
    assert pure_credit_assignment(R, S, "0.1").equal(out)  # a temperature given as a string


def test_strict_min_form_hand():
    out = pure_credit_assignment(R, S, "min")
    # step minima from the right: m = (-0.2, -0.2, 0.9): 0.5 -> -0.2 - (-0.2) = 0, -0.2 -> -0.2 - 0.9
    torch.testing.assert_close(out, t([[0.0, 0.0, -1.1, 0.9, 0.0]]))
    # sum-form returns are the future step minimum, 0 after the last step end
    assert sum_form_return(out)[0] == pytest.approx([-0.2, -0.2, -0.2, 0.9, 0.0])
    assert pure_credit_assignment(R, S, "strict min-form").equal(out)


def test_sum_form_is_the_identity_on_step_ends():
    out = pure_credit_assignment(R, S, "sum")
    torch.testing.assert_close(out, t([[0.5, 0.0, -0.2, 0.9, 0.0]]))
    assert pure_credit_assignment(R, S, "gamma-decay").equal(out)
    assert not out.data_ptr() == R.data_ptr()


def test_rows_without_steps_and_errors():
    z = pure_credit_assignment(t([[1.0, 2.0]]), t([[0, 0]]), 0.1)
    assert torch.equal(z, torch.zeros(1, 2, dtype=D))
    assert torch.equal(pure_credit_assignment(t([[1.0, 2.0]]), t([[0, 0]]), "min"), torch.zeros(1, 2, dtype=D))
    for bad in (0.0, -1.0, float("nan"), True, "max", None):
        with pytest.raises(ValueError):
            pure_credit_assignment(R, S, bad)
    with pytest.raises(ValueError, match=r"\(1, 4\)"):
        pure_credit_assignment(R, S[:, :4], 0.1)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), width=st.integers(1, 9))
def test_strict_min_form_return_equals_bruteforce_minimum(data, width):
    rewards = data.draw(st.lists(st.floats(-1, 1, allow_nan=False), min_size=width, max_size=width))
    steps = data.draw(st.lists(st.booleans(), min_size=width, max_size=width))
    out = pure_credit_assignment(t([rewards]), t([steps], torch.bool), "min")
    ret = sum_form_return(out)[0]
    for k in range(width):
        future = [rewards[u] for u in range(k, width) if steps[u]]
        assert ret[k] == pytest.approx(min(future) if future else 0.0, abs=1e-12)
    assert all(v == 0.0 for v, s in zip(out[0].tolist(), steps) if not s)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), width=st.integers(1, 8))
def test_approx_min_form_approaches_the_minimum_and_sums_weights_to_one(data, width):
    rewards = data.draw(st.lists(st.floats(-1, 1, allow_nan=False), min_size=width, max_size=width))
    steps = data.draw(st.lists(st.booleans(), min_size=width, max_size=width).filter(any))
    r, s = t([rewards]), t([steps], torch.bool)
    step_vals = [x for x, k in zip(rewards, steps) if k]
    temperature = 1e-4
    out = pure_credit_assignment(r, s, temperature)
    # sum_k w_k (r_k - min) <= K * max_x x exp(-x / T) = K T / e
    assert -1e-12 <= out.sum().item() - min(step_vals) <= len(step_vals) * temperature / math.e + 1e-12
    weights = [o / x for o, x, k in zip(out[0].tolist(), rewards, steps) if k and abs(x) > 1e-3]
    if len(weights) == len(step_vals):
        assert sum(weights) == pytest.approx(1.0, abs=1e-9)
    # a soft minimum: between the min and the mean of the step rewards
    soft = pure_credit_assignment(r, s, 0.5).sum().item()
    assert min(step_vals) - 1e-12 <= soft <= sum(step_vals) / len(step_vals) + 1e-12


# ---------------------------------------------------------------- pipeline by hand


def test_pure_rloo_hand():
    step_rewards = t([[0.0, 0.5, 0.0, 0.0, -0.5, 0.0], [0.2, 0.0, 0.6, 0.0, 0.0, 0.0]])
    steps = t([[0, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]], torch.long)
    mask = t([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], torch.long)
    adv, ret = pure_rloo_advantages(
        step_rewards=step_rewards, step_mask=steps, response_mask=mask, verifiable_rewards=t([1.0, 0.0]),
        group_index=t([3, 3], torch.long), mode="prm_vr", credit_assignment="sum", vr_coef=1.0,
        kl=torch.full((2, 6), 0.1, dtype=D), kl_coef=0.5,
    )
    a = 0.8 / 3  # row 0's baseline: the other's outcome 0.8 over its 3 tokens; row 1's is 0 / 5
    # step token counts (end token excluded): row 0: 1, 2; row 1: 0, 1. VR {1, 0} -> v {0, -1}: +1 / -1
    r0 = [-0.05, 0.5 - a * 1 - 0.05, -0.05, -0.05, -0.5 - a * 2 + 1.0 - 0.05]
    r1 = [0.2 - 0.05, -0.05, 0.6 - 1.0 - 0.05]
    g0 = [sum(r0[k:]) for k in range(5)]
    g1 = [sum(r1[k:]) for k in range(3)]
    g0[1] = g0[4] = 0.0  # step ends (and EOS) are zeroed
    g1[0] = g1[2] = 0.0
    torch.testing.assert_close(ret, t([g0 + [0.0], g1 + [0.0] * 3]))
    # normalisation: 8 valid tokens of which 4 are exactly 0 -> N' = 4; zeros stay in the variance
    vals = g0 + g1
    mu = sum(vals) / 4
    rstd = 1 / math.sqrt(sum((x - mu) ** 2 for x in vals) / 4)
    norm = [0.0 if x == 0.0 else (x - mu) * rstd for x in vals]
    torch.testing.assert_close(adv, t([norm[:5] + [0.0], norm[5:] + [0.0] * 3]))


def test_modes_select_rewards():
    step_rewards = t([[0.3, 0.0, -0.4], [0.0, 0.9, 0.0]])
    steps = t([[1, 0, 1], [0, 1, 0]], torch.long)
    mask = t([[1, 1, 1], [1, 1, 0]], torch.long)
    kw = dict(step_rewards=step_rewards, step_mask=steps, response_mask=mask, group_index=t([0, 0], torch.long),
              normalize=False, mask_separator=False, credit_assignment="sum")
    _, vr_only = pure_rloo_advantages(verifiable_rewards=t([1.0, 0.0]), mode="vr", **kw)
    # VR only: +1 / -1 at the EOS tokens (positions 2 and 1), nothing else
    torch.testing.assert_close(vr_only, t([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    _, prm_only = pure_rloo_advantages(verifiable_rewards=t([1.0, 0.0]), mode="prm", **kw)
    _, same_vr = pure_rloo_advantages(verifiable_rewards=t([1.0, 1.0]), mode="prm_vr", **kw)
    torch.testing.assert_close(prm_only, same_vr)  # equal VR in a group contributes nothing
    # token baseline for row 0: other outcome 0.9 over 2 tokens; step ends at 0 (0 tokens) and 2 (1 token)
    torch.testing.assert_close(prm_only[0], t([0.3 - 0.4 - 0.45, -0.4 - 0.45, -0.4 - 0.45]))


def test_singleton_group_has_no_baselines():
    out, ret = pure_rloo_advantages(
        step_rewards=t([[0.5, -0.25]]), step_mask=t([[1, 1]]), response_mask=t([[1, 1]]),
        verifiable_rewards=t([0.0]), group_index=t([4], torch.long), credit_assignment="sum",
        mask_separator=False, normalize=False,
    )
    torch.testing.assert_close(ret, t([[0.25, -0.25]]))  # raw PRM rewards, VR term 0


# ---------------------------------------------------------------- against brute force


def random_case(seed, batch=6, width=7, n_groups=2):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    steps = (torch.rand(batch, width, generator=gen) < 0.3).long() * mask
    steps[torch.arange(batch), lengths - 1] = 1  # the last response token ends the last step
    step_rewards = (torch.rand(batch, width, generator=gen, dtype=D) * 2 - 1) * steps + 9.0 * (1 - steps)
    vr = torch.randint(0, 2, (batch,), generator=gen).to(D)
    g = torch.randint(0, n_groups, (batch,), generator=gen) * 5 + 2
    kl = torch.randn(batch, width, generator=gen, dtype=D) * 0.1
    return step_rewards, steps, mask, vr, g, kl


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["prm", "vr", "prm_vr"])
@pytest.mark.parametrize("credit", [0.1, "sum"])
@pytest.mark.parametrize("mask_separator, normalize", [(True, True), (False, True), (True, False)])
def test_against_bruteforce(seed, mode, credit, mask_separator, normalize):
    sr, steps, mask, vr, g, kl = random_case(seed)
    adv, ret = pure_rloo_advantages(
        step_rewards=sr, step_mask=steps, response_mask=mask, verifiable_rewards=vr, group_index=g, mode=mode,
        credit_assignment=credit, vr_coef=0.7, kl=kl, kl_coef=0.3, mask_separator=mask_separator, normalize=normalize,
    )
    ea, er = bf.pure_main(bf.rows(sr), bf.rows(steps), bf.rows(mask), vr.tolist(), g.tolist(), mode,
                          None if credit == "sum" else credit, 0.7, bf.rows(kl), 0.3, mask_separator, normalize)
    torch.testing.assert_close(ret, t(er))
    torch.testing.assert_close(adv, t(ea))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n_groups=st.integers(1, 3), size=st.integers(1, 3))
def test_interleaved_groups_and_permutation(seed, n_groups, size):
    batch = n_groups * size
    sr, steps, mask, vr, _, kl = random_case(seed, batch=batch)
    g = torch.arange(n_groups).repeat_interleave(size)
    kw = dict(mode="prm_vr", credit_assignment=0.1, kl_coef=0.2)
    a, r = pure_rloo_advantages(step_rewards=sr, step_mask=steps, response_mask=mask, verifiable_rewards=vr,
                                group_index=g, kl=kl, **kw)
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(seed))
    ap, rp = pure_rloo_advantages(step_rewards=sr[perm], step_mask=steps[perm], response_mask=mask[perm],
                                  verifiable_rewards=vr[perm], group_index=g[perm] * 13 + 1, kl=kl[perm], **kw)
    torch.testing.assert_close(ap, a[perm])
    torch.testing.assert_close(rp, r[perm])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), extra=st.integers(1, 3))
def test_padding_beyond_the_mask_changes_nothing(seed, extra):
    sr, steps, mask, vr, g, kl = random_case(seed)
    kw = dict(verifiable_rewards=vr, group_index=g, kl_coef=0.2)
    a, r = pure_rloo_advantages(step_rewards=sr, step_mask=steps, response_mask=mask, kl=kl, **kw)
    b = sr.shape[0]
    junk = torch.full((b, extra), 123.0, dtype=D)
    zeros = torch.zeros(b, extra, dtype=torch.long)
    a2, r2 = pure_rloo_advantages(
        step_rewards=torch.cat([sr, junk], 1), step_mask=torch.cat([steps, zeros], 1),
        response_mask=torch.cat([mask, zeros], 1), kl=torch.cat([torch.where(mask.bool(), kl, 55.0), junk], 1), **kw,
    )
    torch.testing.assert_close(a2[:, : sr.shape[1]], a)
    torch.testing.assert_close(r2[:, : sr.shape[1]], r)
    assert torch.all(a2[:, sr.shape[1]:] == 0)


def test_pipeline_errors_and_dtype():
    sr, steps, mask, vr, g, _ = random_case(0)
    kw = dict(step_rewards=sr, step_mask=steps, response_mask=mask, group_index=g)
    with pytest.raises(ValueError, match="valid.*prm_vr"):
        pure_rloo_advantages(verifiable_rewards=vr, mode="PRMVR", **kw)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pure_rloo_advantages(verifiable_rewards=vr - 1, **kw)
    bad = steps.clone()
    bad[0, -1] = 1
    bad_mask = mask.clone()
    bad_mask[0, -1] = 0
    with pytest.raises(ValueError, match="outside response_mask"):
        pure_rloo_advantages(verifiable_rewards=vr, step_rewards=sr, step_mask=bad, response_mask=bad_mask,
                             group_index=g)
    before = sr.clone()
    a, r = pure_rloo_advantages(verifiable_rewards=vr, **{**kw, "step_rewards": sr.float()})
    assert a.dtype == torch.float32 and r.dtype == torch.float32
    assert torch.equal(sr, before)
