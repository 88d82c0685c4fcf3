"""algorithm.rollout_correction.rollout_is in the trainer: the weights reach the actor's loss
and gradient (real 1-step runs of the demo GRPO recipe, torch engine, torch and megatron
backends, fp32), and
the step's pairing of logprobs (correction.py) on hand-built batches.

With fp32 engine and trainer the token ratios old/rollout are 1 within 1e-5 (measured:
min 0.99999, max 1.000003), so:
- threshold 1e6 truncates nothing: the run equals the plain one (the fused loss kernel there,
  the unfused loss with weights here) within 1e-4;
- threshold 0.5 truncates every weight to exactly 0.5: pg_loss and grad_norm are halved.
Planted, each fails test_truncated_weights_scale_the_loss_and_gradient with the threshold-0.5
run equal to the plain one (pg_loss 0.00658, where 0.5 x plain = 0.00329 is expected): the
weights not passed to policy_loss (losses.py), the fused kernel kept when weights are present
(it takes none), the weights not among the update's keys (trainer.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trainer_helpers import train, train_rows

from megarl.errors import UserInputError
from megarl.trainer.correction import add_rollout_is_weights, require_rollout_logprobs

RC = "algorithm.rollout_correction"
ONE_STEP = ["trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=false"]


@pytest.fixture(scope="module", params=["torch", "megatron"])
def runs(request, tmp_path_factory, demo_assets):
    """One step each of plain, threshold-1e6 and threshold-0.5 runs on the backend."""
    d = tmp_path_factory.mktemp(f"rollout_is_{request.param}")
    extra = {"plain": [],
             "wide": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1e6"],
             "half": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5"]}
    rows = {}
    for name, overrides in extra.items():
        train(d / name, "grpo", *ONE_STEP, *overrides,
              f"actor_rollout_ref.actor.strategy={request.param}")
        (rows[name],) = train_rows(d / name)
    return rows


def test_weights_of_one_leave_the_update_unchanged(runs):
    plain, wide = runs["plain"], runs["wide"]
    assert wide["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert abs(wide["rollout_corr/rollout_is_min"] - 1) < 1e-4
    assert abs(wide["rollout_corr/rollout_is_max"] - 1) < 1e-4
    assert "rollout_corr/rollout_is_mean" not in plain
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
        assert wide[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key


def test_truncated_weights_scale_the_loss_and_gradient(runs):
    plain, half = runs["plain"], runs["half"]
    assert half["rollout_corr/rollout_is_truncated_mean"] == 0.5
    assert half["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    assert half["critic/score/mean"] == plain["critic/score/mean"]  # same rollouts
    assert abs(plain["actor/pg_loss"]) > 1e-4 and plain["actor/grad_norm"] > 1e-3
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert half[key] == pytest.approx(0.5 * plain[key], rel=1e-4), key
    assert half["actor/entropy"] == pytest.approx(plain["actor/entropy"], rel=1e-4)


def _batch(**tensors):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    return SimpleNamespace(tensors=dict(tensors), response_mask=mask)


SETTINGS = SimpleNamespace(rollout_is="token", rollout_is_threshold=2.0,
                           rollout_is_batch_normalize=False)


def test_decoupled_pairs_old_with_rollout_logprobs():
    """The ratio is against old_logprob: weights exp(old - rollout), stored for the loss."""
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.2, -1.0, 0.0], [-1.5, 0.0, 0.0]])
    batch = _batch(old_logprob=old, rollout_logprob=rollout)
    metrics = add_rollout_is_weights(batch, SETTINGS)
    w = batch.tensors["rollout_is_weights"]
    expected = [[torch.exp(torch.tensor(0.2)).item(), torch.exp(torch.tensor(-1.0)).item(), 0.0],
                [2.0, 0.0, 0.0]]
    assert w.tolist() == [pytest.approx(r, rel=1e-6) for r in expected]
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_bypass_measures_but_does_not_weight():
    """Asynchronous rollout with use_rollout_log_probs=true (old_logprob = the engine's,
    prox_logprob = the recomputation): the ratio already corrects, no weights are stored;
    the metrics come from prox vs rollout."""
    rollout = torch.tensor([[-1.2, -1.0, 0.0], [-1.5, 0.0, 0.0]])
    prox = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    batch = _batch(old_logprob=rollout, prox_logprob=prox, rollout_logprob=rollout)
    metrics = add_rollout_is_weights(batch, SETTINGS)
    assert "rollout_is_weights" not in batch.tensors
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(torch.e, rel=1e-6)


def test_missing_engine_logprobs_name_the_key():
    with pytest.raises(UserInputError) as err:
        require_rollout_logprobs(_batch(old_logprob=torch.zeros(2, 3)), "sequence")
    text = str(err.value)
    assert f"{RC}.rollout_is='sequence'" in text and f"{RC}.rollout_is=null" in text


def test_async_ratio_against_engine_logprobs_is_not_weighted(tmp_path, demo_assets):
    """Asynchronous rollout with use_rollout_log_probs=true (verl's bypass mode): the weights
    are measured (every one truncated to 0.5 here) but the update is the one without them.
    Planted: storing the weights in bypass mode too halves pg_loss (0.00329 vs 0.00658)."""
    rows = {}
    for name, extra in (("plain", []), ("is", [f"{RC}.rollout_is=token",
                                               f"{RC}.rollout_is_threshold=0.5"])):
        train(tmp_path / name, "grpo", *ONE_STEP, "async_training.staleness_threshold=1",
              *extra)
        (rows[name],) = train_rows(tmp_path / name)
    plain, weighted = rows["plain"], rows["is"]
    assert weighted["rollout_corr/rollout_is_truncated_mean"] == 0.5
    assert abs(plain["actor/pg_loss"]) > 1e-4
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert weighted[key] == pytest.approx(plain[key], rel=1e-5), key
