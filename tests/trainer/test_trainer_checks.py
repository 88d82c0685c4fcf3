"""Trainer-level checks: on-policy first step, engine vs trainer logprobs, both backends agree,
and bad input gives a clear error or a counted, logged skip while the run goes on."""

from __future__ import annotations

import json
import math
import re

import pytest
from fp32_bounds import fp32_gap_bound, fp32_gap_scale
from trainer_helpers import train, train_rows

RESPONSE_TOKENS = 16 * 48  # trainer_helpers.FAST: 4 prompts x 4 responses of 48 tokens at most


def test_first_step_on_policy_and_engine_logprobs(tmp_path, demo_assets):
    """The torch engine's sampled-token logprobs equal the trainer's recomputation up to fp32
    reduction order (KV-cache decode vs one full forward; the BLAS picks kernels by shape and
    CPU), bounded from the policy by tests/fp32_bounds.py: the max gap by fp32_gap_bound
    (5.3e-4 over the step's 768 tokens at most), the mean by the per-token scale
    fp32_gap_scale (1.05e-4: the mean |gap| is at most its root mean square). Measured: max
    4.9e-5, mean 5.8e-7 on an Intel Xeon (the former constants 1e-4 and 1e-6 were 2x and 1.7x
    above them); max under 1e-5 on an AMD EPYC. A real mismatch (positions, temperature,
    masking) is above 1e-2. Planted: the trainer's recomputation at 1.05 x the sampling
    temperature (trainer.py): max 0.198, mean 2.7e-3 (Intel Xeon): fails both."""
    from megarl.demo.assets import resolve_uri

    train(tmp_path, "grpo", "trainer.total_training_steps=1",
          "actor_rollout_ref.rollout.check_logprobs=true", "actor_rollout_ref.model.dtype=fp32")
    (row,) = train_rows(tmp_path)
    assert row["actor/ppo_kl"] == 0.0
    assert row["actor/pg_clipfrac"] == 0.0 and row["actor/pg_clipfrac_lower"] == 0.0
    policy = resolve_uri("embedded://policy")
    bound, scale = fp32_gap_bound(policy, RESPONSE_TOKENS), fp32_gap_scale(policy)
    assert bound < 1e-3, bound  # far below a real mismatch
    gap_max, gap_mean = row["rollout/logprob_abs_diff_max"], row["rollout/logprob_abs_diff_mean"]
    assert gap_max <= bound, (gap_max, bound)
    assert gap_mean <= scale, (gap_mean, scale)


@pytest.mark.parametrize("recipe", ["grpo", "pure_prm_vr"])
def test_backends_agree_on_first_step(tmp_path, demo_assets, recipe):
    rows = {}
    for backend in ("torch", "megatron"):
        train(tmp_path / backend, recipe, "trainer.total_training_steps=1",
              f"actor_rollout_ref.actor.strategy={backend}")
        (rows[backend],) = train_rows(tmp_path / backend)
    a, b = rows["torch"], rows["megatron"]
    # same engine, same seed, same initial weights: identical rollouts and rewards
    for key in ("critic/score/mean", "critic/verifiable_reward/mean", "response_length/mean",
                "critic/advantages/mean", "critic/advantages/max"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    # the updates are computed by two different model implementations: equal to fp32 noise
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _row(content, gt="5", **kw):
    row = {"data_source": "arith", "prompt": [{"role": "user", "content": content}],
           "ability": "arith", "reward_model": {"style": "rule", "ground_truth": gt},
           "extra_info": {}}
    row.update(kw)
    return row


def test_malformed_row_is_a_clear_error(tmp_path, demo_assets):
    data = tmp_path / "bad.jsonl"
    _write_rows(data, [_row("Compute: 2+3"), {"data_source": "arith", "prompt": "not messages"}])
    proc = train(tmp_path / "run", "grpo", f"data.train_files={data}",
                 "trainer.total_training_steps=1", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "bad.jsonl" in proc.stderr and "row 1" in proc.stderr and "prompt" in proc.stderr


def test_missing_ground_truth_and_overlong_prompt_are_counted(tmp_path, demo_assets):
    data = tmp_path / "mixed.jsonl"
    rows = [_row(f"Compute: {a}+{a}", str(2 * a)) for a in range(10, 18)]
    rows[1]["reward_model"]["ground_truth"] = ""          # missing ground truth: scores 0, counted
    rows.append(_row("Compute: " + "1+" * 200 + "1", "201"))  # over max_prompt_length: filtered
    _write_rows(data, rows)
    proc = train(tmp_path / "run", "grpo", f"data.train_files={data}", "data.shuffle=false",
                 "data.truncation=error", "data.filter_overlong_prompts=true",
                 "trainer.total_training_steps=2")
    assert "filtered" in proc.stderr or "filtered" in proc.stdout
    got = train_rows(tmp_path / "run")
    assert sum(r["reward/missing_ground_truth"] for r in got) == 4  # 1 prompt x n=4 responses
    assert all(r["data/num_filtered_prompts"] == 1 for r in got)


def test_overlong_prompt_with_truncation_error(tmp_path, demo_assets):
    data = tmp_path / "long.jsonl"
    _write_rows(data, [_row("Compute: 1+1", "2")] * 4 + [_row("Compute: " + "1+" * 200 + "1")])
    proc = train(tmp_path / "run", "grpo", f"data.train_files={data}", "data.truncation=error",
                 "data.filter_overlong_prompts=false", "trainer.total_training_steps=1",
                 check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "max_prompt_length" in proc.stderr


@pytest.mark.e2e  # starts launch/train.py
@pytest.mark.parametrize("override, expected", [
    ("reward_model.reward_manager=fancy", "reward_model.reward_manager"),
    ("actor_rollout_ref.rollout.nn=8", "did you mean n?"),
])
def test_config_mistakes_exit_cleanly(tmp_path, override, expected):
    proc = train(tmp_path, "grpo", override, check=False, timeout=120)
    assert proc.returncode == 2
    assert expected in proc.stderr and "Traceback" not in proc.stderr


HOSTILE_REWARD = '''
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    n = len(solution_str)
    if n % 3 == 0:
        while True:           # a pathological verifier call: must time out
            time.sleep(1)
    if n % 3 == 1:
        os._exit(3)           # a crashing one: retried once, then scored 0
    return 1.0
'''


def test_hostile_scoring_scores_zero_and_run_continues(tmp_path, demo_assets):
    fn = tmp_path / "hostile.py"
    fn.write_text(HOSTILE_REWARD)
    train(tmp_path / "run", "grpo", f"custom_reward_function.path={fn}",
          "reward_model.timeout_s=1.0", "trainer.total_training_steps=2")
    got = train_rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    assert sum(r["reward/timeouts"] for r in got) > 0
    assert sum(r["reward/errors"] for r in got) > 0
    assert all(math.isfinite(r["critic/score/mean"]) for r in got)


# Dynamic sampling: "same" prompts score 0 on every response (no signal: dropped); "vary"
# prompts score a fresh 0.1 + U(0, 1) per response (always signal).
SIGNAL_REWARD = '''
import random
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0 if ground_truth == "same" else 0.1 + random.random()
'''


def _dynamic_sampling_run(tmp_path, kinds, *overrides, check=True):
    data, fn = tmp_path / "signal.jsonl", tmp_path / "signal.py"
    _write_rows(data, [_row(f"Compute: {i}+{i}", kind) for i, kind in enumerate(kinds)])
    fn.write_text(SIGNAL_REWARD)
    return train(tmp_path / "run", "grpo", f"data.train_files={data}", "data.shuffle=false",
                 f"custom_reward_function.path={fn}", "algorithm.filter_groups.enable=true",
                 *overrides, check=check)


@pytest.mark.parametrize("max_rounds, rounds, groups", [(0, 3, 4), (1, 2, 2)])
def test_dynamic_sampling_keeps_only_groups_with_signal(tmp_path, demo_assets, max_rounds,
                                                        rounds, groups):
    # batches of 4 prompts: [same x4], [vary, vary, same, same], [vary x4]
    kinds = ["same"] * 4 + ["vary", "vary", "same", "same"] + ["vary"] * 4
    _dynamic_sampling_run(tmp_path, kinds, f"algorithm.filter_groups.max_num_gen_batches="
                          f"{max_rounds}", "trainer.total_training_steps=1")
    (row,) = train_rows(tmp_path / "run")
    # uncapped: rounds until 4 groups are kept; capped at 1: the first round keeps none, so one
    # more, then train on the 2 kept
    assert row["train/num_gen_batches"] == rounds and row["train/kept_groups"] == groups
    assert row["critic/score/min"] >= 0.1  # no response of a "same" group was trained on


def test_dynamic_sampling_without_any_signal_is_a_clear_error(tmp_path, demo_assets):
    proc = _dynamic_sampling_run(tmp_path, ["same"] * 8, "trainer.total_training_steps=1",
                                 check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "algorithm.filter_groups: 2 generation rounds" in proc.stderr
    assert "kept 0 of the 4 groups" in proc.stderr


def test_total_epochs_sets_the_steps_when_total_training_steps_is_unset(tmp_path, demo_assets):
    data = tmp_path / "ten.jsonl"
    _write_rows(data, [_row(f"Compute: {a}+1", str(a + 1)) for a in range(10)])
    train(tmp_path / "run", "grpo", f"data.train_files={data}", "trainer.total_epochs=2",
          "trainer.total_training_steps=null")
    # 10 prompts in batches of 4, the short last batch dropped (as verl): 2 steps an epoch
    assert [r["step"] for r in train_rows(tmp_path / "run")] == [1, 2, 3, 4]


def test_cosine_schedule_defaults_to_the_run_length(tmp_path, demo_assets):
    # optim.total_training_steps unset (-1): the schedule spans the run, one position per
    # optimizer update: 3 steps x 2 mini-batches (4 prompts, 2 per mini-batch) = 6 updates
    lr, floor, updates = 3e-4, 0.2, 6
    train(tmp_path, "grpo", "trainer.total_training_steps=3",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
          f"actor_rollout_ref.actor.optim.lr={lr}",
          f"actor_rollout_ref.actor.optim.min_lr_ratio={floor}")

    def lr_at(k):
        return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * k / updates)))

    got = [r["actor/lr"] for r in train_rows(tmp_path)]
    want = [(lr_at(2 * s) + lr_at(2 * s + 1)) / 2 for s in range(3)]  # logged: mean per step
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("mode", ["geo_mean", "gspo", "cispo"])
def test_policy_loss_modes_train(tmp_path, demo_assets, mode):
    """Every registered policy loss reaches the update through the config (GMPO is DAPO users'
    policy_loss.loss_mode=geo_mean): 2 steps, finite losses, the PPO metrics reported."""
    train(tmp_path / "run", "grpo", f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=2")
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2
    assert all(math.isfinite(r["actor/pg_loss"]) and "actor/pg_clipfrac" in r for r in rows)


def test_verl_world_keys_must_match_the_world_torchrun_started(tmp_path, demo_assets):
    """trainer.n_gpus_per_node (= launch.nproc_per_node) asking for 4 processes under a
    2-process torchrun is an error naming the key; left out, the run takes torchrun's world
    (the startup report shows launch.nproc_per_node = 2). Planted: skipping the check lets the
    4-GPU config train on 2 ranks."""
    bad = train(tmp_path / "bad", "grpo", "trainer.n_gpus_per_node=4", nproc=2, check=False)
    assert bad.returncode != 0
    assert ("launch.nproc_per_node (from override trainer.n_gpus_per_node=4) ask for 1 node(s) x 4"
            " process(es), but torchrun started 1 x 2") in bad.stderr
    ok = train(tmp_path / "ok", "grpo", "trainer.total_training_steps=1", nproc=2)
    assert re.search(r"launch\.nproc_per_node\s+= 2\s+<- override launch.nproc_per_node=2", ok.stdout)
