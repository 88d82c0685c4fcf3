"""``parallel.context_parallel_size`` (megatron's context parallelism): verl's
``megatron.context_parallel_size`` lands on it, the data-parallel size counts it, and bad
layouts are errors that name the key and the fix.

Planted: leaving CP out of the data-parallel size in validate.py fails
test_data_parallel_is_world_over_cp (2 prompts refused over "4" data-parallel ranks).
"""

from __future__ import annotations

import pytest

from megarl.backends.megatron.config import backend_kwargs
from megarl.config import ConfigError
from megarl.config.loader import resolve_config
from megarl.trainer.settings import role_settings

A = "actor_rollout_ref"
MEGA = f"{A}.actor.strategy=megatron"
KEY = "parallel.context_parallel_size"


def _load(*overrides: str):
    return resolve_config("grpo", list(overrides))


@pytest.mark.parametrize("spelling", [f"{A}.actor.megatron.context_parallel_size",
                                      f"{A}.actor.{KEY}"])
def test_verl_spelling_maps_to_the_parallel_key(spelling):
    r = _load("launch.nproc_per_node=2", MEGA, f"{spelling}=2")
    assert r.config.actor_rollout_ref.actor.parallel.context_parallel_size == 2
    assert r.notices == []
    kw = {role: backend_kwargs(role_settings(role, r.config, "m"))[1]["cp"]
          for role in ("actor", "ref")}
    assert kw == {"actor": 2, "ref": 2}


def test_critic_key_maps_and_must_match_the_actor():
    r = _load("launch.nproc_per_node=2", MEGA, "critic.strategy=megatron",
              "algorithm.adv_estimator=gae", f"{A}.actor.megatron.context_parallel_size=2",
              "critic.megatron.context_parallel_size=2")
    assert backend_kwargs(role_settings("critic", r.config, "m"))[1]["cp"] == 2
    # unset, the critic's size follows the actor's (one megatron-core parallel state)
    r = _load("launch.nproc_per_node=2", MEGA, "critic.strategy=megatron",
              "algorithm.adv_estimator=gae", f"{A}.actor.megatron.context_parallel_size=2")
    assert r.config.critic.parallel.context_parallel_size == 2
    with pytest.raises(ConfigError) as e:
        _load("launch.nproc_per_node=2", MEGA, "critic.strategy=megatron",
              "algorithm.adv_estimator=gae", f"{A}.actor.megatron.context_parallel_size=2",
              "critic.megatron.context_parallel_size=1")
    text = str(e.value)
    assert f"critic.{KEY}" in text and f"{A}.actor.{KEY}" in text and "set them equal" in text


def test_torch_strategy_is_refused_naming_ulysses():
    with pytest.raises(ConfigError) as e:
        _load("launch.nproc_per_node=2", f"{A}.actor.{KEY}=2")
    text = str(e.value)
    assert f"{A}.actor.{KEY}" in text and "megatron backend" in text
    assert "ulysses_sequence_parallel_size" in text


def test_cp_must_divide_the_world():
    with pytest.raises(ConfigError) as e:
        _load("launch.nproc_per_node=2", MEGA, f"{A}.actor.megatron.context_parallel_size=4")
    assert f"{A}.actor.{KEY}" in str(e.value) and "CP 4 does not divide the 2 ranks" in str(e.value)


def test_non_positive_cp_is_an_error():
    with pytest.raises(ConfigError, match=f"{A}.actor.{KEY}"):
        _load(MEGA, f"{A}.actor.{KEY}=0")


def test_data_parallel_is_world_over_cp():
    """4 ranks, CP 2: 2 data-parallel ranks, so 3 prompts cannot be split (at CP 1: 4 ranks,
    and 2 prompts could not)."""
    _load("launch.nproc_per_node=4", MEGA, f"{A}.actor.megatron.context_parallel_size=2",
          "data.train_batch_size=2", f"{A}.actor.ppo_mini_batch_size=2")
    with pytest.raises(ConfigError, match="over 2 data-parallel ranks"):
        _load("launch.nproc_per_node=4", MEGA, f"{A}.actor.megatron.context_parallel_size=2",
              "data.train_batch_size=3", f"{A}.actor.ppo_mini_batch_size=3")


@pytest.mark.parametrize("split", [f"{A}.actor.megatron.context_parallel_size=2",
                                   f"{A}.actor.ulysses_sequence_parallel_size=2"])
def test_per_gpu_token_budgets_scale_with_the_sequence_split(split):
    """verl's ``*_max_token_len_per_gpu`` counts one GPU's tokens; where two ranks split each
    sequence, a micro-batch holds twice the budget (verl's workers multiply it alike)."""
    from megarl.backends.settings import micro_batch_tokens
    from megarl.trainer.settings import role_settings

    strategy = [MEGA] if "megatron" in split else []
    r = _load("launch.nproc_per_node=2", *strategy, split,
              f"{A}.rollout.log_prob_use_dynamic_bsz=true",
              f"{A}.rollout.log_prob_max_token_len_per_gpu=1000",
              f"{A}.actor.ppo_max_token_len_per_gpu=3000")
    for role in ("actor", "ref"):
        assert role_settings(role, r.config, "m").micro.max_tokens == 2000
    actor = r.config.actor_rollout_ref.actor
    assert micro_batch_tokens(actor.ppo_max_token_len_per_gpu, actor.parallel) == 6000
    plain = _load(f"{A}.rollout.log_prob_max_token_len_per_gpu=1000")
    assert role_settings("actor", plain.config, "m").micro.max_tokens == 1000


@pytest.mark.parametrize("key", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_megatron_roles_share_tensor_and_pipeline_sizes(key, tmp_path):
    """A reward model on megatron beside a megatron actor: left unset, its TP (or PP) size
    follows the actor's; written otherwise, the config check refuses it naming both keys.
    Before: the reward model kept 1, the run started and its backend failed deep inside
    megatron's parallel state (a traceback), as the real PURE recipe on 8 GPUs would have."""
    from megarl.models.testing import make_tiny_hf_model

    rm = make_tiny_hf_model(tmp_path / "rm", "qwen2", head="seq_cls", tokenizer=False)
    common = ["launch.nproc_per_node=2", MEGA, "reward_model.enable=true",
              f"reward_model.model.path={rm}", f"{A}.actor.parallel.{key}=2"]
    r = _load(*common)
    assert getattr(r.config.reward_model.parallel, key) == 2
    with pytest.raises(ConfigError) as e:
        _load(*common, f"reward_model.parallel.{key}=1")
    text = str(e.value)
    assert f"reward_model.parallel.{key}=1" in text and f"{A}.actor.parallel.{key}=2" in text
    assert "set them equal" in text
