"""``actor_rollout_ref.rollout.expert_parallel_size`` (verl's key and rule: tensor x data
parallel size of the engine; megarl runs one engine per TP group, so 1 or the engine TP): it
reaches vLLM as ``enable_expert_parallel`` and SGLang as ``ep_size`` (both checked against the
engines' own argument lists: vLLM's ``EngineArgs`` here, SGLang's ``ServerArgs.ep_size`` by its
source, as megarl.rollout.sglang's other arguments); any other size is refused naming both keys.

Planted: the flag left out of vLLM's kwargs, or written for EP 1, fails
test_vllm_gets_enable_expert_parallel."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import ConfigError, load_config
from megarl.trainer.settings import rollout_settings

R = "actor_rollout_ref.rollout"


def _cfg(engine: str, tp: int, ep: int):
    return load_config("grpo", [f"launch.nproc_per_node={tp}", f"{R}.name={engine}",
                                f"{R}.tensor_model_parallel_size={tp}",
                                f"{R}.expert_parallel_size={ep}"])


@pytest.mark.parametrize("engine,tp,ep", [("vllm", 2, 3), ("vllm", 4, 2), ("torch", 1, 2)])
def test_a_size_other_than_1_or_the_engine_tp_is_refused(engine, tp, ep):
    with pytest.raises(ConfigError) as err:
        _cfg(engine, tp, ep)
    msg = str(err.value)
    assert f"{R}.expert_parallel_size" in msg and f"{R}.tensor_model_parallel_size" in msg
    assert (f"set it to {tp} (experts split over the engine's ranks) or 1" in msg if tp > 1
            else "set it to 1 (an engine of one rank holds every expert)" in msg)


def test_sglang_gets_ep_size():
    from megarl.rollout.sglang.engine import engine_kwargs

    kw = engine_kwargs(rollout_settings(_cfg("sglang", 2, 2)), local_rank=0, local_world_size=2)
    assert kw["tp_size"] == 2 and kw["ep_size"] == 2
    assert "ep_size" not in engine_kwargs(rollout_settings(_cfg("sglang", 2, 1)), 0, 2)


@pytest.mark.vllm
def test_vllm_gets_enable_expert_parallel():
    from vllm.engine.arg_utils import EngineArgs

    from megarl.rollout.vllm import VLLMEngine

    def kwargs(cfg):  # the executor named: this test is one process, the engine spans two
        return VLLMEngine.engine_settings(rollout_settings(cfg), cfg.actor_rollout_ref.model.path,
                                          distributed_executor_backend="external_launcher"
                                          )["engine_kwargs"]

    kw = kwargs(_cfg("vllm", 2, 2))
    assert kw["enable_expert_parallel"] is True and kw["tensor_parallel_size"] == 2
    assert "enable_expert_parallel" in {f.name for f in dataclasses.fields(EngineArgs)}
    kw = kwargs(_cfg("vllm", 2, 1))
    assert "enable_expert_parallel" not in kw  # vLLM's own default (False) stays untouched
