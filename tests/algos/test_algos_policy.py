"""Policy losses and agg_loss: hand-worked values and gradients, gradcheck, global normalisation
under gradient accumulation, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos import AGG_MODES, POLICY_LOSSES, agg_loss, policy_loss

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def leaf(x):
    return t(x).requires_grad_(True)


# ---------------------------------------------------------------- agg_loss by hand

L3 = t([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [70.0, 80.0, 90.0]])
M3 = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]], torch.long)  # lengths 3, 1 and an empty row


def test_agg_token_mean():
    assert agg_loss(L3, M3, "token-mean").item() == pytest.approx(10 / 4)  # no +1e-8
    assert agg_loss(L3, M3, "token-mean", batch_num_tokens=10, dp_size=2).item() == pytest.approx(2.0)


def test_agg_seq_mean_token_sum_excludes_empty_rows():
    assert agg_loss(L3, M3, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(L3, M3, "seq-mean-token-sum", global_batch_size=4, dp_size=2).item() == pytest.approx(10 / 4 * 2)


def test_agg_seq_mean_token_mean():
    assert agg_loss(L3, M3, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2, rel=1e-7)
    assert agg_loss(L3, M3, "seq-mean-token-mean", global_batch_size=3, dp_size=3).item() == pytest.approx(6.0, rel=1e-7)


def test_agg_seq_mean_token_sum_norm_constant_normaliser():
    assert agg_loss(L3, M3, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 3)  # padded L = 3
    # neither global_batch_size nor dp_size enter this mode
    assert agg_loss(L3, M3, "seq-mean-token-sum-norm", loss_scale_factor=5, dp_size=4, global_batch_size=9).item() == (
        pytest.approx(2.0)
    )


def test_agg_empty_call_is_zero_and_errors():
    z = agg_loss(L3, torch.zeros(3, 3), "token-mean")
    assert z.item() == 0.0
    assert agg_loss(L3, torch.zeros(3, 3), "seq-mean-token-mean").item() == 0.0
    with pytest.raises(ValueError, match="valid.*token-mean"):
        agg_loss(L3, M3, "token-sum")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(L3, M3, "token-mean", batch_num_tokens=0)


# ---------------------------------------------------------------- vanilla PPO by hand


def vanilla_case():
    # (A, ratio) per token; the 7th token is padding holding garbage
    adv = [1.0, 1.0, -1.0, -1.0, -2.0, 2.0, 5.0]
    ratio = [1.5, 0.5, 1.5, 5.0, 0.5, 1.0, 1.0]
    old = t([[-1.0, -2.0, -0.5, -3.0, -1.5, -0.7, float("nan")]])
    lp = leaf([[o + math.log(r) for o, r in zip(old[0, :6].tolist(), ratio[:6])] + [float("inf")]])
    m = t([[1, 1, 1, 1, 1, 1, 0]], torch.long)
    return lp, old, t([adv]), m, ratio


def test_vanilla_hand_values_metrics_and_gradient():
    lp, old, adv, m, ratio = vanilla_case()
    loss, met = policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=adv, response_mask=m)
    # token losses: clipped -1.2 | -0.5 | 1.5 | dual-clipped 3 | clipped 1.6 | -2
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 3.0 + 1.6 - 2.0) / 6)
    assert met["pg_loss"] == pytest.approx(loss.item())
    assert met["pg_clipfrac"] == pytest.approx(2 / 6)  # tokens 0 and 4
    assert met["pg_clipfrac_lower"] == pytest.approx(1 / 6)  # token 3
    assert met["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratio[:6]) / 6)
    loss.backward()
    # d loss / d logp = d(-A rho)/d logp = -A rho where unclipped, 0 where clipped
    torch.testing.assert_close(lp.grad, t([[0.0, -0.5, 1.5, 0.0, 0.0, -2.0, 0.0]]) / 6)


def test_vanilla_clip_higher_and_dual_clip_bound():
    lp, old, adv, m, _ = vanilla_case()
    loss, _ = policy_loss(
        "vanilla", logprob=lp, old_logprob=old, advantages=adv, response_mask=m,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=4.0,
    )
    # token 0 clipped at 1.28; token 3 dual-clipped at 4
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 4.0 + 1.6 - 2.0) / 6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=adv, response_mask=m, clip_ratio_c=1.0)


def test_vanilla_log_ratio_clamped_at_20():
    lp, old = leaf([[25.0]]), t([[0.0]])
    _, met = policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=t([[-1.0]]), response_mask=t([[1]]))
    assert met["ppo_kl"] == pytest.approx(-20.0)
    loss, _ = policy_loss("vanilla", logprob=leaf([[25.0]]), old_logprob=old, advantages=t([[1.0]]),
                          response_mask=t([[1]]), clip_ratio_high=1e12)
    assert loss.item() == pytest.approx(-math.exp(20.0))


def test_rollout_is_weights_multiply_the_token_loss():
    lp, old, adv, m, _ = vanilla_case()
    w = t([[2.0, 1.0, 0.0, 1.0, 0.5, 1.0, 9.0]])
    loss, _ = policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=adv, response_mask=m, rollout_is_weights=w)
    assert loss.item() == pytest.approx((-2.4 - 0.5 + 0.0 + 3.0 + 0.8 - 2.0) / 6)


# ---------------------------------------------------------------- gspo, cispo, reinforce by hand


def test_gspo_hand_forces_seq_mean_token_mean():
    old = t([[-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    d = t([[0.1, 0.3, 0.0], [-0.2, 0.0, 0.2]])
    lp = (old + d).requires_grad_(True)
    m = t([[1, 1, 0], [1, 1, 1]], torch.long)
    adv = t([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, met = policy_loss("gspo", logprob=lp, old_logprob=old, advantages=adv, response_mask=m, agg_mode="token-mean")
    # row 0: s = exp(0.2) = 1.2214 > 1.2 -> every token -1.2; row 1: s = exp(0) = 1 -> every token 1
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2, rel=1e-7)
    assert met["pg_clipfrac"] == pytest.approx(2 / 5)
    assert met["pg_clipfrac_lower"] == 0.0
    loss.backward()
    # row 0 is clipped (no gradient); row 1: d/d logp_t of -A s_t = s = 1, times 1/2 (rows) * 1/3 (tokens)
    torch.testing.assert_close(lp.grad, t([[0.0, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]]), rtol=1e-6, atol=1e-9)


def test_gspo_sequence_log_ratio_clamped_at_10():
    lp = leaf([[12.0, 12.0]])
    loss, met = policy_loss("gspo", logprob=lp, old_logprob=t([[0.0, 0.0]]), advantages=t([[-1.0, -1.0]]),
                            response_mask=t([[1, 1]]))
    assert loss.item() == pytest.approx(math.exp(10.0))  # not exp(12)
    assert met["ppo_kl"] == pytest.approx(-12.0)


def _geo_mean_loop(lp, old, adv, m, eps_low, eps_high, w=None):
    """GMPO from its definition, one sequence and one token at a time (float64 scalars)."""
    total, rows = 0.0, 0
    for i in range(lp.shape[0]):
        idx = [j for j in range(lp.shape[1]) if m[i, j]]
        if not idx:
            continue
        rows += 1
        log_r, a_sum, log_w = 0.0, 0.0, 0.0
        for j in idx:
            d, a = float(lp[i, j] - old[i, j]), float(adv[i, j])
            c = min(max(d, -eps_low), eps_high)
            log_r += min(d, c) if a > 0 else (max(d, c) if a < 0 else 0.0)
            a_sum += a
            log_w += math.log(max(float(w[i, j]), 1e-10)) if w is not None else 0.0
        n = len(idx)
        total += -(a_sum / n) * math.exp(log_r / n) * math.exp(log_w / n)
    return total / rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_geo_mean_against_a_loop(seed, weighted):
    """GMPO (verl's geo_mean) against its definition. A sign-blind clip (min for every A) or an
    arithmetic instead of geometric mean of the ratios changes the loss by > 1e-2 here."""
    lp, old, adv, m = rand_case(seed, batch=4, width=6)
    m[3] = 0  # an empty response does not count
    w = torch.rand(lp.shape, dtype=D, generator=torch.Generator().manual_seed(seed)) + 0.5 if weighted else None
    loss, met = policy_loss("geo_mean", logprob=lp, old_logprob=old, advantages=adv, response_mask=m,
                            clip_ratio_low=0.1, clip_ratio_high=0.15, agg_mode="token-mean",
                            rollout_is_weights=w)
    assert loss.item() == pytest.approx(_geo_mean_loop(lp, old, adv, m, 0.1, 0.15, w), rel=1e-7)  # +1e-8 in |y|
    d = (lp - old)[m.bool()]
    clipped = (d < -0.1) | (d > 0.15)
    a = adv[m.bool()]
    assert met["pg_clipfrac"] == pytest.approx(float((clipped & (a > 0)).double().mean()))
    assert met["pg_clipfrac_lower"] == pytest.approx(float((clipped & (a < 0)).double().mean()))


def test_cispo_hand():
    old = t([[-1.0, -2.0, -0.3]])
    ratio = [1.5, 0.5, 1.0]
    lp = leaf([[o + math.log(r) for o, r in zip(old[0].tolist(), ratio)]])
    adv = t([[1.0, -2.0, 3.0]])
    loss, met = policy_loss("cispo", logprob=lp, old_logprob=old, advantages=adv, response_mask=t([[1, 1, 1]]))
    lpv = lp.detach()[0].tolist()
    assert loss.item() == pytest.approx((-1.2 * 1 * lpv[0] - 0.8 * -2 * lpv[1] - 1.0 * 3 * lpv[2]) / 3)
    assert met["pg_clipfrac"] == pytest.approx(2 / 3) and met["pg_clipfrac_lower"] == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.2, 1.6, -3.0]]) / 3)  # -sg(clip(rho)) A


def test_reinforce_hand():
    lp = leaf([[-1.0, -2.0, 7.0], [-0.5, -0.25, -4.0]])
    adv = t([[1.0, -1.0, 3.0], [2.0, 2.0, 2.0]])
    m = t([[1, 1, 0], [1, 1, 1]], torch.long)
    loss, met = policy_loss("reinforce", logprob=lp, old_logprob=lp.detach(), advantages=adv, response_mask=m,
                            agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(((1 - 2) + (1 + 0.5 + 8)) / 2)
    assert met["pg_clipfrac"] == 0.0 and met["ppo_kl"] == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]]) / 2)


# ---------------------------------------------------------------- gradcheck (float64)


def rand_case(seed, batch=3, width=4):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=gen, dtype=D) * 2
    lp = old + 0.3 * torch.randn(batch, width, generator=gen, dtype=D)
    adv = torch.randn(batch, width, generator=gen, dtype=D)
    m = (torch.rand(batch, width, generator=gen) > 0.25).long()
    m[:, 0] = 1
    return lp, old, adv, m


@pytest.mark.parametrize("mode", ["vanilla", "reinforce"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradcheck_vanilla_reinforce(mode, agg):
    lp, old, adv, m = rand_case(1)
    w = torch.rand(lp.shape, dtype=D) + 0.5

    def f(x):
        return policy_loss(mode, logprob=x, old_logprob=old, advantages=adv, response_mask=m, agg_mode=agg,
                           rollout_is_weights=w)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(True),))


def test_gradcheck_gspo_single_token_rows():
    # with one token per response the sequence ratio is the token ratio: forward and gradient agree
    lp, old, adv, _ = rand_case(2, batch=5, width=1)

    def f(x):
        return policy_loss("gspo", logprob=x, old_logprob=old, advantages=adv, response_mask=torch.ones(5, 1))[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(True),))


def test_gradcheck_cispo_clipped_tokens():
    # when every ratio is outside the clip range the stop-gradient weight is a constant
    old = t([[-1.0, -2.0], [-0.5, -1.5]])
    lp = (old + t([[0.5, -0.6], [0.7, -0.4]])).requires_grad_(True)
    adv = t([[1.0, -2.0], [0.5, 3.0]])

    def f(x):
        return policy_loss("cispo", logprob=x, old_logprob=old, advantages=adv, response_mask=torch.ones(2, 2))[0]

    assert torch.autograd.gradcheck(f, (lp,))


def numeric_grad(fn, x, h=1e-6):
    g = torch.zeros_like(x)
    flat = x.reshape(-1)
    for k in range(flat.numel()):
        up, down = flat.clone(), flat.clone()
        up[k] += h
        down[k] -= h
        g.view(-1)[k] = (fn(up.view_as(x)) - fn(down.view_as(x))) / (2 * h)
    return g


def test_gspo_gradient_is_that_of_the_frozen_sequence_ratio_surrogate():
    lp, old, adv, m = rand_case(3)
    seq = ((lp - old) * m).sum(-1) / m.sum(-1)  # s_i at the evaluation point

    def surrogate(x):  # ratio_t = exp(x_t - lp_t + s_i): equal value, per-token gradient
        ratio = torch.exp(x - lp + seq[:, None])
        tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        return ((tok * m).sum(-1) / m.sum(-1)).mean()

    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss("gspo", logprob=x, old_logprob=old, advantages=adv, response_mask=m)
    loss.backward()
    assert loss.item() == pytest.approx(surrogate(lp).item(), rel=1e-6)
    torch.testing.assert_close(x.grad, numeric_grad(surrogate, lp) * m, rtol=1e-5, atol=1e-8)


def test_cispo_gradient_is_that_of_the_frozen_weight_surrogate():
    lp, old, adv, m = rand_case(4)
    weight = torch.exp(lp - old).clamp(0.8, 1.2)

    def surrogate(x):
        return (-(weight * adv * x) * m).sum() / m.sum()

    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss("cispo", logprob=x, old_logprob=old, advantages=adv, response_mask=m)
    loss.backward()
    torch.testing.assert_close(x.grad, numeric_grad(surrogate, lp) * m, rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------- global normalisation


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_accumulation_with_global_norm_equals_one_big_batch(mode, agg):
    lp, old, adv, m = rand_case(5, batch=6, width=5)
    m[4] = 0  # an empty response

    def grad_of(chunks, **norm):
        x = lp.clone().requires_grad_(True)
        total = 0.0
        for rows in chunks:
            loss, _ = policy_loss(mode, logprob=x[rows], old_logprob=old[rows], advantages=adv[rows],
                                  response_mask=m[rows], agg_mode=agg, **norm)
            total = total + loss
        total.backward()
        return total.detach(), x.grad

    big_loss, big_grad = grad_of([slice(0, 6)])
    norm = dict(batch_num_tokens=int(m.sum()), global_batch_size=int((m.sum(-1) > 0).sum()), loss_scale_factor=5)
    acc_loss, acc_grad = grad_of([slice(0, 2), slice(2, 6)], **norm)
    torch.testing.assert_close(acc_loss, big_loss)
    torch.testing.assert_close(acc_grad, big_grad)
    # without the global totals, accumulation differs (so the totals matter)
    if agg != "seq-mean-token-sum-norm":
        naive_loss, _ = grad_of([slice(0, 2), slice(2, 6)])
        assert not torch.isclose(naive_loss, big_loss)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_data_parallel_mean_of_rank_gradients_equals_one_big_batch(agg):
    lp, old, adv, m = rand_case(6, batch=6, width=5)
    dp = 2

    def grads(rows, **norm):
        x = lp.clone().requires_grad_(True)
        loss, _ = policy_loss("vanilla", logprob=x[rows], old_logprob=old[rows], advantages=adv[rows],
                              response_mask=m[rows], agg_mode=agg, **norm)
        loss.backward()
        return x.grad

    big = grads(slice(0, 6))
    # sum-norm is not multiplied by dp_size (as verl): pass L / dp_size to undo the DP mean
    norm = dict(dp_size=dp, batch_num_tokens=int(m.sum()), global_batch_size=6, loss_scale_factor=5 / dp)
    ranks = [grads(slice(0, 3), **norm), grads(slice(3, 6), **norm)]
    torch.testing.assert_close((ranks[0] + ranks[1]) / dp, big)


# ---------------------------------------------------------------- properties and errors


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(sorted(POLICY_LOSSES)), agg=st.sampled_from(AGG_MODES))
def test_on_policy_ratio_one_gives_zero_kl_and_clipfracs(seed, mode, agg):
    lp, _, adv, m = rand_case(seed)
    _, met = policy_loss(mode, logprob=lp, old_logprob=lp.clone(), advantages=adv, response_mask=m, agg_mode=agg)
    assert met["ppo_kl"] == 0.0
    assert met["pg_clipfrac"] == 0.0 and met["pg_clipfrac_lower"] == 0.0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(sorted(POLICY_LOSSES)), agg=st.sampled_from(AGG_MODES))
def test_padding_garbage_changes_nothing(seed, mode, agg):
    lp, old, adv, m = rand_case(seed)
    pad = m == 0
    x1 = lp.clone().requires_grad_(True)
    l1, met1 = policy_loss(mode, logprob=x1, old_logprob=old, advantages=adv, response_mask=m, agg_mode=agg)
    l1.backward()
    x2 = torch.where(pad, 1e4, lp).requires_grad_(True)
    l2, met2 = policy_loss(mode, logprob=x2, old_logprob=torch.where(pad, float("nan"), old),
                           advantages=torch.where(pad, -1e9, adv), response_mask=m.bool(), agg_mode=agg,
                           rollout_is_weights=torch.where(pad, float("inf"), torch.ones_like(lp)))
    l2.backward()
    assert l1.item() == pytest.approx(l2.item(), rel=1e-12)
    assert met1 == pytest.approx(met2, rel=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(sorted(POLICY_LOSSES)))
def test_permuting_the_batch_keeps_token_mean_loss(seed, mode):
    lp, old, adv, m = rand_case(seed, batch=5)
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(seed))
    a, _ = policy_loss(mode, logprob=lp, old_logprob=old, advantages=adv, response_mask=m)
    b, _ = policy_loss(mode, logprob=lp[perm], old_logprob=old[perm], advantages=adv[perm], response_mask=m[perm])
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_dtype_preserved_inputs_untouched_and_errors():
    lp, old, adv, m = rand_case(7)
    lp32 = lp.float().requires_grad_(True)
    snapshot = [old.clone(), adv.clone(), m.clone()]
    for mode in POLICY_LOSSES:
        loss, met = policy_loss(mode, logprob=lp32, old_logprob=old, advantages=adv, response_mask=m)
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert set(met) == {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
        assert all(isinstance(v, float) for v in met.values())
    assert all(torch.equal(a, b) for a, b in zip(snapshot, [old, adv, m]))
    with pytest.raises(ValueError, match="valid names.*vanilla"):
        policy_loss("ppo", logprob=lp, old_logprob=old, advantages=adv, response_mask=m)
    with pytest.raises(ValueError, match=r"\(3, 3\).*\(3, 4\)"):
        policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=adv[:, :3], response_mask=m)
    with pytest.raises(TypeError, match="unknown normalisation"):
        policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=adv, response_mask=m, batch_size=3)
