"""verl's keys that megarl has no key for, as the loader reads them (megarl/config/verl_compat.py).

Each status against what a user sees: a mapped key's value lands on its megarl key; an inert key
is silent at verl's default and gives one startup notice otherwise; a rejected key is accepted at
verl's default and is an error naming the key, the reason and what to use otherwise. Defaults
that are interpolations in verl (ref.ulysses_sequence_parallel_size =
${oc.select:actor_rollout_ref.actor.ulysses_sequence_parallel_size,1}) count as defaults when the
value equals what they resolve to.

Planted: not removing verl-only keys from the layers (take_verl_only skipped) fails every test
here with "unknown key"; comparing interpolated defaults as raw strings rejects
ref.ulysses_sequence_parallel_size=1 (test_interpolated_defaults_are_defaults).
"""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.config.loader import resolve_config

A = "actor_rollout_ref"


def _load(*overrides: str):
    return resolve_config("grpo", list(overrides))


def test_defaults_of_inert_and_rejected_keys_say_nothing():
    r = _load(f"{A}.actor.fsdp_config.param_offload=False", f"{A}.rollout.mode=async",
              f"{A}.rollout.multi_turn.enable=False", f"{A}.actor.ulysses_sequence_parallel_size=1",
              "trainer.use_legacy_worker_impl=auto", "critic.model.fsdp_config.param_offload=False")
    assert r.notices == []


def test_inert_key_set_gives_one_notice_with_its_reason():
    r = _load(f"{A}.ref.fsdp_config.param_offload=True",
              f"+{A}.ref.megatron.override_transformer_config.apply_rope_fusion=True")
    assert len(r.notices) == 2
    offload = next(n for n in r.notices if "param_offload" in n)
    assert offload.startswith(f"{A}.ref.fsdp_config.param_offload=True (from override ")
    assert "offload is not implemented" in offload
    assert "notice: " + offload in r.report()


def test_rejected_key_set_is_an_error_with_reason_and_alternative():
    with pytest.raises(ConfigError) as e:
        _load(f"{A}.rollout.multi_turn.use_inference_chat_template=True",
              f"{A}.actor.optim.min_lr=1e-7")
    text = str(e.value)
    assert f"{A}.rollout.multi_turn.use_inference_chat_template=True" in text
    assert "training chat template" in text
    assert f"{A}.actor.optim.min_lr=1e-07" in text and "min_lr_ratio" in text


def test_multi_turn_enable_is_a_megarl_key_now():
    """verl's multi_turn.enable=true (refused until the trainer ran the agent loop) is read as
    megarl's key: accepted with a tool config, and its unsupported combinations are refused
    naming both keys (tests/trainer/test_multi_turn_trainer.py has the rest)."""
    cfg = _load(f"{A}.rollout.multi_turn.enable=True",
                f"{A}.rollout.multi_turn.tool_config_path=tools.yaml").config
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is True
    with pytest.raises(ConfigError) as e:
        _load(f"{A}.rollout.multi_turn.enable=True")
    assert f"{A}.rollout.multi_turn.tool_config_path" in str(e.value)


def test_mapped_keys_land_on_megarl_keys():
    cfg = _load("launch.nproc_per_node=2", f"{A}.actor.optim.clip_grad=0.5", f"{A}.actor.fsdp_config.fsdp_size=2",
                f"{A}.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
                f"{A}.actor.megatron.override_transformer_config.recompute_granularity=full",
                "reward.custom_reward_function.name=my_score").config
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    # verl's fsdp_size at least the world size (2): one shard group over all ranks
    assert cfg.actor_rollout_ref.actor.parallel.data_parallel_shard == -1
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 64
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config == {
        "recompute_granularity": "full"}  # applied onto TransformerConfig, as verl does
    assert cfg.custom_reward_function.name == "my_score"


def test_a_mapped_key_and_its_megarl_key_disagreeing_is_an_error():
    with pytest.raises(ConfigError, match="grad_clip"):
        _load(f"{A}.actor.optim.clip_grad=0.5 ", f"{A}.actor.grad_clip=2.0")


def test_interpolated_defaults_are_defaults():
    r = _load("launch.nproc_per_node=2", f"{A}.ref.ulysses_sequence_parallel_size=1",
              f"{A}.ref.megatron.tensor_model_parallel_size=2",
              f"{A}.actor.megatron.tensor_model_parallel_size=2")
    assert r.notices == []  # the ref's layout follows the actor's, as verl's default says
    r = _load(f"{A}.ref.megatron.tensor_model_parallel_size=2")
    assert len(r.notices) == 1 and "actor's layout" in r.notices[0]


def test_unknown_keys_are_still_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        _load(f"{A}.rollout.not_a_verl_key=1")


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+", "k1+", "kl+", "abs+", "k2+", "mse+"])
def test_straight_through_kl_kinds_are_accepted(kind):
    """verl 0.9's '+' KL kinds (value of the estimator, gradient of k2; the math is
    tests/algos/test_algos_kl_value.py's) pass the config check for the KL loss and the KL in
    the reward and reach the loss as written. Before: 'invalid choice' for every one."""
    r = resolve_config("grpo", [f"actor_rollout_ref.actor.kl_loss_type={kind}",
                                f"algorithm.kl_penalty={kind}"])
    assert r.config.actor_rollout_ref.actor.kl_loss_type == kind
    assert r.config.algorithm.kl_penalty == kind
    from megarl.trainer.settings import actor_loss_settings

    assert actor_loss_settings(r.config).kl_loss_type == kind
