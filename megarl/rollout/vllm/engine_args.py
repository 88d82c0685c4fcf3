"""``actor_rollout_ref.rollout.engine_kwargs.vllm``: verl's extra vLLM engine arguments.

They reach ``vllm.LLM(...)`` (vLLM's ``EngineArgs``) next to the arguments megarl sets itself.
An argument megarl sets from a config key of its own is refused, naming that key; a name that
is not a field of the installed vLLM's ``EngineArgs`` is refused with the closest names."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from megarl.errors import UserInputError

PREFIX = "actor_rollout_ref.rollout.engine_kwargs.vllm"
_RO = "actor_rollout_ref.rollout"
# the vllm.LLM arguments megarl sets (VLLMEngine.engine_settings, launch.memory_kwargs), and
# the config key each one is set from
OWNED: dict[str, str] = {
    "model": "actor_rollout_ref.model.path",
    "tokenizer": "actor_rollout_ref.model.tokenizer_path",
    "dtype": "actor_rollout_ref.model.dtype",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "tensor_parallel_size": f"{_RO}.tensor_model_parallel_size",
    "enable_expert_parallel": f"{_RO}.expert_parallel_size",
    "max_num_seqs": f"{_RO}.max_num_seqs",
    "max_num_batched_tokens": f"{_RO}.max_num_batched_tokens",
    "enable_chunked_prefill": f"{_RO}.enable_chunked_prefill",
    "enforce_eager": f"{_RO}.enforce_eager",
    "seed": f"{_RO}.seed (else trainer.seed)",
    "gpu_memory_utilization": f"{_RO}.gpu_memory_utilization",
    "kv_cache_memory_bytes": f"{_RO}.gpu_memory_utilization (the KV cache's size on CPU)",
    "enable_sleep_mode": f"{_RO}.free_cache_engine",
    "max_model_len": "data.max_prompt_length + data.max_response_length",
    "logprobs_mode": "nothing: the trainer reads the processed logprobs (of the distribution "
                     "sampled from)",
    "distributed_executor_backend": "nothing: megarl picks it for its process model "
                                    "(megarl.rollout.vllm.launch.executor_backend)",
}


def configured(rollout: Any, engine: str) -> dict[str, Any]:
    """The ``engine_kwargs.<engine>`` mapping of a rollout config (empty when unset)."""
    kwargs = getattr(rollout, "engine_kwargs", None)
    section = kwargs.get(engine) if isinstance(kwargs, Mapping) else getattr(kwargs, engine, None)
    return dict(section or {})


def engine_arg_names() -> set[str]:
    """The fields of the installed vLLM's ``EngineArgs`` (what ``vllm.LLM`` accepts)."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def check_engine_kwargs(extra: Mapping[str, Any], known: set[str] | None = None,
                        version: str = "") -> dict[str, Any]:
    """``extra`` (the user's engine_kwargs.vllm) when every name may be passed on; otherwise
    UserInputError naming each refused key on its own line. ``known``: EngineArgs' fields
    (read from the installed vLLM when None)."""
    if not version:
        import vllm

        version = vllm.__version__
    return check_extra(extra, OWNED, engine_arg_names() if known is None else known, PREFIX,
                       f"vLLM {version}'s engine (vllm.engine.arg_utils.EngineArgs)")


def check_extra(extra: Mapping[str, Any], owned: Mapping[str, str], known: set[str] | None,
                prefix: str, where: str) -> dict[str, Any]:
    """``extra`` unchanged when no name is in ``owned`` (argument -> the config key megarl sets
    it from) and every name is in ``known`` (None: not checked); else UserInputError, one line
    per refused key ``prefix.NAME`` (``where`` names the engine's argument list)."""
    problems = []
    for name in extra:
        key = f"{prefix}.{name}"
        if name in owned:
            problems.append(f"{key}: megarl sets this engine argument itself, from "
                            f"{owned[name]}; set that instead and drop this one")
        elif known is not None and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            problems.append(f"{key}: not an argument of {where}{hint}; check the spelling")
    if problems:
        raise UserInputError("\n".join(problems))
    return dict(extra)


def hf_overrides(hf_config: Mapping[str, Any], override_config: Mapping[str, Any] | None,
                 extra: Mapping[str, Any] | None = None,
                 key: str = "actor_rollout_ref.model.override_config") -> dict[str, Any]:
    """vLLM's ``hf_overrides`` engine argument for the policy's ``model.override_config``
    (verl's HF config overrides, which megarl's trainer applies too, so the engine samples from
    the model the trainer computes): {field: value} of each top-level ``config.json`` field the
    overrides change (a mapping value, e.g. ``rope_parameters``, is merged by vLLM into the
    config's own), plus the user's ``engine_kwargs.vllm.hf_overrides`` (``extra``), which may
    add fields but not set one of them to another value. Empty when nothing is overridden."""
    from megarl.models.overrides import apply_hf_overrides, changed_fields

    out = changed_fields(hf_config, apply_hf_overrides(hf_config, override_config, key))
    own = dict((extra or {}).get("hf_overrides") or {})
    clash = sorted(k for k in own if k in out and own[k] != out[k])
    if clash:
        raise UserInputError(
            f"{PREFIX}.hf_overrides sets {', '.join(clash)} unlike {key} "
            f"({', '.join(f'{k}={out[k]!r}' for k in clash)}): the engine would sample from "
            f"another model than the trainer computes; set them in {key} only")
    return {**out, **own}
