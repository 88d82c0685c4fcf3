"""The judge's inference engine: megarl's torch engine or vLLM on the judge model's folder.

The judge model (``reward_model.model.path``) is frozen: its engine is built once from its own
folder and never receives the policy's weights, and vLLM's sleep mode stays off for it (a level-2
sleep drops the weights, which only a weight sync would bring back). An SGLang judge is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.config.schema_judge import JudgeRolloutConfig
from megarl.errors import UserInputError
from megarl.rollout.build import EngineSpec
from megarl.rollout.protocol import RolloutEngine

KEY = "reward_model.rollout"
# vllm.LLM arguments the judge sets itself, and the key each one is set from
OWNED: dict[str, str] = {
    "model": "reward_model.model.path",
    "tokenizer": "the judge model's tokenizer (its folder)",
    "dtype": f"{KEY}.dtype",
    "tensor_parallel_size": f"{KEY}.tensor_model_parallel_size",
    "max_num_seqs": f"{KEY}.max_num_seqs",
    "max_num_batched_tokens": f"{KEY}.max_num_batched_tokens",
    "enable_chunked_prefill": f"{KEY}.enable_chunked_prefill",
    "enable_prefix_caching": f"{KEY}.enable_prefix_caching",
    "enforce_eager": f"{KEY}.enforce_eager",
    "seed": f"{KEY}.seed",
    "max_model_len": f"{KEY}.max_model_len",
    "gpu_memory_utilization": f"{KEY}.gpu_memory_utilization",
    "kv_cache_memory_bytes": f"{KEY}.gpu_memory_utilization (the KV cache's size on CPU)",
    "enable_sleep_mode": "nothing: the frozen judge stays resident",
    "logprobs_mode": "nothing: the judge reads text only",
    "load_format": f"{KEY}.load_format",
    "disable_log_stats": f"{KEY}.disable_log_stats",
    "distributed_executor_backend": "nothing: megarl picks it for its process model",
}


def check_judge_config(cfg: JudgeRolloutConfig, engine: bool = True) -> None:
    """UserInputError naming the first bad ``reward_model.rollout`` key and its fix.
    engine=False: the engine is built elsewhere (``name`` and the dtype are not checked)."""
    if engine:
        _check_engine_keys(cfg)
    for name in ("prompt_length", "response_length", "max_num_seqs", "tensor_model_parallel_size"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise UserInputError(f"{KEY}.{name} must be an int >= 1, got {value!r}")
    if not cfg.timeout_s > 0:
        raise UserInputError(f"{KEY}.timeout_s must be > 0 seconds, got {cfg.timeout_s!r}")
    if not cfg.temperature >= 0:
        raise UserInputError(f"{KEY}.temperature must be >= 0 (0 = greedy), got {cfg.temperature!r}")
    if not 0.0 < cfg.top_p <= 1.0:
        raise UserInputError(f"{KEY}.top_p must be in (0, 1], got {cfg.top_p!r}")
    if not isinstance(cfg.top_k, int) or (cfg.top_k < 1 and cfg.top_k not in (-1, 0)):
        raise UserInputError(f"{KEY}.top_k must be -1 (off) or an int >= 1, got {cfg.top_k!r}")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise UserInputError(f"{KEY}.gpu_memory_utilization must be in (0, 1], got "
                             f"{cfg.gpu_memory_utilization!r}")
    if (cfg.score_min is not None and cfg.score_max is not None
            and cfg.score_min > cfg.score_max):
        raise UserInputError(f"{KEY}.score_min={cfg.score_min} > {KEY}.score_max="
                             f"{cfg.score_max}: no score could pass; swap or drop them")
    if cfg.max_model_len is not None and cfg.max_model_len < cfg.prompt_length + cfg.response_length:
        raise UserInputError(
            f"{KEY}.max_model_len={cfg.max_model_len} < prompt_length + response_length = "
            f"{cfg.prompt_length + cfg.response_length}: a judged prompt and its verdict would "
            "not fit; raise it or leave it null")


def _check_engine_keys(cfg: JudgeRolloutConfig) -> None:
    from megarl.utils.dtypes import CONFIG_DTYPES, DTYPE_ALIASES

    if cfg.name is None:
        raise UserInputError(f"{KEY}.name is required for a generative judge: set it to vllm "
                             "or torch (megarl's own engine)")
    if cfg.name == "sglang":
        raise UserInputError(f"{KEY}.name=sglang: megarl serves a generative judge with vLLM or "
                             f"its torch engine only; set {KEY}.name=vllm or torch")
    if cfg.name not in ("vllm", "torch"):
        raise UserInputError(f"{KEY}.name={cfg.name!r}: unknown engine; use vllm or torch")
    if DTYPE_ALIASES.get(cfg.dtype, cfg.dtype) not in CONFIG_DTYPES:
        raise UserInputError(f"{KEY}.dtype={cfg.dtype!r}: use one of {sorted(CONFIG_DTYPES)}")
    for name in ("data_parallel_size", "expert_parallel_size"):
        if getattr(cfg, name) != 1:
            raise UserInputError(f"{KEY}.{name}={getattr(cfg, name)}: the judge runs one engine "
                                 "in this process; set it to 1")
    if cfg.skip_tokenizer_init:
        raise UserInputError(f"{KEY}.skip_tokenizer_init=true: the judge decodes its verdicts "
                             "with the judge model's tokenizer; set it to false")
    if cfg.limit_images is not None:
        raise UserInputError(f"{KEY}.limit_images={cfg.limit_images}: the judge reads text "
                             "only; set it to null")
    if cfg.name == "torch" and cfg.load_format not in ("auto", "safetensors"):
        raise UserInputError(f"{KEY}.load_format={cfg.load_format!r}: megarl's torch engine "
                             "loads the judge's safetensors; set it to auto (or use name=vllm)")
    sections = cfg.engine_kwargs or {}
    if not isinstance(sections, dict) or any(
            not isinstance(v, dict | None) for v in sections.values()):
        raise UserInputError(f"{KEY}.engine_kwargs must map an engine name to its arguments "
                             f"(verl's layout, e.g. {{vllm: {{swap_space: 4}}}}); got {sections!r}")


def model_len(cfg: JudgeRolloutConfig) -> int:
    """TOKENS per judge sequence (prompt + verdict) the engine is sized for."""
    return cfg.max_model_len or cfg.prompt_length + cfg.response_length


def check_model_len(cfg: JudgeRolloutConfig, model_path: str) -> None:
    """UserInputError when a judge sequence (`model_len` TOKENS) would pass the judge model's
    ``max_position_embeddings`` (config.json), before any engine starts."""
    from megarl.models import read_hf_config

    limit = read_hf_config(model_path).get("max_position_embeddings")
    length = model_len(cfg)
    if isinstance(limit, int) and length > limit:
        what = (f"{KEY}.max_model_len={cfg.max_model_len}" if cfg.max_model_len else
                f"{KEY}.prompt_length + response_length = {length}")
        raise UserInputError(
            f"{what} tokens is more than the judge model's max_position_embeddings={limit} "
            f"({model_path}); lower {KEY}.prompt_length / response_length so they sum to at "
            f"most {limit}")


def build_judge_engine(cfg: JudgeRolloutConfig, model_path: str, tokenizer_path: str,
                       device: torch.device | str = "cpu", seed: int = 0) -> RolloutEngine:
    """The judge's engine (``cfg.name``: torch or vllm) on the frozen judge model, built by
    `megarl.rollout.build.engine_from_spec` from `judge_engine_spec`."""
    from megarl.rollout.build import engine_from_spec

    return engine_from_spec(judge_engine_spec(cfg, model_path, tokenizer_path, device, seed))


def judge_engine_spec(cfg: JudgeRolloutConfig, model_path: str, tokenizer_path: str,
                      device: torch.device | str = "cpu", seed: int = 0) -> EngineSpec:
    """The judge's engine as an `EngineSpec` (checked: the config, the sequence length against
    the model, vLLM's extra arguments)."""
    from megarl.utils.dtypes import CONFIG_DTYPES, canonical_dtype

    check_judge_config(cfg)
    check_model_len(cfg, model_path)
    device = torch.device(device)
    dtype_name = canonical_dtype(cfg.dtype, f"{KEY}.dtype")
    if cfg.name == "torch":
        from megarl.rollout.memory import device_memory

        free, _ = device_memory(device)
        return EngineSpec("torch", {
            "path": model_path, "dtype": dtype_name, "device": str(device),
            "tokenizer": tokenizer_path, "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": model_len(cfg),
            "kv_cache_bytes": int(cfg.gpu_memory_utilization * free)}, device=str(device))
    return EngineSpec("vllm", _vllm_settings(cfg, model_path, tokenizer_path, device,
                                             CONFIG_DTYPES[dtype_name], seed),
                      device=str(device))


def _vllm_settings(cfg: JudgeRolloutConfig, model_path: str, tokenizer_path: str,
                   device: torch.device, dtype_name: str, seed: int) -> dict[str, Any]:
    """`VLLMEngine.from_settings`' data for the judge (sleep mode off: a frozen model)."""
    from megarl.models import read_hf_config
    from megarl.rollout.vllm import engine_args, launch
    from megarl.rollout.vllm.engine import import_vllm

    vllm = import_vllm()
    extra = engine_args.check_extra(engine_args.configured(cfg, "vllm"), OWNED,
                                    engine_args.engine_arg_names(), f"{KEY}.engine_kwargs.vllm",
                                    f"vLLM {vllm.__version__}'s engine (EngineArgs)")
    if cfg.cudagraph_capture_sizes is not None:
        compilation = dict(extra.get("compilation_config") or {})
        compilation["cudagraph_capture_sizes"] = [int(x) for x in cfg.cudagraph_capture_sizes]
        extra["compilation_config"] = compilation
    length = model_len(cfg)
    memory, _ = launch.memory_kwargs(cfg.gpu_memory_utilization, device,
                                     read_hf_config(model_path), getattr(torch, dtype_name),
                                     cfg.max_num_seqs, length, cfg.tensor_model_parallel_size)
    try:
        backend = launch.executor_backend(cfg.tensor_model_parallel_size)
    except ValueError as err:
        raise UserInputError(str(err).replace("actor_rollout_ref.rollout", KEY)) from None
    kwargs = {
        "dtype": dtype_name, "tensor_parallel_size": cfg.tensor_model_parallel_size,
        "distributed_executor_backend": backend, "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": length, "max_num_batched_tokens": max(cfg.max_num_batched_tokens, length),
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "enable_prefix_caching": cfg.enable_prefix_caching, "enforce_eager": cfg.enforce_eager,
        "load_format": cfg.load_format, "disable_log_stats": cfg.disable_log_stats,
        "seed": int(seed), **memory, **extra}
    return {"model_path": model_path, "tokenizer": tokenizer_path, "sleep_mode": False,
            "engine_kwargs": kwargs}


def engine_name(engine: Any) -> str:
    """A short name of an engine for messages ("vllm", "torch", or its class name)."""
    cls = type(engine).__name__
    return {"VLLMEngine": "vllm", "TorchRolloutEngine": "torch"}.get(cls, cls)
