"""algorithm.rollout_correction.rollout_is in the trainer: the weights reach the actor's loss
and gradient (real 1-step runs of the demo GRPO recipe, torch engine, torch and megatron
backends, fp32), and
the step's pairing of logprobs (correction.py) on hand-built batches.

With fp32 engine and trainer the token ratios old/rollout are exp of the two forwards' logprob
gap, which tests/fp32_bounds.py bounds from the policy's shape and weights (5.3e-4 over the
step's 768 tokens at most): |w - 1| <= expm1(5.3e-4) (measured: min 0.99999, max 1.000003 on an
AMD EPYC; 0.99995, 1.00003 on an Intel Xeon, 2x inside the former constant 1e-4), so:
- threshold 1e6 truncates nothing: the run equals the plain one (the fused loss kernel there,
  the unfused loss with weights here) within what the weights' own spread moves: pg_loss by
  Cauchy-Schwarz, grad_norm by the update batch's per-token gradients (`gradient_mass`);
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
from fp32_bounds import U32, fp32_gap_bound
from trainer_helpers import train, train_rows

from megarl.errors import UserInputError
from megarl.trainer.correction import add_rollout_is_weights, require_rollout_logprobs

RC = "algorithm.rollout_correction"
ONE_STEP = ["trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=false"]
SPREAD_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""
RESPONSES = 16  # 4 prompts x 4 responses (trainer_helpers.FAST)
RESPONSE_TOKENS = RESPONSES * 48  # of 48 tokens at most (trainer_helpers.FAST)
# launch/train.py with the actor update's batch saved (to sys.argv[1]) as the update gets it
RECORD_UPDATE = """
import runpy, sys
import torch
import megarl.trainer.learner as learner

out = sys.argv.pop(1)
run_update = learner.run_update

def recording(backend, batch, keys, *args, **kwargs):
    if "rollout_is_weights" in keys:
        seq = batch.sequence_batch(keys)
        torch.save({"input_ids": seq.input_ids, "attention_mask": seq.attention_mask,
                    "response_length": seq.response_length, "tensors": seq.tensors,
                    "temperature": kwargs.get("temperature", 1.0)}, out)
    return run_update(backend, batch, keys, *args, **kwargs)

learner.run_update = recording
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


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


def gradient_mass(policy, record: dict) -> float:
    """S = sum_t |A_t| |grad lp_t| / N over the N response tokens of a recorded update batch
    (`RECORD_UPDATE`): the most that per-token factors within 1 +- d can move the gradient
    of the token-mean policy loss -sum_t w_t A_t ratio_t / N (ratio 1 on policy) is d S.
    Per-token gradients of all parameters by transformers (fp32, one batched backward per
    response)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    params = list(model.parameters())
    t, width = record["tensors"], record["response_length"]
    advantages, mask = t["advantages"], t["response_mask"].bool()
    total = 0.0
    for b in range(record["input_ids"].shape[0]):
        real = record["attention_mask"][b].bool()
        ids = record["input_ids"][b][real][None]
        prompt = int(real[:-width].sum())
        logits = model(ids).logits[0, prompt - 1:-1] / record["temperature"]
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, prompt:, None])[:, 0]
        n = lp.shape[0]
        assert n == int(mask[b].sum())
        grads = torch.autograd.grad(lp, params, torch.eye(n), is_grads_batched=True)
        norms = sum(g.reshape(n, -1).double().pow(2).sum(1) for g in grads).sqrt()
        total += float((advantages[b, :n].abs().double() * norms).sum())
    return total / int(mask.sum())


def gradient_rounding(policy) -> float:
    """Relative rounding of one fp32 backward's per-token gradient (tests/fp32_bounds.py's
    model: a sum of n terms is off by sqrt(n) u of their scale, the errors of successive
    products add): L + 1 products (the layers and the head), each summing at most n terms (the
    widest of hidden, MLP and vocabulary): 5 x sqrt(384) x 2^-24 = 5.8e-6 for the demo policy
    (its fp32 gradient of this step is within 2.2e-5 = 5.0e-6 S of float64's)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(policy) / "config.json").read_text())
    n = max(cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"])
    return (cfg["num_hidden_layers"] + 1) * math.sqrt(n) * U32


@pytest.fixture(scope="module", params=["torch", "megatron"])
def runs(request, tmp_path_factory, demo_assets):
    """One step each of plain, threshold-1e6 and threshold-0.5 runs on the backend; the
    threshold-1e6 run's update batch recorded (rows["record"])."""
    d = tmp_path_factory.mktemp(f"rollout_is_{request.param}")
    extra = {"plain": [],
             "wide": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1e6"],
             "half": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5"]}
    rows = {}
    for name, overrides in extra.items():
        record = ("-c", RECORD_UPDATE, str(d / "update.pt")) if name == "wide" else ()
        train(d / name, "grpo", *ONE_STEP, *overrides, spread_reward(d),
              f"actor_rollout_ref.actor.strategy={request.param}", python_args=record)
        (rows[name],) = train_rows(d / name)
    rows["record"] = torch.load(d / "update.pt")
    return rows


def test_weights_of_one_leave_the_update_unchanged(runs):
    """Threshold 1e6 truncates nothing, and the weights are exp of the engine-vs-trainer
    logprob gap: |w - 1| <= expm1(B), B = 5.3e-4 (module docstring).

    Their own spread moves pg_loss: wide - plain = -mean_t (w_t - 1) A_t, at most
    rms(w - 1) max|A| (Cauchy-Schwarz; rms(w - 1)^2 = std(w)^2 + (mean(w) - 1)^2 from the
    run's metrics), plus the two computations' rounding; measured 1.8e-7 against 8.4e-6.
    Next to a loss near zero (module docstring) a relative bound cannot hold.

    And grad_norm: the gradients differ by sum_t (w_t - 1) A_t grad lp_t / N, at most
    d S with d = max|w - 1| (the run's metrics) and S = `gradient_mass` of the update batch,
    plus each run's fp32 rounding of its gradient, `gradient_rounding` x S (with the weights
    forced to exactly 1 the unfused path's grad_norm equals the plain run's within 7e-8). A token with a tiny probability has both the largest gap (its logprob is
    ill-conditioned) and a large gradient: on an Intel Xeon d = 5.0e-5 and one token carries
    1.35 of S = 4.31 against grad_norm 1.79, so grad_norm moved by 5.4e-5 (relative 3.0e-5,
    a third of the former constant rel 1e-4); the bound (5.0e-5 + 2 x 5.8e-6) x 4.31 =
    2.6e-4 (megatron: 5.0e-5 against 2.5e-4). Planted (torch, Intel Xeon): the stored weights
    divided by their mean over all B x L positions, padding included (a batch normalisation
    that counts padding): grad_norm 1.892 against 1.795 (moved 0.098, allowed 2.6e-4) and
    pg_loss -0.00251 against -0.00238 +- 8.4e-6, fails; the engine's logprobs paired one
    token off (correction.py): rollout_is_min 0.014, |w - 1| = 0.99 against expm1(B) = 5.3e-4,
    fails."""
    from megarl.demo.assets import resolve_uri

    plain, wide = runs["plain"], runs["wide"]
    policy = resolve_uri("embedded://policy")
    spread_max = math.expm1(fp32_gap_bound(policy, RESPONSE_TOKENS))
    assert wide["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert abs(wide["rollout_corr/rollout_is_min"] - 1) <= spread_max, spread_max
    assert abs(wide["rollout_corr/rollout_is_max"] - 1) <= spread_max, spread_max
    assert "rollout_corr/rollout_is_mean" not in plain
    rms = math.hypot(wide["rollout_corr/rollout_is_std"], wide["rollout_corr/rollout_is_mean"] - 1)
    spread = rms * max_advantage(plain) + loss_rounding(plain)
    assert wide["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-4, abs=spread)
    for key in ("actor/entropy", "critic/score/mean"):
        assert wide[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key
    d = max(abs(wide["rollout_corr/rollout_is_min"] - 1),
            abs(wide["rollout_corr/rollout_is_max"] - 1))
    mass = gradient_mass(policy, runs["record"])
    allowed = (d + 2 * gradient_rounding(policy)) * mass
    moved = abs(wide["actor/grad_norm"] - plain["actor/grad_norm"])
    print(f"grad_norm moved {moved:.3g}, allowed {allowed:.3g} (d {d:.3g}, S {mass:.3g})")
    assert moved <= allowed, (moved, allowed, d, mass)


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


def test_bypass_weights_a_loss_without_ratio():
    """The same batch as in bypass mode, for a loss that takes no ratio (reinforce): nothing
    else corrects, so the weights exp(prox - rollout), truncated at 2, are stored for the loss.
    Before the fix: add_rollout_is_weights took no such argument and stored none."""
    rollout = torch.tensor([[-1.2, -1.0, 0.0], [-1.5, 0.0, 0.0]])
    prox = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    batch = _batch(old_logprob=rollout, prox_logprob=prox, rollout_logprob=rollout)
    add_rollout_is_weights(batch, SETTINGS, loss_has_ratio=False)
    expected = [[math.exp(0.2), math.exp(-1.0), 0.0], [2.0, 0.0, 0.0]]
    w = batch.tensors["rollout_is_weights"]
    assert w.tolist() == [pytest.approx(r, rel=1e-6) for r in expected]


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
