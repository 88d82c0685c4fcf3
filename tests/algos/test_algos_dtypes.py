"""The dtype contract of megarl.algos: the result has the dtype of the main input, half precision
is computed in float32, and a float64 side input does not promote a float32 result.

References are float64 computations from the same (rounded) inputs: a bf16 result must be that
reference rounded to bf16 (error <= 2^-8 relative, half a bf16 ulp, plus 1e-6). Planted: running
the bf16 pipelines in bf16 instead of float32 (`work_dtype` returning its input) exceeds that
bound by 15x (gae), 14x (grpo), 11x (REINFORCE++), 5x (PURE) and 2.5x (entropy); returning the float32 working tensor instead of casting back fails the dtype assertions.
"""

from __future__ import annotations

import algos_bruteforce as bf
import pytest
import torch

from megarl import algos

D = torch.float64
BF = torch.bfloat16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close_to_bf16_rounding(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == BF
    err = (got.to(D) - ref).abs()
    bound = ref.abs() * 2.0**-8 + 1e-6
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"bf16 result off its float64 reference by {worst:.2f}x half an ulp"


def _mask(batch, width, seed):
    lengths = torch.randint(width // 2, width + 1, (batch,), generator=_gen(seed))
    return torch.arange(width)[None, :] < lengths[:, None]


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_plus_plus"])
def test_bf16_advantages_are_float32_work_rounded_once(estimator):
    batch, width = 6, 96
    g = _gen(0)
    rewards = (torch.rand(batch, width, generator=g, dtype=D) * 0.2).to(BF)
    values = torch.randn(batch, width, generator=g, dtype=D).to(BF)
    mask = _mask(batch, width, 1)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, ret = algos.compute_advantages(estimator, token_rewards=rewards, response_mask=mask,
                                        values=values, group_index=groups, gamma=0.995, lam=0.97)
    r64, v64 = bf.rows(rewards.to(D)), bf.rows(values.to(D))
    if estimator == "gae":
        ea, er = bf.gae(r64, v64, bf.rows(mask), 0.995, 0.97)
    elif estimator == "grpo":
        ea = bf.grpo(r64, bf.rows(mask), groups.tolist())
        er = ea
    else:
        er = bf.rpp_returns(r64, bf.rows(mask), 0.995)
        ea = None
    assert adv.dtype == BF and ret.dtype == BF
    _close_to_bf16_rounding(ret, torch.tensor(er, dtype=D))
    if ea is not None:
        _close_to_bf16_rounding(adv, torch.tensor(ea, dtype=D))


def test_bf16_pure_pipeline_is_float32_work_rounded_once():
    batch, width = 6, 80
    g = _gen(2)
    mask = _mask(batch, width, 3)
    steps = (torch.rand(batch, width, generator=g) < 0.15) & mask
    steps[torch.arange(batch), mask.long().cumsum(-1).argmax(-1)] = True
    sr = torch.where(steps, torch.rand(batch, width, generator=g, dtype=D) * 2 - 1, 0.0).to(BF)
    kl = (torch.randn(batch, width, generator=g, dtype=D) * 0.05).to(BF)
    vr = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=BF)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, ret = algos.pure_rloo_advantages(step_rewards=sr, step_mask=steps, response_mask=mask,
                                          verifiable_rewards=vr, group_index=groups, kl=kl,
                                          kl_coef=0.5)
    ea, er = bf.pure_main(bf.rows(sr.to(D)), bf.rows(steps), bf.rows(mask), vr.to(D).tolist(),
                          groups.tolist(), "prm_vr", 0.1, 1.0, bf.rows(kl.to(D)), 0.5, True, True)
    assert adv.dtype == BF and ret.dtype == BF
    _close_to_bf16_rounding(ret, torch.tensor(er, dtype=D))
    _close_to_bf16_rounding(adv, torch.tensor(ea, dtype=D))
    for mode in ("min", 0.1):
        x = algos.pure_credit_assignment(sr, steps, mode)
        _close_to_bf16_rounding(x, algos.pure_credit_assignment(sr.to(D), steps, mode))


def test_bf16_entropy_is_float32_work_rounded_once():
    z = (torch.randn(4, 3, 4096, generator=_gen(4), dtype=D) * 3).to(BF)
    z64 = z.to(D)
    p = torch.softmax(z64, dim=-1)
    ref = -(p * torch.log(p)).sum(dim=-1)  # -sum p log p, another form than the code's
    _close_to_bf16_rounding(algos.entropy_from_logits(z), ref)


def test_float64_side_inputs_do_not_promote_a_float32_result():
    """Loss and KL functions return the dtype of their main input (logprob / vpreds /
    token_scores) when the side inputs are float64 (planted: skipping the cast of old_logprob,
    returns, ref_logprob or rollout_is_weights gives a float64 result)."""
    g = _gen(5)
    f64 = lambda: -torch.rand(4, 6, generator=g, dtype=D)  # noqa: E731
    mask = _mask(4, 6, 6)
    lp = f64().float()
    old, ref, adv, w = f64(), f64(), f64(), -f64()
    assert algos.kl_penalty(lp, ref, "k3").dtype == torch.float32
    rewards, _ = algos.apply_kl_in_reward(lp, old, ref, mask, kl_coef=0.1)
    assert rewards.dtype == torch.float32
    torch.testing.assert_close(
        rewards.to(D), lp.to(D) - 0.1 * torch.where(mask, old - ref, 0.0), rtol=1e-6, atol=1e-6)
    loss, _ = algos.policy_loss("vanilla", logprob=lp, old_logprob=old, advantages=adv,
                                response_mask=mask, rollout_is_weights=w)
    assert loss.dtype == torch.float32
    loss, _ = algos.value_loss(lp, old, ref, mask)
    assert loss.dtype == torch.float32
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D)
    groups = torch.tensor([0, 0, 1, 1])
    loss, _ = algos.pacs_loss(logprob=lp, old_logprob=old, response_mask=mask, scores=scores,
                              group_index=groups)
    assert loss.dtype == torch.float32
    ref_loss, _, _ = bf.pacs(bf.rows(lp.to(D)), bf.rows(old), bf.rows(mask), scores.tolist(),
                             groups.tolist(), 1.0, "1", "rloo", "question")
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
