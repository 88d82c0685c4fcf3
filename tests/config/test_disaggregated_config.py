"""The disaggregated mode's keys (megarl/config/disaggregated.py): what they derive, and each
setting that is wrong or not built yet refused naming its key and the fix."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.trainer.schedules import schedule_name

ON = ["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("grpo", list(overrides))
    return str(err.value)


def test_verl_s_fully_async_spelling_resolves():
    cfg = load_config("grpo", [*ON, "data.train_batch_size=0", "data.gen_batch_size=1",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                               "async_training.require_batches=4",
                               "async_training.staleness_threshold=0.5",
                               "async_training.trigger_parameter_sync_step=2"])
    assert cfg.data.train_batch_size == 64  # ppo_mini_batch_size x require_batches
    assert cfg.data.gen_batch_size is None  # verl's 1: one prompt per request, as always here
    assert cfg.async_training.staleness_threshold == 0.5
    assert schedule_name(cfg) == "fully_async"
    assert load_config("grpo", [*ON, "async_training.partial_rollout=true"]) \
        .async_training.partial_rollout is True
    assert schedule_name(load_config("grpo", [])) == "synchronous"
    assert schedule_name(load_config("grpo", ["async_training.staleness_threshold=1"])) \
        == "one_step_off"


@pytest.mark.parametrize("overrides,words", [
    (["actor_rollout_ref.hybrid_engine=false"],
     "actor_rollout_ref.hybrid_engine: hybrid_engine=false runs rollouts on workers of their "
     "own: rollout.nnodes (0)"),
    (["rollout.n_gpus_per_node=2", "rollout.nnodes=1"],
     "rollout.nnodes: rollout workers of their own run with actor_rollout_ref.hybrid_engine="
     "false"),
    (["async_training.staleness_threshold=0.5"],
     "async_training.staleness_threshold: 0.5: colocated rollouts lag by whole steps"),
    ([*ON, "async_training.staleness_threshold=-0.5"],
     "async_training.staleness_threshold: must be >= 0"),
    ([*ON, "async_training.require_batches=0"], "async_training.require_batches: must be >= 1"),
    ([*ON, "async_training.trigger_parameter_sync_step=0"],
     "async_training.trigger_parameter_sync_step: must be >= 1"),
    ([*ON, "data.train_batch_size=48"],
     "data.train_batch_size: 48 prompts, but a disaggregated step trains on "
     "actor.ppo_mini_batch_size x async_training.require_batches = 64; set "
     "data.train_batch_size=64 or 0"),
    (["async_training.partial_rollout=true"],
     "async_training.partial_rollout: requests that go on across a weight sync are the "
     "disaggregated mode's"),
    ([*ON, "async_training.partial_rollout=true",
      "actor_rollout_ref.actor.router_replay.mode=R3"],
     "async_training.partial_rollout: R3 replays the experts the engine chose, but a partial "
     "rollout recomputes"),
    ([*ON[:2], "rollout.nnodes=2", "rollout.n_gpus_per_node=1"],
     "rollout.nnodes: 2: rollout workers on other nodes need the launcher's rollout world"),
    ([*ON, "actor_rollout_ref.rollout.name=vllm"],
     "actor_rollout_ref.rollout.name: 'vllm': the disaggregated mode's workers run megarl's "
     "torch engine"),
    (["rollout.total_rollout_steps=640"],
     "rollout.total_rollout_steps: the run's length in prompts handed to rollout workers: a "
     "disaggregated mode key"),
    ([*ON, "rollout.total_rollout_steps=10"],
     "rollout.total_rollout_steps: 10 prompts do not make one learner step of 64"),
    ([*ON, "actor_rollout_ref.model.lora_rank=8"],
     "actor_rollout_ref.model.lora_rank: LoRA adapters on rollout workers are not built yet"),
])
def test_wrong_or_unbuilt_settings_are_refused_by_name(overrides, words):
    assert words in _error(*overrides)


def test_total_rollout_steps_sets_the_learner_steps():
    from megarl.config import disaggregated

    cfg = load_config("grpo", [*ON, "rollout.total_rollout_steps=650"])
    assert disaggregated.learner_steps(cfg) == 10  # 650 prompts // 64 per step
    assert disaggregated.learner_steps(load_config("grpo", [])) is None


def test_a_multiple_of_the_mini_batch_sets_require_batches():
    """verl's one-step-off scripts (rollout GPUs of their own, no async_training keys): a step
    of train_batch_size prompts in train_batch_size / ppo_mini_batch_size updates; an explicit
    require_batches that disagrees is refused."""
    cfg = load_config("grpo", [*ON, "data.train_batch_size=256",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=64"])
    assert cfg.async_training.require_batches == 4 and cfg.data.train_batch_size == 256
    assert "data.train_batch_size: 256 prompts, but a disaggregated step trains on " \
           "actor.ppo_mini_batch_size x async_training.require_batches = 64" in _error(
               *ON, "data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
               "async_training.require_batches=1")


def test_verl_s_recipe_keys_are_read():
    """compute_prox_log_prob=true is the ratio against the trainer's recomputation;
    rollout.test_freq counts weight syncs; the checkpoint engine's buffer is the bucket size."""
    cfg = load_config("grpo", [*ON, "async_training.compute_prox_log_prob=true",
                               "async_training.trigger_parameter_sync_step=4",
                               "rollout.test_freq=5", "rollout.total_epochs=3",
                               "async_training.checkpoint_engine.device_buffer_size_M=512",
                               "async_training.use_trainer_do_validate=true", "rollout.n=4"])
    assert cfg.async_training.use_rollout_log_probs is False
    assert cfg.trainer.test_freq == 20 and cfg.trainer.total_epochs == 3
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 512
    assert load_config("grpo", [*ON, "rollout.test_freq=-1"]).trainer.test_freq == -1
    assert "async_training.compute_prox_log_prob=3" in _error(
        *ON, "async_training.compute_prox_log_prob=3")


def test_each_worker_takes_its_share_of_a_window_at_once():
    """R x T x (1 + s) prompts a window (64 x 2 x 1.5 = 192), n = 8 samples each, over 2
    workers: 768 sequences each, beyond twice the engine's 32 slots. (The coordinator hands
    out only while the trainer waits on it: with twice the slots, a worker ran dry while the
    trainer trained, and the trainer then waited 21% of its steps, bench/async_modes.py.)"""
    from megarl.config import disaggregated

    cfg = load_config("grpo", [*ON, "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                               "async_training.require_batches=4", "data.train_batch_size=0",
                               "async_training.trigger_parameter_sync_step=2",
                               "async_training.staleness_threshold=0.5",
                               "actor_rollout_ref.rollout.n=8",
                               "actor_rollout_ref.rollout.max_num_seqs=32"])
    assert disaggregated.window_prompts(cfg) == 192
    assert disaggregated.worker_capacity(cfg) == 192 * 8 // 2
    big = load_config("grpo", [*ON, "actor_rollout_ref.rollout.max_num_seqs=4096"])
    assert disaggregated.worker_capacity(big) == 2 * 4096
