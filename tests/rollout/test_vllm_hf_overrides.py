"""``actor_rollout_ref.model.override_config`` reaches vLLM as its ``hf_overrides`` engine
argument, so the engine samples from the model the trainer computes. The reference is vLLM's
own ``EngineArgs`` (the argument exists) and the model config vLLM builds from it (the values
its model reads), without starting an engine."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.errors import UserInputError
from megarl.models import read_hf_config
from megarl.models.testing import make_tiny_hf_model
from megarl.rollout.vllm.engine_args import hf_overrides

pytestmark = pytest.mark.vllm
OVERRIDE = {"rope_theta": 500.0, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("vllm_overrides") / "qwen2", "qwen2")


def test_vllm_builds_its_model_config_with_the_overrides(folder):
    """Planted: passing rope_theta alone (the top-level field, as verl's key spells it) leaves
    vLLM 0.32's model config at rope_parameters.rope_theta 10000 (measured), so the engine
    would sample with another RoPE base than the trainer's."""
    from vllm.engine.arg_utils import EngineArgs

    assert "hf_overrides" in {f.name for f in dataclasses.fields(EngineArgs)}
    overrides = hf_overrides(read_hf_config(folder), OVERRIDE)
    assert overrides["max_position_embeddings"] == 1024
    model_config = EngineArgs(model=str(folder), hf_overrides=overrides,
                              max_model_len=1024).create_model_config()
    assert model_config.hf_config.rope_parameters["rope_theta"] == 500.0
    assert model_config.hf_config.max_position_embeddings == 1024
    plain = EngineArgs(model=str(folder)).create_model_config()
    assert plain.hf_config.rope_parameters["rope_theta"] == 10000.0


def test_hf_overrides_of_engine_kwargs_merge_without_contradicting(folder):
    config = read_hf_config(folder)
    assert hf_overrides(config, None) == {} and hf_overrides(config, {}) == {}
    merged = hf_overrides(config, OVERRIDE, {"hf_overrides": {"my_field": 1,
                                                               "max_position_embeddings": 1024}})
    assert merged["my_field"] == 1 and merged["max_position_embeddings"] == 1024
    with pytest.raises(UserInputError, match=(
            r"^actor_rollout_ref\.rollout\.engine_kwargs\.vllm\.hf_overrides sets "
            r"max_position_embeddings unlike actor_rollout_ref\.model\.override_config")):
        hf_overrides(config, OVERRIDE, {"hf_overrides": {"max_position_embeddings": 2048}})
    with pytest.raises(UserInputError, match=r"override_config: hidden_size=32 changes the "
                       "model's weights"):
        hf_overrides(config, {"hidden_size": 32})
