"""verl / DAPO users' keys on real runs of launch/train.py (the embedded demo policy, a 12-row
jsonl cut from the demo's arithmetic task, one of them malformed):

- data.on_bad_row=skip drops the malformed row and counts it (data/num_bad_rows);
- trainer.total_epochs counts when total_training_steps is null: 2 epochs of
  floor(11 / 4) = 2 batches are 4 steps (verl: len(dataloader) x total_epochs);
- data.gen_batch_size=6 with dynamic sampling: an epoch is floor(11 / 6) = 1 round, so 2 epochs
  are 2 steps of train_batch_size 4 groups at most;
- trainer.log_val_generations=2 prints two validation generations;
- trainer.balance_batch=false prints its startup notice;
- reward_model.reward_kwargs.overlong_buffer_cfg.* (main_ppo's spelling) applies the penalty
  and its log switch adds reward/overlong_ratio;
- rollout.free_cache_engine: true puts the engine to sleep during training
  (rollout/engine_asleep 1), false leaves it awake (no sleep, no metric);
- fixed micro sizes (use_dynamic_bsz=false) train, trainer.logger as a plain string.
Planted: the sampler sized by train_batch_size makes the gen_batch_size run 4 steps; a trainer
that does not print startup_notices fails the notice check.
"""

from __future__ import annotations

import json

import pytest
from trainer_helpers import metrics, train, train_rows

MICRO = ["actor_rollout_ref.actor.use_dynamic_bsz=false",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, demo_assets):
    import pyarrow.parquet as pq

    from megarl.data import resolve_path

    d = tmp_path_factory.mktemp("rows")
    rows = pq.read_table(resolve_path("embedded://arith/train.parquet")).slice(0, 11).to_pylist()
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, json.dumps({"data_source": "arith"}))  # no prompt: malformed
    (d / "train.jsonl").write_text("\n".join(lines) + "\n")
    (d / "val.jsonl").write_text("\n".join(lines[:4]) + "\n")
    return d


@pytest.fixture(scope="module")
def epochs_run(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("epochs") / "run"
    proc = train(run, "grpo", f"data.train_files={data / 'train.jsonl'}",
                 f"data.val_files={data / 'val.jsonl'}", "data.on_bad_row=skip",
                 "trainer.total_training_steps=null", "trainer.total_epochs=2",
                 "trainer.val_before_train=true", "trainer.log_val_generations=2",
                 "trainer.balance_batch=false", "trainer.logger=jsonl",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.len=40",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.log=true", *MICRO)
    return run, proc.stdout + proc.stderr


def test_total_epochs_bad_rows_and_overlong(epochs_run):
    run, _ = epochs_run
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 2 epochs x 2 batches of 4 prompts
    assert all(r["data/num_bad_rows"] == 1.0 for r in rows)
    assert all("reward/overlong_ratio" in r and "reward/overlong_penalty_mean" in r for r in rows)
    assert rows[-1]["training/epoch"] == 1
    assert all(r["rollout/engine_asleep"] == 1.0 for r in rows)  # free_cache_engine: true


def test_validation_generations_and_notice_are_printed(epochs_run):
    _, out = epochs_run
    assert out.count("val generation (step 0") == 2, out[-3000:]
    assert "notice: trainer.balance_batch=False: accepted without effect" in out


def test_gen_batch_size_rounds(tmp_path, data):
    run = tmp_path / "run"
    train(run, "grpo", f"data.train_files={data / 'train.jsonl'}", "data.on_bad_row=skip",
          "trainer.total_training_steps=null", "trainer.total_epochs=2",
          "data.gen_batch_size=6", "algorithm.filter_groups.enable=true",
          "algorithm.filter_groups.max_num_gen_batches=1",
          "actor_rollout_ref.rollout.free_cache_engine=false")
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]  # 2 epochs x floor(11 / 6) rounds
    for r in rows:
        assert r["train/num_gen_batches"] == 1 and 1 <= r["train/kept_groups"] <= 4
        assert "rollout/engine_asleep" not in r  # free_cache_engine=false: never asleep
    assert not [r for r in metrics(run) if r["step"] == 0]  # FAST: no validation
