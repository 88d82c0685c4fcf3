"""``actor_rollout_ref.rollout.engine_kwargs.vllm`` / ``.sglang`` (verl's extra engine
arguments) reach the engine; an argument megarl sets itself, or one the engine does not have,
is refused with one line naming the key. The reference for "the engine has it" is vLLM's own
``EngineArgs`` dataclass and, for the built engine, the value vLLM's model config holds."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import load_config
from megarl.errors import UserInputError
from megarl.trainer.settings import rollout_settings

pytestmark = pytest.mark.vllm
KEY = "actor_rollout_ref.rollout.engine_kwargs"


def _with_extra(engine: str, extra: dict):
    """The demo config with ``engine_kwargs.<engine>`` set by overrides."""
    return load_config("grpo", ["actor_rollout_ref.rollout.name=vllm",
                                *[f"{KEY}.{engine}.{k}={v}" for k, v in extra.items()]])


def test_unknown_and_owned_vllm_arguments_are_refused():
    """Planted: dropping either check lets the name through to vllm.LLM (a TypeError deep in
    vLLM, or megarl's own max_num_seqs silently replaced)."""
    from vllm.engine.arg_utils import EngineArgs

    from megarl.rollout.vllm.engine_args import OWNED, check_engine_kwargs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(OWNED) - {"model", "tokenizer"} <= fields  # megarl's own arguments are vLLM's
    assert check_engine_kwargs({"max_logprobs": 7, "disable_log_stats": True}) == {
        "max_logprobs": 7, "disable_log_stats": True}
    with pytest.raises(UserInputError) as err:
        check_engine_kwargs({"max_num_seq": 4, "max_num_seqs": 4}, version="0.32.0")
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"{KEY}.vllm.max_num_seq: not an argument of vLLM 0.32.0's engine")
    assert "close: max_num_seqs" in lines[0]
    assert lines[1] == (f"{KEY}.vllm.max_num_seqs: megarl sets this engine argument itself, from "
                        "actor_rollout_ref.rollout.max_num_seqs; set that instead and drop this one")


def test_sglang_owned_arguments_are_refused():
    from megarl.rollout.sglang.engine import user_engine_kwargs

    extra = rollout_settings(_with_extra("sglang", {"attention_backend": "triton"}))
    assert user_engine_kwargs(extra) == {
        "attention_backend": "triton"}
    with pytest.raises(UserInputError, match=rf"^{KEY}\.sglang\.mem_fraction_static: megarl sets "
                       r"this engine argument itself, from actor_rollout_ref\.rollout\."
                       r"gpu_memory_utilization"):
        user_engine_kwargs(rollout_settings(_with_extra("sglang", {"mem_fraction_static": 0.5})))


@pytest.mark.e2e
def test_vllm_engine_is_built_with_the_extra_argument():
    """A cheap argument megarl leaves alone (max_logprobs, vLLM's default 20) is on the built
    engine; an unknown one stops before vLLM starts."""
    from megarl.rollout.vllm import VLLMEngine

    cfg = _with_extra("vllm", {"max_logprobs": 7})
    settings = VLLMEngine.engine_settings(rollout_settings(cfg), "embedded://policy",
                                          enforce_eager=True)
    assert settings["engine_kwargs"]["max_logprobs"] == 7
    engine = VLLMEngine.from_settings(settings)
    try:
        assert engine.llm.llm_engine.model_config.max_logprobs == 7
    finally:
        engine.close()
    with pytest.raises(UserInputError, match=rf"{KEY}\.vllm\.max_logprob: not an argument"):
        VLLMEngine.engine_settings(rollout_settings(_with_extra("vllm", {"max_logprob": 7})),
                                   "embedded://policy")
