"""What differs per rollout engine lives on the engine class (megarl.rollout.build reads only its
name table): the spec's settings, the weight dtype, the device renumbering of an engine process.
A toy engine added to the table alone is built through the spec path like ours and vLLM's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megarl.errors import UserInputError
from megarl.rollout import build
from megarl.rollout.settings import RolloutSettings
from megarl.rollout.torch import TorchRolloutEngine
from megarl.rollout.vllm import VLLMEngine


def test_torch_engine_hooks():
    settings = {"path": "/m", "dtype": "bf16", "device": "cuda:3"}
    assert TorchRolloutEngine.settings_dtype(settings) == "bf16"
    moved = TorchRolloutEngine.settings_on_device(settings, "cuda:0")
    assert moved["device"] == "cuda:0" and settings["device"] == "cuda:3"  # a copy
    spec = build.EngineSpec("torch", settings)
    assert spec.weight_dtype == torch.bfloat16


def test_vllm_engine_hooks():
    settings = {"model_path": "/m", "engine_kwargs": {"dtype": "bfloat16"}}
    assert VLLMEngine.settings_dtype(settings) == "bfloat16"
    assert VLLMEngine.settings_on_device(settings, "cuda:0") is settings  # vLLM places itself
    assert build.EngineSpec("vllm", settings).weight_dtype == torch.bfloat16


def test_vllm_in_its_own_process_refuses_tensor_parallelism():
    """An engine process is a world of one: TP 2 is refused before vLLM is touched, naming the
    key and both ways out."""
    rollout = RolloutSettings(name="vllm", dtype="bf16", max_model_len=64, seed=0,
                              tensor_model_parallel_size=2)
    with pytest.raises(UserInputError) as err:
        VLLMEngine.spec_settings(rollout, "/m", "cpu", own_process=True)
    msg = str(err.value)
    assert msg.startswith("actor_rollout_ref.rollout.tensor_model_parallel_size=2 with "
                          "asynchronous rollout")
    assert "set it to 1, or set async_training.staleness_threshold=0" in msg


class ToyEngine:
    """A toy engine: settings are the rollout's name and dtype plus the device."""

    @classmethod
    def spec_settings(cls, rollout: RolloutSettings, model_path: str, device: Any, *,
                      own_process: bool = False) -> dict[str, Any]:
        return {"path": model_path, "dtype": rollout.dtype, "device": str(device),
                "own_process": own_process}

    @staticmethod
    def settings_dtype(settings: dict[str, Any]) -> str:
        return settings["dtype"]

    @staticmethod
    def settings_on_device(settings: dict[str, Any], device: str) -> dict[str, Any]:
        return {**settings, "device": device}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> ToyEngine:
        engine = cls()
        engine.settings = settings
        return engine


def test_an_engine_added_to_the_table_is_built_through_its_spec(monkeypatch):
    """The one table in build.py is all the build needs: spec, weight dtype, an engine
    process's device and the engine in this process all come from the class's hooks."""
    monkeypatch.setitem(build._CLASSES, "toy", (__name__, "ToyEngine"))
    monkeypatch.setattr(build, "SPEC_ENGINES", (*build.SPEC_ENGINES, "toy"))
    rollout = RolloutSettings(name="toy", dtype="bf16", max_model_len=64, seed=0)
    spec = build.engine_spec(rollout, "/m", "cpu", own_process=True)
    assert spec.engine == "toy" and spec.settings == {
        "path": "/m", "dtype": "bf16", "device": "cpu", "own_process": True}
    assert spec.weight_dtype == torch.bfloat16
    assert build.engine_from_spec(spec, device="cuda:0").settings["device"] == "cuda:0"
    engine = build.build_engine(rollout, "/m", "cpu")
    assert isinstance(engine, ToyEngine) and engine.settings["own_process"] is False
