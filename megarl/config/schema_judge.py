"""Schema of ``reward_model.rollout``: the inference engine that serves a generative judge.

verl's ``reward_model.use_reward_loop=True`` with ``reward_model.rollout.*`` serves the reward
model (``reward_model.model.path``) with an inference engine; megarl's judge
(`megarl.judge.judge`) renders a prompt from the question and the response, generates a
verdict with that engine and parses it into a score. The keys below keep verl's names
(``verl/trainer/config/reward_model/dp_reward_loop.yaml``) where verl has them; the judge's
own keys (template, sampling, parser, timeout) come after. Units: ``*_length`` in TOKENS,
``timeout_s`` in seconds.

Defaults differ from verl's in two places, both for a judge served in the trainer's own
process: ``tensor_model_parallel_size`` is 1 (verl: 2, one engine spanning two GPUs) and
``temperature`` is 0.0 (greedy: a judge's verdict should not depend on sampling noise).
``free_cache_engine`` is accepted but the judge's engine stays resident: vLLM's deep sleep drops
the weights, and only a weight sync (which a frozen judge never gets) would bring them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.schema_actor import aliased
from megarl.utils.dtypes import DTYPE_ALIASES, Dtype

# how a verdict is read (megarl.judge.parse)
ScoreParse = Literal["boxed", "score", "yes_no"]


@dataclass
class JudgeRolloutConfig:
    """``reward_model.rollout``: the judge's engine, its sampling, template and parser."""

    # --- verl's reward_model.rollout keys
    # engine: vllm | torch (megarl's own); sglang is refused (no judge on it yet); None = no
    # judge (verl's ``???``: required once reward_model.use_reward_loop is on)
    name: Literal["vllm", "torch", "sglang"] | None = None
    dtype: Dtype = aliased("bf16", DTYPE_ALIASES)  # judge weights
    gpu_memory_utilization: float = 0.5  # vLLM's share of the device (CPU: KV-cache cap share)
    enforce_eager: bool = True  # vLLM: no torch.compile / CUDA graphs
    free_cache_engine: bool = True  # verl's; the judge engine stays resident (see above)
    tensor_model_parallel_size: int = 1  # vLLM TP of the judge engine (verl default 2)
    max_num_batched_tokens: int = 8192  # vLLM: tokens per engine step
    max_model_len: int | None = None  # None = prompt_length + response_length
    max_num_seqs: int = 1024  # sequences decoded at once
    enable_chunked_prefill: bool = True  # vLLM (turned off on CPU, see rollout.vllm.launch)
    enable_prefix_caching: bool = True  # vLLM: reuse the template's shared prefix
    # more engine arguments, verl's layout: {vllm: {...}} reaches vllm.LLM (checked against
    # vLLM's EngineArgs); other engines' sections are not read
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    cudagraph_capture_sizes: list[int] | None = None  # vLLM: CUDA-graph batch sizes; None = vLLM's
    load_format: str = "auto"  # vLLM's load_format; the torch engine reads safetensors (auto)
    disable_log_stats: bool = True  # vLLM: no periodic stats lines
    data_parallel_size: int = 1  # verl's; 1 only (one judge engine per process)
    expert_parallel_size: int = 1  # verl's; 1 only
    skip_tokenizer_init: bool = False  # verl's; false only (the judge decodes its verdicts)
    limit_images: int | None = None  # verl's; null only (a text judge)
    prompt_length: int = 2048  # TOKENS of a rendered judge prompt at most (longer: not judged)
    response_length: int = 2048  # TOKENS of a verdict at most (the generation's max_tokens)
    # --- sampling of the verdict
    temperature: float = 0.0  # 0 = greedy
    do_sample: bool = True  # false = greedy whatever the temperature
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None  # sampling seed (temperature > 0); None = trainer.seed
    # --- the judge's own keys
    # judge prompt: None = the built-in template (megarl.judge.template.DEFAULT_TEMPLATE);
    # a string containing "{response}" is the template itself, anything else is a file path
    # holding one. Fields: {prompt}, {response}, {ground_truth}; "{{" / "}}" are literal braces
    template: str | None = None
    apply_chat_template: bool = True  # wrap the rendered prompt as one user turn of the judge
    # how a verdict becomes a score: boxed = the last \boxed{number}; score = a last line
    # "Score: number"; yes_no = the last [[YES]] (1.0) or [[NO]] (0.0). Unparsed -> 0.0
    score_parse: ScoreParse = "boxed"
    score_min: float | None = None  # a parsed score below it counts as unparsed; None = no bound
    score_max: float | None = None  # a parsed score above it counts as unparsed; None = no bound
    timeout_s: float = 600.0  # seconds one scoring call (a whole batch) may take


def judge_enabled(rm: Any) -> bool:
    """Whether ``rm`` (a ``reward_model`` section) serves a generative judge: verl's
    ``use_reward_loop`` on and ``rollout.name`` set. ``enable`` then means the judge."""
    rollout = getattr(rm, "rollout", None)
    return bool(getattr(rm, "use_reward_loop", False)) and getattr(rollout, "name", None) is not None
