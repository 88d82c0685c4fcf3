"""PACS loss: hand-worked value and gradient, brute force, ln 2 on-policy, gradcheck, groups."""

import math

import algos_bruteforce as bf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos import pacs_loss

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def sp(x):
    return math.log1p(math.exp(x))


def hand_case():
    old = t([[-1.0, -2.0], [-0.5, float("nan")], [-1.0, -1.0], [-0.3, -0.2], [-2.0, -1.0]])
    d = t([[0.1, 0.2], [-0.1, 0.0], [0.3, -0.4], [0.05, 0.05], [0.0, -0.1]])
    lp = torch.where(old.isnan(), 5.0, old + d).requires_grad_(True)  # garbage in the padding
    m = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]], torch.long)
    scores = t([1.0, 1.0, 0.0, 1.0, 0.0])
    g = t([0, 1, 0, 1, 0], torch.long)  # interleaved groups {0, 2, 4} and {1, 3}
    return lp, old, m, scores, g


def test_pacs_hand_rloo_question_weights():
    lp, old, m, scores, g = hand_case()
    loss, met = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g, beta=2.0)
    # r = beta * sum(logp - old): 0.6, -0.2, -0.2, 0.2, -0.2
    # rloo psi: group {0,2,4}: 0.6 - (-0.2) = 0.8, -0.2 - 0.2 = -0.4, -0.4; group {1,3}: -0.4, 0.4
    # weights in group {0,2,4} (labels 1, 0, 0): 3 / (2 * 1) = 1.5 and 3 / (2 * 2) = 0.75; group {1,3}: 1
    expected = (1.5 * (sp(0.8) - 0.8) + (sp(-0.4) + 0.4) + 0.75 * sp(-0.4) + (sp(0.4) - 0.4) + 0.75 * sp(-0.4)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert met["pacs_loss"] == pytest.approx(expected)
    assert met["reward_mean"] == pytest.approx((0.6 - 0.2 - 0.2 + 0.2 - 0.2) / 5)
    assert met["adv_mean"] == pytest.approx((0.8 - 0.4 - 0.4 - 0.4 + 0.4) / 5)
    loss.backward()

    def sig(x):
        return 1 / (1 + math.exp(-x))

    # dL/dpsi = w (sigmoid(psi) - y) / B; rloo: dpsi_k/dr_i = 1 (k = i), -1/(n-1) otherwise; dr/dlogp = beta
    dpsi = [1.5 * (sig(0.8) - 1), (sig(-0.4) - 1), 0.75 * sig(-0.4), (sig(0.4) - 1), 0.75 * sig(-0.4)]
    dpsi = [x / 5 for x in dpsi]
    dr = [dpsi[0] - (dpsi[2] + dpsi[4]) / 2, dpsi[1] - dpsi[3], dpsi[2] - (dpsi[0] + dpsi[4]) / 2,
          dpsi[3] - dpsi[1], dpsi[4] - (dpsi[0] + dpsi[2]) / 2]
    expected_grad = t([[2 * x, 2 * x * k] for x, k in zip(dr, [1, 0, 1, 1, 1])])
    torch.testing.assert_close(lp.grad, expected_grad)


def test_bce_mean_divides_by_batch_not_weight_sum():
    lp, old, m, scores, g = hand_case()
    loss, _ = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g, beta=2.0,
                        weight_mode="only_positive")
    # only the three label-1 rows count, but the mean is still over B = 5
    assert loss.item() == pytest.approx(((sp(0.8) - 0.8) + (sp(-0.4) + 0.4) + (sp(0.4) - 0.4)) / 5, rel=1e-12)
    loss, _ = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g, beta=2.0,
                        weight_mode="only_negative")
    assert loss.item() == pytest.approx(2 * sp(-0.4) / 5, rel=1e-12)


def test_reward_method_2_and_naive():
    lp, old, m, scores, g = hand_case()
    loss, met = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g, beta=0.5,
                          reward_method="2", adv_estimator="naive", weight_mode=None)
    logp = lp.detach().tolist()
    r = [0.5 * (logp[0][0] + logp[0][1]) / 2, 0.5 * logp[1][0], 0.5 * (logp[2][0] + logp[2][1]) / 2,
         0.5 * (logp[3][0] + logp[3][1]) / 2, 0.5 * (logp[4][0] + logp[4][1]) / 2]
    expected = sum(sp(x) - y * x for x, y in zip(r, scores.tolist())) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert met["reward_mean"] == pytest.approx(sum(r) / 5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("method", ["1", "2"])
@pytest.mark.parametrize("estimator, norm", [("rloo", True), ("grpo", True), ("grpo", False), ("naive", True)])
@pytest.mark.parametrize("weight_mode", ["question", None, "only_positive"])
def test_against_bruteforce(seed, method, estimator, norm, weight_mode):
    gen = torch.Generator().manual_seed(seed)
    batch, width = 7, 4
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    m = (torch.arange(width)[None, :] < lengths[:, None]).long()
    old = -torch.rand(batch, width, generator=gen, dtype=D) * 2
    lp = (old + 0.3 * torch.randn(batch, width, generator=gen, dtype=D)).requires_grad_(True)
    scores = torch.randint(0, 2, (batch,), generator=gen).to(D)
    g = torch.tensor([2, 0, 2, 1, 0, 2, 9])  # groups of 3, 2, 1 and a singleton, interleaved
    loss, met = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g, beta=1.5,
                          reward_method=method, adv_estimator=estimator, weight_mode=weight_mode,
                          norm_adv_by_std=norm)
    loss.backward()
    e_loss, e_psi, e_grad = bf.pacs(bf.rows(lp.detach()), bf.rows(old), bf.rows(m), scores.tolist(), g.tolist(),
                                    1.5, method, estimator, weight_mode, norm)
    assert loss.item() == pytest.approx(e_loss, rel=1e-10)
    assert met["adv_mean"] == pytest.approx(sum(e_psi) / batch, abs=1e-12)
    torch.testing.assert_close(lp.grad, t(e_grad))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), estimator=st.sampled_from(["rloo", "grpo", "naive"]),
       weight_mode=st.sampled_from(["question", None]), beta=st.floats(0.1, 5.0))
def test_on_policy_loss_is_ln2_with_method_1(seed, estimator, weight_mode, beta):
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    lp = -torch.rand(batch, 5, generator=gen, dtype=D)
    m = (torch.rand(batch, 5, generator=gen) > 0.3).long()
    scores = torch.randint(0, 2, (batch,), generator=gen).to(D)
    g = torch.randint(0, 3, (batch,), generator=gen)
    x = lp.clone().requires_grad_(True)
    loss, _ = pacs_loss(logprob=x, old_logprob=lp, response_mask=m, scores=scores, group_index=g, beta=beta,
                        adv_estimator=estimator, weight_mode=weight_mode)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-12)
    loss.backward()
    assert torch.isfinite(x.grad).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n_groups=st.integers(1, 3), size=st.integers(1, 4))
def test_interleaved_group_index_equals_contiguous_after_permutation(seed, n_groups, size):
    gen = torch.Generator().manual_seed(seed)
    batch = n_groups * size
    old = -torch.rand(batch, 3, generator=gen, dtype=D)
    lp = old + 0.2 * torch.randn(batch, 3, generator=gen, dtype=D)
    m = torch.ones(batch, 3, dtype=torch.long)
    scores = torch.randint(0, 2, (batch,), generator=gen).to(D)
    g = torch.arange(n_groups).repeat_interleave(size)
    perm = torch.randperm(batch, generator=gen)
    a, _ = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g)
    b, _ = pacs_loss(logprob=lp[perm], old_logprob=old[perm], response_mask=m[perm], scores=scores[perm],
                     group_index=g[perm] * 7 + 3)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


@pytest.mark.parametrize("method", ["1", "2"])
@pytest.mark.parametrize("estimator", ["rloo", "grpo", "naive"])
def test_gradcheck_pacs(method, estimator):
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(6, 3, generator=gen, dtype=D)
    lp = (old + 0.3 * torch.randn(6, 3, generator=gen, dtype=D)).requires_grad_(True)
    m = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]], torch.long)
    scores = t([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    g = t([0, 0, 1, 1, 1, 0], torch.long)

    def f(x):
        return pacs_loss(logprob=x, old_logprob=old, response_mask=m, scores=scores, group_index=g,
                         reward_method=method, adv_estimator=estimator)[0]

    assert torch.autograd.gradcheck(f, (lp,))


def test_micro_batches_of_whole_groups_accumulate_to_the_full_loss():
    lp, old, m, scores, _ = hand_case()
    g = t([0, 0, 1, 1, 1], torch.long)
    full, _ = pacs_loss(logprob=lp, old_logprob=old, response_mask=m, scores=scores, group_index=g)
    first, _ = pacs_loss(logprob=lp[:2], old_logprob=old[:2], response_mask=m[:2], scores=scores[:2],
                         group_index=g[:2], global_batch_size=5)
    second, _ = pacs_loss(logprob=lp[2:], old_logprob=old[2:], response_mask=m[2:], scores=scores[2:],
                          group_index=g[2:], global_batch_size=5)
    assert (first + second).item() == pytest.approx(full.item(), rel=1e-12)


def test_errors():
    lp, old, m, scores, g = hand_case()
    kw = dict(logprob=lp, old_logprob=old, response_mask=m, group_index=g)
    with pytest.raises(ValueError, match="reward_method"):
        pacs_loss(scores=scores, reward_method="3", **kw)
    with pytest.raises(ValueError, match="adv_estimator"):
        pacs_loss(scores=scores, adv_estimator="gae", **kw)
    with pytest.raises(ValueError, match="weight_mode"):
        pacs_loss(scores=scores, weight_mode="balanced", **kw)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pacs_loss(scores=scores * 2, **kw)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        pacs_loss(scores=scores[:4], **kw)
