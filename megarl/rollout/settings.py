"""What a run's rollout engine is built from (`RolloutSettings`), the same for every engine.

Made once from the project config where the run is built
(`megarl.trainer.settings.rollout_settings`: ``actor_rollout_ref.rollout`` and what the engine
shares with the model, the data and the trainer); each engine class reads the fields it needs
(`megarl.rollout.build` maps ``name`` to the class).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RolloutSettings:
    """One run's rollout engine.

    name: torch | vllm | sglang (``actor_rollout_ref.rollout.name``).
    dtype: the config's dtype name of the engine's model (``actor_rollout_ref.model.dtype``).
    tokenizer_path: ``actor_rollout_ref.model.tokenizer_path`` (None: the model's folder).
    max_model_len: tokens of a prompt and its response
        (``data.max_prompt_length + data.max_response_length``).
    seed: the engine's sampling seed (``rollout.seed``, else ``trainer.seed``).
    device: ``trainer.device`` (auto | cpu | cuda).
    engine_kwargs: the user's extra engine arguments per engine
        (``rollout.engine_kwargs.{vllm, sglang}``), checked by each engine.
    bucket_bytes: bytes per weight-update bucket (``rollout.update_weights_bucket_megabytes``).
    routed_experts: the engine records each token's experts (``router_replay.mode`` R3).
    expert_parallel_size: 1, or tensor_model_parallel_size: the engine's ranks split the experts
        between them (vLLM's enable_expert_parallel, SGLang's ep_size).
    The rest are ``actor_rollout_ref.rollout``'s keys of the same names (``free_cache_engine``:
    the engine sleeps between generations) and ``actor_rollout_ref.model``'s
    (``override_config``: verl's HF config overrides).
    """

    name: str
    dtype: str
    max_model_len: int
    seed: int
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)
    tensor_model_parallel_size: int = 1
    expert_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1024
    max_num_batched_tokens: int | None = 8192
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    free_cache_engine: bool = True
    device: str = "auto"
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    bucket_bytes: int = 512 * 2**20
    routed_experts: bool = False

    def user_engine_kwargs(self, engine: str) -> dict[str, Any]:
        """The user's extra arguments of ``engine`` (empty when unset)."""
        return dict(self.engine_kwargs.get(engine) or {})
