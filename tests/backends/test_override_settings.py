"""verl's override blocks, written as verl's example lines write them, reach each backend's
keyword arguments: ``model.override_config`` (both backends, as ``hf_overrides``),
``megatron.override_transformer_config`` and ``optim.override_optimizer_config`` (megatron).
The torch backend refuses megatron-core optimizer fields instead of dropping them."""

from __future__ import annotations

import pytest

from megarl.backends.torch.config import backend_kwargs as torch_kwargs
from megarl.config import load_config
from megarl.errors import UserInputError
from megarl.trainer.settings import role_settings

megatron_config = pytest.importorskip("megarl.backends.megatron.config")

A = "actor_rollout_ref.actor"
LINE = [
    "trainer.device=cpu", "data.train_files=train.parquet",
    "actor_rollout_ref.model.path=/policy", f"{A}.strategy=megatron",
    "actor_rollout_ref.model.override_config.model_config.max_position_embeddings=10240",
    f"{A}.optim.override_optimizer_config.optimizer_offload_fraction=1.",
    f"{A}.optim.override_optimizer_config.optimizer_cpu_offload=True",
    f"{A}.megatron.override_transformer_config.apply_rope_fusion=True",
    f"{A}.megatron.override_transformer_config.attention_dropout=0.1",
]


def test_verl_line_reaches_the_megatron_kwargs():
    cfg = load_config("grpo", LINE)
    _, actor = megatron_config.backend_kwargs(role_settings("actor", cfg))
    assert actor["hf_overrides"] == {"model_config": {"max_position_embeddings": 10240}}
    assert actor["transformer_overrides"] == {"apply_rope_fusion": True,
                                              "attention_dropout": 0.1}
    optim = actor["optim"]
    assert optim.override_optimizer_config == {"optimizer_offload_fraction": 1.0,
                                               "optimizer_cpu_offload": True}
    assert optim.override_key == f"{A}.optim.override_optimizer_config"
    # the reference reads the actor's
    _, ref = megatron_config.backend_kwargs(role_settings("ref", cfg))
    assert ref["hf_overrides"] == actor["hf_overrides"]
    assert ref["transformer_overrides"] == actor["transformer_overrides"]
    _, plain = megatron_config.backend_kwargs(role_settings("actor", load_config("grpo", LINE[:4])))
    assert "hf_overrides" not in plain and "transformer_overrides" not in plain
    assert plain["optim"].override_optimizer_config is None


def test_critic_keys_are_its_own():
    cfg = load_config("ppo", [*LINE[:4], "critic.megatron.override_transformer_config."
                              "attention_dropout=0.2",
                              "critic.optim.override_optimizer_config.optimizer_cpu_offload=true"])
    _, critic = megatron_config.backend_kwargs(role_settings("critic", cfg))
    assert critic["transformer_overrides"] == {"attention_dropout": 0.2}
    assert critic["optim"].override_key == "critic.optim.override_optimizer_config"
    assert "hf_overrides" not in critic  # critic.model.override_config is the critic's own
    assert role_settings("critic", cfg).override_key == "critic.model.override_config"


def test_unknown_transformer_field_is_refused_when_the_kwargs_are_built():
    cfg = load_config("grpo", [*LINE[:4], f"{A}.megatron.override_transformer_config."
                                          "apply_rope_fusoin=True"])
    with pytest.raises(UserInputError, match=rf"^{A}\.megatron\.override_transformer_config\."
                       r"apply_rope_fusoin: megatron-core .*did you mean apply_rope_fusion"):
        megatron_config.backend_kwargs(role_settings("actor", cfg))


def test_torch_backend_gets_the_hf_overrides_and_refuses_optimizer_fields():
    line = [*LINE[:3], "actor_rollout_ref.model.override_config.rope_theta=1e6"]
    _, kw = torch_kwargs(role_settings("actor", load_config("grpo", line)))
    assert kw["hf_overrides"] == {"rope_theta": 1e6}
    _, ref = torch_kwargs(role_settings("ref", load_config("grpo", line)))
    assert ref["hf_overrides"] == {"rope_theta": 1e6}
    bad = load_config("grpo", [*LINE[:3], LINE[5]])
    with pytest.raises(UserInputError, match=rf"^{A}\.optim\.override_optimizer_config=.*read "
                       "by strategy megatron only"):
        torch_kwargs(role_settings("actor", bad))


def test_dist_checkpointing_keys_reach_the_megatron_kwargs():
    dist = [f"{A}.megatron.use_dist_checkpointing=True",
            f"{A}.megatron.dist_checkpointing_path=/ckpt/mcore"]
    cfg = load_config("grpo", [*LINE[:4], *dist])
    for role in ("actor", "ref"):
        _, kw = megatron_config.backend_kwargs(role_settings(role, cfg))
        assert kw["dist_checkpoint"] == "/ckpt/mcore" and kw["dist_checkpoint_prefix"] == ""
    _, plain = megatron_config.backend_kwargs(role_settings("actor", load_config("grpo", LINE[:4])))
    assert "dist_checkpoint" not in plain
    with pytest.raises(UserInputError, match=rf"^{A}\.megatron\.use_dist_checkpointing=true "
                       rf"needs {A}\.megatron\.dist_checkpointing_path"):
        megatron_config.backend_kwargs(
            role_settings("actor", load_config("grpo", [*LINE[:4], dist[0]])))
    torch_line = [*LINE[:3], *dist]
    with pytest.raises(UserInputError, match=r"read by strategy megatron only"):
        torch_kwargs(role_settings("actor", load_config("grpo", torch_line)))
