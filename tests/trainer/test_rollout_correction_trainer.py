"""algorithm.rollout_correction.rollout_is in the trainer: the weights reach the actor's loss
and gradient (real 1-step runs of the demo GRPO recipe, torch engine, torch and megatron
backends, fp32), and
the step's pairing of logprobs (correction.py) on hand-built batches.

With fp32 engine and trainer the token ratios old/rollout are 1 within 1e-4 (measured:
min 0.99999, max 1.000003 on an AMD EPYC; 0.99995, 1.00003 on an Intel Xeon), so:
- threshold 1e6 truncates nothing: the run equals the plain one (the fused loss kernel there,
  the unfused loss with weights here) within 1e-4, pg_loss within the weights' own spread;
- threshold 0.5 truncates every weight to exactly 0.5: pg_loss and grad_norm are halved.

The runs score each response by a hash of its text (`SPREAD_REWARD`): a group's 4 responses
differ, so every group has non-zero advantages and the step a real gradient on any CPU (the
precondition asserts grad_norm > 0.1; measured 1.79). The demo's correctness score gives a group
advantages only when its responses disagree, which depends on the trajectory. The loss itself
may still be ~0: on-policy (ratio 1) the token-mean GRPO loss is -sum_i A_i len_i / sum_i len_i
and a group's advantages sum to zero, so it vanishes whenever each group's responses have
equal lengths, as the demo's rigid answer format mostly gives (a healthy run on an Intel Xeon
met pg_loss 9.3e-10 with grad_norm 0.40; here one group's responses differ in length and
pg_loss is -0.00238). pg_loss is therefore compared within `loss_rounding` as well as
relatively, and grad_norm carries the checks whatever the loss.

Planted, each fails test_truncated_weights_scale_the_loss_and_gradient with the threshold-0.5
run equal to the plain one (pg_loss 0.00658, where 0.5 x plain = 0.00329 is expected, with the
demo's reward on an AMD EPYC; with the hash reward on an Intel Xeon, where the last of the
three was planted again, grad_norm 1.79 where 0.90 is expected): the
weights not passed to policy_loss (losses.py), the fused kernel kept when weights are present
(it takes none), the weights not among the update's keys (trainer.py).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from trainer_helpers import train, train_rows

from megarl.errors import UserInputError
from megarl.trainer.correction import add_rollout_is_weights, require_rollout_logprobs

RC = "algorithm.rollout_correction"
ONE_STEP = ["trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=false"]
SPREAD_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""
U32 = 2.0**-24  # fp32 unit roundoff
RESPONSES = 16  # 4 prompts x 4 responses (trainer_helpers.FAST)


def spread_reward(directory) -> str:
    """The override scoring each response by a hash of its text (module docstring)."""
    path = directory / "spread_reward.py"
    path.write_text(SPREAD_REWARD)
    return f"custom_reward_function.path={path}"


def max_advantage(row: dict) -> float:
    return max(abs(row["critic/advantages/max"]), abs(row["critic/advantages/min"]))


def loss_rounding(row: dict) -> float:
    """How far two fp32 computations of the step's pg_loss (a token mean of N terms A_t w_t,
    |w_t| <= 1 within 1e-4) may differ: each rounds its sum by about sqrt(N) u max|A|
    (probabilistic rounding analysis, Higham and Mary 2019), x 2 for the pair. For the
    N ~ 600 tokens and max|A| <= (n - 1) / sqrt(n) = 1.5 of groups of n = 4: ~4e-6."""
    tokens = row["response_length/mean"] * RESPONSES
    return 2 * math.sqrt(tokens) * U32 * max_advantage(row)


@pytest.fixture(scope="module", params=["torch", "megatron"])
def runs(request, tmp_path_factory, demo_assets):
    """One step each of plain, threshold-1e6 and threshold-0.5 runs on the backend."""
    d = tmp_path_factory.mktemp(f"rollout_is_{request.param}")
    extra = {"plain": [],
             "wide": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1e6"],
             "half": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5"]}
    rows = {}
    for name, overrides in extra.items():
        train(d / name, "grpo", *ONE_STEP, *overrides, spread_reward(d),
              f"actor_rollout_ref.actor.strategy={request.param}")
        (rows[name],) = train_rows(d / name)
    return rows


def test_weights_of_one_leave_the_update_unchanged(runs):
    """The weights' own spread moves pg_loss: wide - plain = -mean_t (w_t - 1) A_t, at most
    rms(w - 1) max|A| (Cauchy-Schwarz; rms(w - 1)^2 = std(w)^2 + (mean(w) - 1)^2 from the
    run's metrics), plus the two computations' rounding; measured 1.8e-7 against 8.4e-6.
    Next to a loss near zero (module docstring) a relative bound cannot hold."""
    plain, wide = runs["plain"], runs["wide"]
    assert wide["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert abs(wide["rollout_corr/rollout_is_min"] - 1) < 1e-4
    assert abs(wide["rollout_corr/rollout_is_max"] - 1) < 1e-4
    assert "rollout_corr/rollout_is_mean" not in plain
    rms = math.hypot(wide["rollout_corr/rollout_is_std"], wide["rollout_corr/rollout_is_mean"] - 1)
    spread = rms * max_advantage(plain) + loss_rounding(plain)
    assert wide["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-4, abs=spread)
    for key in ("actor/grad_norm", "actor/entropy", "critic/score/mean"):
        assert wide[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key


def test_truncated_weights_scale_the_loss_and_gradient(runs):
    plain, half = runs["plain"], runs["half"]
    assert half["rollout_corr/rollout_is_truncated_mean"] == 0.5
    assert half["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    assert half["critic/score/mean"] == plain["critic/score/mean"]  # same rollouts
    assert plain["actor/grad_norm"] > 0.1, plain["actor/grad_norm"]  # a real update
    assert half["actor/grad_norm"] == pytest.approx(0.5 * plain["actor/grad_norm"], rel=1e-4)
    assert half["actor/pg_loss"] == pytest.approx(0.5 * plain["actor/pg_loss"], rel=1e-4,
                                                  abs=loss_rounding(plain))
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
    Planted: storing the weights in bypass mode too halves pg_loss (0.00329 vs 0.00658 with
    the demo's reward on an AMD EPYC) and grad_norm (0.897 vs 1.795 with the hash reward on an
    Intel Xeon), fails."""
    rows = {}
    for name, extra in (("plain", []), ("is", [f"{RC}.rollout_is=token",
                                               f"{RC}.rollout_is_threshold=0.5"])):
        train(tmp_path / name, "grpo", *ONE_STEP, "async_training.staleness_threshold=1",
              *extra, spread_reward(tmp_path))
        (rows[name],) = train_rows(tmp_path / name)
    plain, weighted = rows["plain"], rows["is"]
    assert weighted["rollout_corr/rollout_is_truncated_mean"] == 0.5
    assert plain["actor/grad_norm"] > 0.1, plain["actor/grad_norm"]  # a real update
    assert weighted["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)
    assert weighted["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-5,
                                                      abs=loss_rounding(plain))
