"""KL estimators (+ straight-through variants), KL in reward, KL controllers, entropy, value loss."""

import math

import pytest
import torch

from megarl.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    entropy_from_logits,
    kl_penalty,
    value_loss,
)

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------- KL estimators by hand

LP = t([[-1.0, -0.5, -3.0]])
REF = t([[-1.5, -0.5, -1.0]])
DIFF = [0.5, 0.0, -2.0]  # logprob - ref


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), DIFF),
        (("abs",), [0.5, 0.0, 2.0]),
        (("k2", "mse"), [0.125, 0.0, 2.0]),
        (("k3", "low_var_kl"), [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(2.0) - 2 - 1]),
    ],
)
def test_estimators_by_hand(kinds, expected):
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LP, REF, kind), t([expected]))


def test_k3_clamps_exponent_and_value():
    # d = -3: exp(3) - 3 - 1 = 16.09 -> clamped to 10; d = -30: exponent clamped to 20 first, value to 10
    # d = 30: exponent clamp -20: exp(-20) + 20 - 1 = 19 -> 10
    out = kl_penalty(t([[0.0, 0.0, 30.0, 1.0]]), t([[3.0, 30.0, 0.0, 0.0]]), "k3")
    torch.testing.assert_close(out, t([[10.0, 10.0, 10.0, math.exp(-1.0) + 1 - 1]]))
    # the exponent clamp keeps the gradient finite where exp(30) would overflow to inf * 0
    x = t([[-1000.0]]).requires_grad_(True)
    kl_penalty(x, t([[0.0]]), "k3").sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("base", sorted(KL_ESTIMATORS))
def test_straight_through_forward_is_estimator_gradient_is_k2(base):
    lp = LP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    out = kl_penalty(lp, ref, base + "+")
    torch.testing.assert_close(out, kl_penalty(LP, REF, base))
    out.sum().backward()
    # gradient of d^2 / 2 is d for logprob and -d for ref_logprob
    torch.testing.assert_close(lp.grad, t([DIFF]))
    torch.testing.assert_close(ref.grad, -t([DIFF]))


@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS) + ["k2+", "mse+"])
def test_gradcheck_kl(kind):
    gen = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 4, generator=gen, dtype=D) * 0.7 + 0.05).requires_grad_(True)  # away from |d| kink
    ref = torch.randn(3, 4, generator=gen, dtype=D).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty(a, b, kind), (lp, ref))


def test_kl_errors():
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(LP, REF, "full")
    with pytest.raises(ValueError, match="valid.*low_var_kl"):
        kl_penalty(LP, REF, "k4")
    with pytest.raises(ValueError, match=r"ref_logprob has shape \(1, 2\) but logprob has shape \(1, 3\)"):
        kl_penalty(LP, REF[:, :2], "k1")


def test_kl_in_reward_and_current_kl():
    scores = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, 5.0]])
    ref = t([[-1.5, -0.5, -1.0], [-1.0, -2.5, 0.0]])
    m = t([[1, 1, 1], [1, 1, 0]], torch.long)
    rewards, current = apply_kl_in_reward(scores, old, ref, m, kl_coef=0.1, kind="kl")
    torch.testing.assert_close(rewards, t([[-0.05, 0.05, 1.0], [0.1, 1.95, 0.0]]))
    # per-sequence token means: (0.5 - 0.5 + 0) / 3 = 0 and (-1 + 0.5) / 2 = -0.25; mean over sequences
    assert current == pytest.approx(-0.125, rel=1e-7)


# ---------------------------------------------------------------- controllers


def test_fixed_controller():
    c = FixedKLController(0.01)
    c.update(5.0, 100)
    assert c.value == 0.01
    c2 = build_kl_controller("fixed", kl_coef=0.5)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.01


def test_adaptive_controller_formula_and_state():
    c = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    c.update(0.15, 100)  # error 0.5 clipped to 0.2: value *= 1 + 0.2 * 100 / 1000
    assert c.value == pytest.approx(0.2 * 1.02)
    c.update(0.09, 50)  # error -0.1: value *= 1 - 0.1 * 50 / 1000
    assert c.value == pytest.approx(0.2 * 1.02 * 0.995)
    c.update(0.0, 10)  # error -1 clipped to -0.2
    assert c.value == pytest.approx(0.2 * 1.02 * 0.995 * (1 - 0.2 * 10 / 1000))
    restored = build_kl_controller("adaptive", kl_coef=9.0, target_kl=1.0, horizon=1)
    restored.load_state_dict(c.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (c.value, 0.1, 1000)
    restored.update(0.2, 1)
    c.update(0.2, 1)
    assert restored.value == c.value
    with pytest.raises(ValueError, match="adaptive.*FixedKLController"):
        FixedKLController().load_state_dict(c.state_dict())
    with pytest.raises(ValueError, match="valid"):
        build_kl_controller("pid")


# ---------------------------------------------------------------- entropy


def test_entropy_matches_bruteforce_and_masked_vocab():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 5, generator=gen, dtype=D)
    z[0, 0, 1] = float("-inf")
    h = entropy_from_logits(z)
    for idx in [(0, 0), (1, 2)]:
        row = [v for v in z[idx].tolist() if v != float("-inf")]
        den = sum(math.exp(v) for v in row)
        expected = -sum(math.exp(v) / den * math.log(math.exp(v) / den) for v in row)
        assert h[idx].item() == pytest.approx(expected, rel=1e-10)
    assert h.shape == (2, 3) and h.dtype == D
    assert entropy_from_logits(torch.zeros(4, 8)).allclose(torch.full((4,), math.log(8)))
    x = z.clone().requires_grad_(True)
    entropy_from_logits(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_gradcheck_entropy():
    z = torch.randn(2, 6, dtype=D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    assert torch.autograd.gradcheck(entropy_from_logits, (z,))


# ---------------------------------------------------------------- value loss


def test_value_loss_hand():
    vpreds = t([[1.0, 0.0, 2.0], [0.5, 3.0, 0.0]]).requires_grad_(True)
    values = t([[0.0, 0.0, 1.8], [0.5, 0.0, 0.0]])
    returns = t([[2.0, 1.0, 2.0], [0.0, -4.0, 7.0]])
    m = t([[1, 1, 1], [1, 0, 0]], torch.long)
    loss, met = value_loss(vpreds, returns, values, m, cliprange_value=0.5)
    # token 0: vpred 1 vs clip 0.5: max((1-2)^2, (0.5-2)^2) = 2.25 (clip is worse -> counted)
    # token 1: vpred 0 = clip 0: 1.0; token 2: vpred 2, clip 2: 0; token 3: vpred 0.5: 0.25
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.0 + 0.25) / 4)
    assert met["vf_loss"] == pytest.approx(loss.item())
    assert met["vf_clipfrac"] == pytest.approx(1 / 4)
    loss.backward()
    # token 0: the clipped branch is a constant in vpreds -> 0; token 1: 0.5 * 2 (0 - 1) / 4
    torch.testing.assert_close(vpreds.grad, t([[0.0, -0.25, 0.0], [0.125, 0.0, 0.0]]))


def test_value_loss_agg_modes_and_norm():
    vpreds = t([[1.0, 2.0], [3.0, 0.0]])
    zeros = torch.zeros(2, 2, dtype=D)
    m = t([[1, 1], [1, 0]], torch.long)
    loss, _ = value_loss(vpreds, zeros, vpreds, m, agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * (1 + 4 + 9) / 2)
    loss, _ = value_loss(vpreds, zeros, vpreds, m, agg_mode="token-mean", batch_num_tokens=7, dp_size=2)
    assert loss.item() == pytest.approx(0.5 * 14 / 7 * 2)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradcheck_value_loss(agg):
    gen = torch.Generator().manual_seed(3)
    vpreds = torch.randn(3, 4, generator=gen, dtype=D).requires_grad_(True)
    values = vpreds.detach() + torch.randn(3, 4, generator=gen, dtype=D)  # some clipped, some not
    returns = torch.randn(3, 4, generator=gen, dtype=D)
    m = (torch.rand(3, 4, generator=gen) > 0.3).long()
    assert torch.autograd.gradcheck(lambda v: value_loss(v, returns, values, m, 0.5, agg)[0], (vpreds,))
