"""Advantage estimators: hand-worked values, brute-force references, properties."""

import math

import algos_bruteforce as bf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos import ADVANTAGE_ESTIMATORS, compute_advantages

D = torch.float64
GROUPED = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk")


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def outcome(scores, lengths, width, pad=0.0):
    """Rows with the score on the last valid token, `pad` garbage beyond the mask."""
    r = torch.full((len(scores), width), pad, dtype=D)
    m = torch.zeros(len(scores), width, dtype=torch.long)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        r[i, :n] = 0.0
        m[i, :n] = 1
        if n:
            r[i, n - 1] = s
    return r, m


def per_row(adv, m):
    """Check each row is constant on its mask and zero outside; return the row values."""
    vals = []
    for row, mm in zip(adv.tolist(), m.tolist()):
        inside = [a for a, k in zip(row, mm) if k]
        assert all(a == 0.0 for a, k in zip(row, mm) if not k)
        assert max(inside) - min(inside) < 1e-12
        vals.append(inside[0])
    return vals


# ---------------------------------------------------------------- hand-worked examples


def test_grpo_hand_interleaved_groups_and_singleton():
    # groups: {0, 2} scores 1, 0; {1, 3} scores 0.5, 2; {4} singleton score 3
    r, m = outcome([1.0, 0.5, 0.0, 2.0, 3.0], [3, 2, 1, 3, 2], 4, pad=9.0)
    g = t([5, 8, 5, 8, 11], torch.long)
    adv, ret = compute_advantages("grpo", token_rewards=r, response_mask=m, group_index=g)
    s0 = math.sqrt(0.5)  # std of {1, 0}
    s1 = 0.75 * math.sqrt(2)  # std of {0.5, 2}
    expected = [0.5 / (s0 + 1e-6), -0.75 / (s1 + 1e-6), -0.5 / (s0 + 1e-6), 0.75 / (s1 + 1e-6), 3 / (1 + 1e-6)]
    assert per_row(adv, m) == pytest.approx(expected, rel=1e-10)
    torch.testing.assert_close(ret, adv)
    dr, _ = compute_advantages("grpo", token_rewards=r, response_mask=m, group_index=g, norm_adv_by_std=False)
    assert per_row(dr, m) == pytest.approx([0.5, -0.75, -0.5, 0.75, 3.0], rel=1e-12)


def test_grpo_unbiased_std_and_eps_outside_sqrt():
    # group of three 1, 2, 4: mean 7/3, unbiased var 7/3 (biased would be 14/9)
    r, m = outcome([1.0, 2.0, 4.0], [1, 1, 1], 1)
    adv, _ = compute_advantages("grpo", token_rewards=r, response_mask=m, group_index=t([0, 0, 0], torch.long))
    sd = math.sqrt(7 / 3)
    assert per_row(adv, m) == pytest.approx([(x - 7 / 3) / (sd + 1e-6) for x in (1, 2, 4)], rel=1e-10)
    # tiny spread: std = 1e-6 / sqrt(2); A = 5e-7 / (7.07e-7 + 1e-6) = 0.2929 (eps in sqrt: ~5e-4)
    r, m = outcome([0.0, 1e-6], [1, 1], 1)
    adv, _ = compute_advantages("grpo", token_rewards=r, response_mask=m, group_index=t([0, 0], torch.long), eps=1e-6)
    assert adv[1, 0].item() == pytest.approx(5e-7 / (1e-6 / math.sqrt(2) + 1e-6), rel=1e-8)


def test_grpo_all_equal_group_gives_zero():
    r, m = outcome([1.0, 1.0, 1.0], [2, 1, 2], 2)
    adv, _ = compute_advantages("grpo", token_rewards=r, response_mask=m, group_index=t([0, 0, 0], torch.long))
    assert torch.all(adv == 0)


def test_rloo_hand():
    r, m = outcome([1.0, 2.0, 4.0, 7.0], [2, 1, 3, 2], 3, pad=-5.0)
    g = t([0, 0, 0, 1], torch.long)
    adv, ret = compute_advantages("rloo", token_rewards=r, response_mask=m, group_index=g)
    # 1 - mean(2, 4) = -2; 2 - mean(1, 4) = -0.5; 4 - mean(1, 2) = 2.5; singleton -> 0
    assert per_row(adv, m) == pytest.approx([-2.0, -0.5, 2.5, 0.0], abs=1e-12)
    torch.testing.assert_close(ret, adv)


def test_opo_hand_length_weighted_baseline():
    r, m = outcome([1.0, 0.0, 1.0, 2.0], [2, 4, 1, 3], 4)
    g = t([3, 3, 3, 9], torch.long)
    adv, _ = compute_advantages("opo", token_rewards=r, response_mask=m, group_index=g)
    b = (2 * 1 + 4 * 0 + 1 * 1) / 7  # length-weighted mean 3/7
    assert per_row(adv, m) == pytest.approx([1 - b, -b, 1 - b, 2.0], rel=1e-12)


def test_grpo_passk_hand():
    # group {1, 3, 2}: only the best (score 3) gets 3 - 2 = 1, / (std 1 + eps) when normalised
    r, m = outcome([1.0, 3.0, 2.0, 2.0, 2.0, 1.0, 5.0], [1] * 7, 2)
    g = t([0, 0, 0, 1, 1, 1, 2], torch.long)
    adv, _ = compute_advantages("grpo_passk", token_rewards=r, response_mask=m, group_index=g)
    assert per_row(adv, m) == pytest.approx([0, 1 / (1 + 1e-6), 0, 0, 0, 0, 0], abs=1e-12)
    adv, _ = compute_advantages("grpo_passk", token_rewards=r, response_mask=m, group_index=g, norm_adv_by_std=False)
    # ties (2, 2, 1) give 0; the singleton gives 0
    assert per_row(adv, m) == pytest.approx([0, 1, 0, 0, 0, 0, 0], abs=1e-12)


def test_reinforce_plus_plus_hand():
    r = t([[1.0, 0.0, 2.0], [0.0, 3.0, 99.0]])
    m = t([[1, 1, 1], [1, 1, 0]], torch.long)
    adv, ret = compute_advantages("reinforce_plus_plus", token_rewards=r, response_mask=m, gamma=0.5)
    g = [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2.0, 0 + 0.5 * 3, 3.0]
    torch.testing.assert_close(ret, t([[g[0], g[1], g[2]], [g[3], g[4], 0.0]]))
    mu = sum(g) / 5
    sd = math.sqrt(sum((x - mu) ** 2 for x in g) / 4 + 1e-8)
    w = [(x - mu) / sd for x in g]
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]))


def test_reinforce_plus_plus_baseline_hand_token_weighted():
    # group {0, 1} scores 1, 0 (lengths 2, 1) -> 0.5, -0.5; singleton score 2 (length 3) -> 2
    r, m = outcome([1.0, 0.0, 2.0], [2, 1, 3], 3)
    adv, _ = compute_advantages(
        "reinforce_plus_plus_baseline", token_rewards=r, response_mask=m, group_index=t([4, 4, 6], torch.long)
    )
    tokens = [0.5, 0.5, -0.5, 2.0, 2.0, 2.0]
    mu = sum(tokens) / 6
    sd = math.sqrt(sum((x - mu) ** 2 for x in tokens) / 5 + 1e-8)
    assert per_row(adv, m) == pytest.approx([(0.5 - mu) / sd, (-0.5 - mu) / sd, (2 - mu) / sd], rel=1e-7)


def test_remax_hand():
    r = t([[0.0, 1.0, 2.0], [1.0, 1.0, 9.0]])
    m = t([[1, 1, 1], [1, 1, 0]], torch.long)
    adv, ret = compute_advantages("remax", token_rewards=r, response_mask=m, baselines=t([0.5, 1.0]))
    torch.testing.assert_close(ret, t([[3.0, 3.0, 2.0], [2.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, t([[2.5, 2.5, 1.5], [1.0, 0.0, 0.0]]))


def test_gae_hand():
    r = t([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    v = t([[0.5, 0.4, 0.3], [1.0, 0.5, 7.0]])
    m = t([[1, 1, 1], [1, 1, 0]], torch.long)
    adv, ret = compute_advantages("gae", token_rewards=r, response_mask=m, values=v, gamma=0.9, lam=0.8)
    # row 0: deltas 0.7, -0.13, -0.14 -> A2 = 0.7, A1 = -0.13 + 0.72 * 0.7, A0 = -0.14 + 0.72 * A1
    a1 = -0.13 + 0.72 * 0.7
    a0 = -0.14 + 0.72 * a1
    # row 1 (last column padded): delta1 = 2 - 0.5 = 1.5, delta0 = 0.9 * 0.5 - 1 = -0.55
    b0 = -0.55 + 0.72 * 1.5
    raw = [a0, a1, 0.7, b0, 1.5]
    torch.testing.assert_close(ret, t([[a0 + 0.5, a1 + 0.4, 1.0], [b0 + 1.0, 2.0, 0.0]]))
    mu = sum(raw) / 5
    sd = math.sqrt(sum((x - mu) ** 2 for x in raw) / 4 + 1e-8)
    w = [(x - mu) / sd for x in raw]
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]))


def test_gae_skips_interior_masked_tokens():
    r = t([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    v = t([[0.5, 9.0, 0.3], [0.2, 0.0, 0.0]])
    m = t([[1, 0, 1], [1, 0, 0]], torch.long)
    adv, ret = compute_advantages("gae", token_rewards=r, response_mask=m, values=v, gamma=0.9, lam=0.8)
    a0 = -0.23 + 0.72 * 0.7  # next valid value is 0.3, next valid advantage 0.7
    torch.testing.assert_close(ret[0], t([a0 + 0.5, 0.0, 1.0]))
    assert ret[1, 0].item() == pytest.approx(1.0)


# ---------------------------------------------------------------- against brute force


def random_batch(seed, batch=7, width=6, groups=3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    m = (torch.arange(width)[None, :] < lengths[:, None]).long()
    r = torch.randn(batch, width, generator=gen, dtype=D) * m + 50.0 * (1 - m)  # garbage padding
    g = torch.randint(0, groups, (batch,), generator=gen) * 17 - 5  # arbitrary, non-contiguous ids
    return r, m, g, gen


@pytest.mark.parametrize("seed", range(5))
def test_against_bruteforce(seed):
    r, m, g, gen = random_batch(seed)
    rr, mm, gg = bf.rows(r), bf.rows(m), g.tolist()

    def run(name, **kw):
        return compute_advantages(name, token_rewards=r, response_mask=m, group_index=g, **kw)[0]

    for norm in (True, False):
        torch.testing.assert_close(run("grpo", norm_adv_by_std=norm), t(bf.grpo(rr, mm, gg, norm)))
        torch.testing.assert_close(run("grpo_passk", norm_adv_by_std=norm), t(bf.grpo_passk(rr, mm, gg, norm)))
    torch.testing.assert_close(run("rloo"), t(bf.rloo(rr, mm, gg)))
    torch.testing.assert_close(run("opo"), t(bf.opo(rr, mm, gg)))
    torch.testing.assert_close(run("reinforce_plus_plus_baseline"), t(bf.rpp_baseline(rr, mm, gg)))
    adv, ret = compute_advantages("reinforce_plus_plus", token_rewards=r, response_mask=m, gamma=0.7)
    torch.testing.assert_close(ret, t(bf.rpp_returns(rr, mm, 0.7)))
    torch.testing.assert_close(adv, t(bf.whiten_tokens(bf.rpp_returns(rr, mm, 0.7), mm)))
    holes = m.clone()
    holes[:, 2] = 0  # the return restarts after a masked (e.g. observation) token, as verl
    adv, ret = compute_advantages("reinforce_plus_plus", token_rewards=r, response_mask=holes, gamma=0.7)
    hh = bf.rows(holes)
    torch.testing.assert_close(ret, t(bf.rpp_returns(rr, hh, 0.7)))
    b = torch.randn(r.shape[0], generator=gen, dtype=D)
    adv, ret = compute_advantages("remax", token_rewards=r, response_mask=m, baselines=b)
    ea, er = bf.remax(rr, mm, b.tolist())
    torch.testing.assert_close(adv, t(ea))
    torch.testing.assert_close(ret, t(er))
    v = torch.randn(r.shape, generator=gen, dtype=D)
    mi = m.clone()
    mi[:, 1] = 0  # interior holes as well
    mi[:, 0] = 1
    adv, ret = compute_advantages("gae", token_rewards=r, response_mask=mi, values=v, gamma=0.95, lam=0.9)
    ea, er = bf.gae(rr, bf.rows(v), bf.rows(mi), 0.95, 0.9)
    torch.testing.assert_close(adv, t(ea))
    torch.testing.assert_close(ret, t(er))


def test_float32_in_float32_out_and_inputs_untouched():
    r, m, g, gen = random_batch(0)
    r32 = r.float()
    before = r32.clone()
    for name in ADVANTAGE_ESTIMATORS:
        kw = {"values": torch.randn(r.shape, generator=gen), "baselines": torch.zeros(r.shape[0])}
        adv, ret = compute_advantages(name, token_rewards=r32, response_mask=m, group_index=g, **kw)
        assert adv.dtype == torch.float32 and ret.dtype == torch.float32
        assert adv.shape == r.shape and not adv.requires_grad
    assert torch.equal(r32, before)


# ---------------------------------------------------------------- errors


def test_errors_are_clear():
    r, m = outcome([1.0, 0.0], [1, 1], 2)
    with pytest.raises(ValueError, match="valid names.*grpo"):
        compute_advantages("grpoo", token_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", token_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="baselines"):
        compute_advantages("remax", token_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        compute_advantages("rloo", token_rewards=r, response_mask=torch.ones(2, 3), group_index=t([0, 0], torch.long))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        compute_advantages("rloo", token_rewards=r, response_mask=m, group_index=t([0, 0, 1], torch.long))
    with pytest.raises(ValueError, match="single element"):  # whitening one token, as verl
        compute_advantages("reinforce_plus_plus", token_rewards=r, response_mask=t([[1, 0], [0, 0]], torch.long))
    with pytest.raises(TypeError, match="int64"):
        compute_advantages("rloo", token_rewards=r, response_mask=m, group_index=t([0.0, 0.0]))


# ---------------------------------------------------------------- properties

batches = st.integers(min_value=0, max_value=10_000)


@settings(max_examples=25, deadline=None)
@given(seed=batches, name=st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)))
def test_permuting_the_batch_permutes_the_output(seed, name):
    r, m, g, gen = random_batch(seed, batch=6, width=5)
    v = torch.randn(r.shape, generator=gen, dtype=D)
    b = torch.randn(r.shape[0], generator=gen, dtype=D)
    perm = torch.randperm(r.shape[0], generator=gen)
    kw = dict(gamma=0.9, lam=0.95)
    a, ret = compute_advantages(name, token_rewards=r, response_mask=m, group_index=g, values=v, baselines=b, **kw)
    ap, retp = compute_advantages(
        name, token_rewards=r[perm], response_mask=m[perm], group_index=g[perm], values=v[perm], baselines=b[perm], **kw
    )
    torch.testing.assert_close(ap, a[perm])
    torch.testing.assert_close(retp, ret[perm])


@settings(max_examples=25, deadline=None)
@given(seed=batches, name=st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)), extra=st.integers(1, 3))
def test_padding_beyond_the_mask_changes_nothing(seed, name, extra):
    r, m, g, gen = random_batch(seed, batch=5, width=4)
    v = torch.randn(r.shape, generator=gen, dtype=D)
    b = torch.randn(r.shape[0], generator=gen, dtype=D)
    a, ret = compute_advantages(name, token_rewards=r, response_mask=m, group_index=g, values=v, baselines=b)
    # wider padding full of garbage, and garbage in the old padding too
    junk = torch.randn(r.shape[0], extra, generator=gen, dtype=D) * 100
    r2 = torch.cat([torch.where(m.bool(), r, -77.0), junk], dim=1)
    v2 = torch.cat([torch.where(m.bool(), v, 1e6), junk], dim=1)
    m2 = torch.cat([m, torch.zeros(r.shape[0], extra, dtype=m.dtype)], dim=1)
    a2, ret2 = compute_advantages(name, token_rewards=r2, response_mask=m2, group_index=g, values=v2, baselines=b)
    torch.testing.assert_close(a2[:, : r.shape[1]], a)
    torch.testing.assert_close(ret2[:, : r.shape[1]], ret)
    assert torch.all(a2[:, r.shape[1]:] == 0) and torch.all(ret2[:, r.shape[1]:] == 0)


@settings(max_examples=30, deadline=None)
@given(
    scores=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12),
    data=st.data(),
    norm=st.booleans(),
)
def test_grpo_group_advantages_sum_to_zero(scores, data, norm):
    g = data.draw(st.lists(st.integers(0, 3), min_size=len(scores), max_size=len(scores)))
    r, m = outcome(scores, [1] * len(scores), 1)
    adv, _ = compute_advantages("grpo", token_rewards=r, response_mask=m, group_index=t(g, torch.long), norm_adv_by_std=norm)
    for members in bf.groups_of(g).values():
        if len(members) > 1:
            assert abs(sum(adv[i, 0].item() for i in members)) < 1e-6 * max(1.0, len(members))


@settings(max_examples=25, deadline=None)
@given(seed=batches, name=st.sampled_from(GROUPED), n_groups=st.integers(1, 4), size=st.integers(1, 4))
def test_interleaved_group_index_equals_contiguous_after_permutation(seed, name, n_groups, size):
    gen = torch.Generator().manual_seed(seed)
    batch = n_groups * size
    contiguous = torch.arange(n_groups).repeat_interleave(size)  # 0 0 0 1 1 1 ...
    lengths = torch.randint(2, 5, (batch,), generator=gen)  # whitening needs >= 2 valid tokens
    m = (torch.arange(4)[None, :] < lengths[:, None]).long()
    r = torch.randn(batch, 4, generator=gen, dtype=D) * m
    a, _ = compute_advantages(name, token_rewards=r, response_mask=m, group_index=contiguous)
    perm = torch.randperm(batch, generator=gen)
    ai, _ = compute_advantages(name, token_rewards=r[perm], response_mask=m[perm], group_index=contiguous[perm] * 31 + 7)
    torch.testing.assert_close(ai, a[perm])
