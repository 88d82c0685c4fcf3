"""Asynchronous rollout's corrections (megarl/trainer/async_rollout.py, correction.py): a loss
without a ratio gets the truncated importance weights (and is refused without them), the
decoupled setting without weights is announced, the KL in the reward measures the trainer's
policy, versions count actor updates (critic warmup), and a resume with a smaller staleness
bound generates the restored batches that would lag too much again. In-process runs of the
demo GRPO recipe (trainer_helpers.FAST, fp32, megarl's torch engine in its process)."""

from __future__ import annotations

import math

import pytest
import torch
from test_async import ASYNC1, _behaviour_gaps, _hf_logprobs, _run_async_steps
from trainer_helpers import FAST, train_rows

from megarl.errors import UserInputError

RC = "algorithm.rollout_correction"
FP32 = "actor_rollout_ref.model.dtype=fp32"
REINFORCE = "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce"
THRESHOLD = 2.0  # rollout_is_threshold's default


def _config(run_dir, overrides: list[str]):
    from megarl.config.loader import resolve_config

    return resolve_config("grpo", [*FAST, *overrides, f"trainer.default_local_dir={run_dir}"]
                          ).config


def _hf_policy():
    import transformers

    from megarl.demo.assets import resolve_uri

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        resolve_uri("embedded://policy"), torch_dtype=torch.float32).eval()


def _gap_bound(tokens: int) -> float:
    from fp32_bounds import fp32_gap_bound

    from megarl.demo.assets import resolve_uri

    return fp32_gap_bound(resolve_uri("embedded://policy"), tokens)


# ---------------------------------------------------------------- item: a loss without a ratio


def test_ratio_free_loss_without_weights_is_refused(tmp_path, demo_assets):
    """REINFORCE (no ratio) on lagged samples with rollout_is=null: refused before any model is
    built, naming the keys and the fix. Before the fix: "the trainer was built" (no error)."""
    from megarl.trainer.trainer import RLTrainer
    from megarl.utils import dist as mdist

    mdist.init_distributed(torch.device("cpu"))
    try:
        trainer = RLTrainer(_config(tmp_path, [*ASYNC1, REINFORCE]))
    except UserInputError as err:
        text = str(err)
    else:
        trainer.parts.close()
        pytest.fail("the trainer was built: its stale samples would train uncorrected")
    for words in ("actor_rollout_ref.actor.policy_loss.loss_mode='reinforce'",
                  "async_training.staleness_threshold=1", f"{RC}.rollout_is=null",
                  f"{RC}.rollout_is=token"):
        assert words in text, text


def test_ratio_free_loss_gets_the_truncated_weights(tmp_path, demo_assets):
    """Staleness 1, use_rollout_log_probs=true (the bypass mode), loss_mode=reinforce,
    rollout_is=token: every loss call's rollout_is_weights are min(exp(pi_prox - mu), 2) with
    pi_prox the logprobs under the trainer's weights before the step's update (those after step
    k-1) and mu those under the weights of the version that sampled, both by transformers: in
    log space within 2 x the fp32 gap of two forwards (tests/fp32_bounds.py; truncation is
    1-Lipschitz there). From step 2 on the lag is one update, so the reference weights are far
    from 1 (asserted: > 10 x the bound somewhere), and weights of 1 or none fail. Before the
    fix: the weights were measured but not applied (bypass), no loss call had any ("step 2:
    no rollout_is_weights in the loss")."""
    log: dict = {}
    cfg, calls, batches, weights = _run_async_steps(
        tmp_path, [*ASYNC1, FP32, REINFORCE, f"{RC}.rollout_is=token"], steps=3, log=log)
    model = _hf_policy()
    temperature = cfg.actor_rollout_ref.rollout.temperature
    bound = 2 * _gap_bound(len(batches) * 16 * cfg.data.max_response_length)
    gaps, spread = [], 0.0
    for step, ids, w in log["is_weights"]:
        if step < 2:
            continue
        assert w is not None, f"step {step}: no rollout_is_weights in the loss"
        b_ids, b_attn, b_resp, versions, _ = batches[step]
        L = b_resp.shape[1]
        for row in range(ids.shape[0]):
            # the first match: equal rows (duplicate responses) share their version
            i = next(i for i in range(b_ids.shape[0]) if torch.equal(b_ids[i], ids[row]))
            mask = b_resp[i].bool()
            args = (ids[row:row + 1], b_attn[i:i + 1], L, temperature)
            mu = _hf_logprobs(model, weights[int(versions[i])], *args)[0]
            prox = _hf_logprobs(model, weights[step - 1], *args)[0]
            ref = (prox - mu).clamp(max=math.log(THRESHOLD))
            got = torch.log(w[row].double())
            gaps.append(float((got - ref).abs()[mask].max()))
            spread = max(spread, float(ref.abs()[mask].max()))
    print(f"log-weight gap {max(gaps):.3g} (bound {bound:.3g}), max |log w| {spread:.3g}")
    assert gaps and max(gaps) <= bound, (max(gaps), bound)
    assert spread > 10 * bound, (spread, bound)


# ---------------------------------------------------------------- item: the notices


@pytest.fixture
def load(tmp_path):
    from megarl.config import load_config

    def run(*overrides: str):
        path = tmp_path / "c.yaml"
        path.write_text("data: {train_files: t.parquet, train_batch_size: 4}\n"
                        "actor_rollout_ref: {model: {path: m}, actor: {ppo_mini_batch_size: 4},"
                        " rollout: {n: 2}}\nalgorithm: {adv_estimator: grpo}\n")
        return load_config(str(path), list(overrides))
    return run


def _notices(cfg, prefix: str) -> list[str]:
    from megarl.config.notices import startup_notices

    return [n for n in startup_notices(cfg) if n.startswith(prefix)]


def test_uncorrected_decoupled_setting_is_announced(load):
    """use_rollout_log_probs=false with rollout_is=null at staleness 1: the ratio is against the
    trainer's recomputation and nothing corrects for the behaviour policy; one notice names
    both fixes. Not for staleness 0, the ratio against the behaviour policy, or with weights.
    Before the fix: no notice for that combination ([] == 1 line expected)."""
    key = "async_training.use_rollout_log_probs="
    decoupled = [*ASYNC1, "async_training.use_rollout_log_probs=false"]
    (line,) = _notices(load(*decoupled), key)
    for words in ("nothing corrects", "behaviour policy", f"{RC}.rollout_is=token",
                  "async_training.use_rollout_log_probs=true"):
        assert words in line, line
    assert _notices(load("async_training.use_rollout_log_probs=false"), key) == []
    assert _notices(load(*ASYNC1), key) == []
    assert _notices(load(*decoupled, f"{RC}.rollout_is=token"), key) == []


def test_bypass_notice_spares_a_loss_without_ratio(load):
    """The bypass notice ("weights not applied") is true of a loss with a ratio only: with
    loss_mode=reinforce the weights are applied, so it is not printed. Before the fix: the
    notice was printed for reinforce too (it said "not applied" of weights that now are)."""
    on = [*ASYNC1, f"{RC}.rollout_is=token"]
    assert len(_notices(load(*on), f"{RC}.rollout_is=")) == 1
    assert _notices(load(*on, REINFORCE), f"{RC}.rollout_is=") == []


# ---------------------------------------------------------------- item: KL in the reward


def test_kl_in_reward_measures_the_trainer_not_the_engine(tmp_path, demo_assets):
    """Staleness 1 with use_kl_in_reward (KL 'kl' = policy - ref per token): at step 1 the
    actor has not been updated, so actor and reference hold the same initial weights and the
    trainer's recomputation equals the reference's: the reward KL is exactly 0 and its source
    metric says trainer. The engine's logprobs differ from them (precondition: rollout_corr/kl
    != 0, the engine/trainer gap). Before the fix: the KL used the engine's logprobs
    (old_logprob replaced by behaviour_logprobs): actor/reward_kl_penalty -1.3e-8 (the
    engine/trainer gap), and no actor/reward_kl_source_trainer."""
    log: dict = {}
    _run_async_steps(tmp_path, [*ASYNC1, FP32, "algorithm.use_kl_in_reward=true"], steps=1,
                     log=log)
    m = log["metrics"][1]
    assert m["rollout_corr/kl"] != 0.0  # the engine's logprobs are not the trainer's
    assert m["actor/reward_kl_penalty"] == 0.0, m["actor/reward_kl_penalty"]
    assert m["actor/reward_kl_source_trainer"] == 1.0


# ---------------------------------------------------------------- item: versions and resume


def _versions_by_update(weights: dict[int, dict]) -> tuple[dict[int, dict], dict[int, int]]:
    """From the actor's weights after each step (0: initial): the weights of each version
    (version v = after the v-th update, found as a change of the weights) and the updates made
    by the end of each step."""
    by_version, done = {0: weights[0]}, {0: 0}
    for step in range(1, max(weights) + 1):
        changed = any(not torch.equal(weights[step][k], weights[step - 1][k])
                      for k in weights[step])
        done[step] = done[step - 1] + int(changed)
        by_version[done[step]] = weights[step]
    return by_version, done


def test_lag_counts_actor_updates_through_critic_warmup(tmp_path, demo_assets):
    """Staleness 1, trainer.critic_warmup=1 (step 1 updates no actor): each batch's version names
    the weights that sampled it counted in actor updates (its behaviour logprobs in the loss
    match transformers under the weights after that many updates, found from the recorded
    weights, within the fp32 gap), and the lag metric is the updates made before the step
    minus that version: 0, 0, 1, 1. Before the fix (versions = step numbers): step 3's lag was
    2 (the warmup step counted), and step 4's batch said version 2, the weights after 2
    updates, though 1 update had sampled it (behaviour logprob gap 0.17 against the bound
    5.5e-4)."""
    log: dict = {}
    cfg, calls, batches, weights = _run_async_steps(
        tmp_path, [*ASYNC1, FP32, "trainer.critic_warmup=1"], steps=4, log=log)
    by_version, done = _versions_by_update(weights)
    assert done == {0: 0, 1: 0, 2: 1, 3: 2, 4: 3}  # the warmup step updated no actor
    lags = []
    for step, (_, _, _, versions, metrics) in sorted(batches.items()):
        (v,) = set(versions.tolist())
        assert metrics["async/policy_version_lag/max"] == done[step - 1] - v
        lags.append(metrics["async/policy_version_lag/max"])
    assert lags == [0, 0, 1, 1]
    gaps = _behaviour_gaps(cfg, calls, batches, by_version)
    bound = _gap_bound(len(batches) * 16 * cfg.data.max_response_length)
    print(f"behaviour gap {max(gaps):.3g} (bound {bound:.3g})")
    assert gaps and max(gaps) <= bound, (max(gaps), bound)


def test_resume_with_a_smaller_bound_regenerates_too_old_batches(tmp_path, demo_assets,
                                                                  capsys):
    """A staleness-2 run saves after step 3 with the batches of steps 4 and 5 in flight (sampled
    by versions 1 and 2); resumed with staleness 1 they would lag 2 updates when collected, so
    both are dropped (the run says so) and generated again: lag max 0, 1, 1 on steps 4-6, all
    within the new bound. Before the fix: they were collected as restored, lag max 2, 2, 1."""
    from megarl.trainer.trainer import RLTrainer
    from megarl.utils import dist as mdist

    torch.set_num_threads(1)
    mdist.init_distributed(torch.device("cpu"))
    common = [FP32, "trainer.total_training_steps=6"]
    first = RLTrainer(_config(tmp_path, [*common, "async_training.staleness_threshold=2"]))
    try:
        for _ in range(3):
            first.step += 1
            metrics = first.train_step()
        first.save(metrics)
    finally:
        first.parts.close()
    resumed = RLTrainer(_config(tmp_path, [*common, *ASYNC1, "trainer.resume=auto"]))
    try:
        resumed.fit()
    finally:
        resumed.parts.close()
    rows = {r["step"]: r for r in train_rows(tmp_path)}
    assert [rows[s]["async/policy_version_lag/max"] for s in (4, 5, 6)] == [0, 1, 1]
    out = capsys.readouterr().out
    assert "resumed from step 3" in out
    for step in (4, 5):
        assert f"batch of step {step} was sampled by policy version {step - 3}" in out, out
