"""Registries: the public API, user registration, unknown and duplicate names."""

import pytest
import torch

import megarl.algos as algos
from megarl.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    compute_advantages,
    policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)

SPEC_API = [
    "compute_advantages", "policy_loss", "agg_loss", "kl_penalty", "entropy_from_logits", "value_loss",
    "pure_credit_assignment", "pure_rloo_advantages", "pacs_loss", "FixedKLController", "AdaptiveKLController",
    "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "register_advantage_estimator", "register_policy_loss",
    "masked_sum", "masked_mean", "masked_var", "masked_whiten",
]


def test_public_api_is_importable():
    for name in SPEC_API:
        assert hasattr(algos, name), name
        assert name in algos.__all__
    assert set(ADVANTAGE_ESTIMATORS) >= {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "grpo_passk",
    }
    assert set(POLICY_LOSSES) >= {"vanilla", "gspo", "cispo", "reinforce"}


def test_user_estimator_and_loss_are_dispatched():
    @register_advantage_estimator("test_constant_adv")
    def constant(*, token_rewards, response_mask, **_):
        adv = torch.where(response_mask, 2.0, 0.0).to(token_rewards.dtype)
        return adv, adv

    @register_policy_loss("test_double_reinforce")
    def double(*, logprob, advantages, response_mask, agg_mode, norm, **_):
        loss = algos.agg_loss(-2 * advantages * logprob, response_mask, agg_mode, **norm)
        return loss, {"pg_loss": loss.item(), "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}

    try:
        m = torch.tensor([[1, 1, 0]])
        adv, _ = compute_advantages("test_constant_adv", token_rewards=torch.zeros(1, 3), response_mask=m)
        assert adv.tolist() == [[2.0, 2.0, 0.0]]
        lp = torch.tensor([[-1.0, -2.0, -3.0]])
        loss, _ = policy_loss("test_double_reinforce", logprob=lp, old_logprob=lp, advantages=adv, response_mask=m)
        assert loss.item() == pytest.approx(-2 * 2 * (-3.0) / 2)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant_adv")(lambda **kw: None)
        register_advantage_estimator("test_constant_adv")(constant)  # re-registering the same function is fine
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant_adv", None)
        POLICY_LOSSES.pop("test_double_reinforce", None)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError) as err:
        compute_advantages("nope", token_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))
    for name in ("gae", "grpo", "rloo", "remax", "opo", "grpo_passk"):
        assert name in str(err.value)
    with pytest.raises(ValueError) as err:
        policy_loss("nope", logprob=torch.zeros(1, 1), old_logprob=torch.zeros(1, 1),
                    advantages=torch.zeros(1, 1), response_mask=torch.ones(1, 1))
    for name in ("vanilla", "gspo", "cispo", "reinforce"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="non-empty"):
        register_policy_loss("")
