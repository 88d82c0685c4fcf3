"""Schema of ``critic``, ``reward_model`` (PRM + reward managers + worker pool) and
``custom_reward_function``. Units as in ``schema_actor``: batch sizes in PROMPTS, micro-batch
sizes in RESPONSES, ``*_token_len_*`` in TOKENS. ``None`` documented as "= X" is filled by
``load_config``."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.schema_actor import (
    DTYPE_ALIASES,
    STRATEGY_ALIASES,
    Dtype,
    LossAggMode,
    MegatronConfig,
    OptimConfig,
    ParallelConfig,
    Strategy,
    aliased,
)
from megarl.config.schema_judge import JudgeRolloutConfig


@dataclass
class CriticModelConfig:
    path: str | None = None  # None = actor_rollout_ref.model.path (value head starts fresh)
    tokenizer_path: str | None = None  # None = the actor's tokenizer (the critic reads its ids)
    dtype: Dtype | None = aliased(None, DTYPE_ALIASES)  # None = actor_rollout_ref.model.dtype
    enable_gradient_checkpointing: bool = False


@dataclass
class CriticConfig:
    """``critic``: the value model of PPO with GAE."""

    enable: bool | None = None  # None = auto: on iff algorithm.adv_estimator == "gae"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    strategy: Strategy | None = aliased(None, STRATEGY_ALIASES)  # None = actor's
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int | None = None  # PROMPTS per optimizer step; None = actor's
    ppo_micro_batch_size_per_gpu: int | None = None  # RESPONSES per forward; iff not use_dynamic_bsz
    use_dynamic_bsz: bool | None = None  # None = actor's (verl); true wins over a micro size
    ppo_max_token_len_per_gpu: int = 32768  # TOKENS per micro-batch per rank (verl default)
    ppo_epochs: int | None = None  # None = actor's
    shuffle: bool | None = None  # None = actor's
    grad_clip: float | None = 1.0  # None or 0 = no clipping
    cliprange_value: float = 0.5  # value clipping around the old values
    loss_agg_mode: LossAggMode | None = None  # None = actor's
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class RewardModelModelConfig:
    # the reward model's HF folder; required if enabled: a *ForTokenClassification (2 labels) is
    # PURE's process reward model, a *ForSequenceClassification (1 label, no bias: Skywork-Reward,
    # FsfairX-LLaMA3-RM) an outcome reward model scoring whole responses (verl's reward model)
    path: str | None = None
    dtype: Dtype | None = aliased(None, DTYPE_ALIASES)  # None = actor_rollout_ref.model.dtype
    # which reward model path holds: auto = by its config.json architectures; prm | outcome must
    # agree with them (a conflict is an error)
    kind: Literal["auto", "prm", "outcome"] = "auto"
    # outcome RM (verl): set = always decode the responses and re-render them with the RM's own
    # chat template; None = re-render only when the RM's tokenizer (vocabulary or chat template)
    # differs from the policy's, else the RM reads the policy's token ids
    input_tokenizer: str | None = None


@dataclass
class RayPoolConfig:
    """Reward workers on a Ray cluster (pool: ray). ``None`` = the reward_model.* value."""

    address: str | None = None  # None = start or join a local Ray
    num_workers: int | None = None
    timeout_s: float | None = None
    memory_mb: int | None = None


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: responses longer than max_response_length - len lose up to
    penalty_factor, linearly in the excess length. verl main_ppo's spelling
    ``reward_model.reward_kwargs.overlong_buffer_cfg.*`` is read here."""

    enable: bool = False
    len: int = 0  # TOKENS before max_response_length where the penalty starts
    penalty_factor: float = 1.0
    log: bool = False  # also log reward/overlong_ratio (share of responses penalised)
    # TOKENS the buffer counts back from (DAPO's max_resp_len); None = data.max_response_length
    max_resp_len: int | None = None


@dataclass
class SandboxFusionConfig:
    """verl's code reward server: with ``url`` set, responses of code data sources
    (codecontests, apps, codeforces, taco) are scored by running their program on the row's
    test cases through SandboxFusion's ``/run_code`` endpoint (``megarl.rewards.sandbox_fusion``;
    each call ends within reward_model.timeout_s). verl 0.9.1's ``reward.sandbox_fusion.*`` is
    read here."""

    url: str | None = None  # the run_code endpoint, http(s)://HOST:PORT/run_code; None = off
    max_concurrent: int = 64  # requests in flight per reward worker process
    memory_limit_mb: int = 1024  # MiB each sandboxed run may use (sent as memory_limit_MB)


_KEY = "reward_model.sandbox_fusion"


def sandbox_fusion_problems(url: Any, max_concurrent: Any, memory_limit_mb: Any) -> list[str]:
    """Problems of ``reward_model.sandbox_fusion.*`` values as "key: text" lines ([] = fine).
    ``url`` None means off (then the other two are not read)."""
    if url is None:
        return []
    out = []
    parsed = urllib.parse.urlsplit(str(url))
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        out.append(f"{_KEY}.url: must be an http:// or https:// URL of a SandboxFusion run_code "
                   f"endpoint (e.g. http://HOST:8080/run_code), got {url!r}")
    if not isinstance(max_concurrent, int) or isinstance(max_concurrent, bool) or max_concurrent < 1:
        out.append(f"{_KEY}.max_concurrent: must be an int >= 1 (requests in flight per reward "
                   f"worker), got {max_concurrent!r}")
    if not isinstance(memory_limit_mb, int) or isinstance(memory_limit_mb, bool) or memory_limit_mb < 1:
        out.append(f"{_KEY}.memory_limit_mb: must be an int >= 1 (MiB per sandboxed run), got "
                   f"{memory_limit_mb!r}")
    return out


# PURE's spellings of the credit-assignment modes.
CREDIT_ALIASES = {"strict min-form": "min", "gamma-decay": "sum"}


@dataclass
class RewardModelConfig:
    """``reward_model``: the reward model (PURE's process reward model, or verl's outcome reward
    model) and how verifiable rewards are computed.

    PURE modes: VR = enable false + reward_manager prime; PRM = enable true + blank;
    PRM+VR = enable true + prime. Outcome RM (verl): enable true with a sequence classifier; its
    score is the training reward in place of the reward manager's (which is still logged).
    Generative judge (verl's GenRM): use_reward_loop true + rollout.name set; model.path is the
    judge model, ``enable`` then means the judge (no PRM / outcome RM is started) and its score
    is the training reward in place of the reward manager's, as the outcome RM's.
    """

    enable: bool = False  # run the reward model (model.kind says which kind)
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    strategy: Strategy | None = aliased(None, STRATEGY_ALIASES)  # None = actor's
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size_per_gpu: int | None = None  # RESPONSES per PRM forward; iff not use_dynamic_bsz
    use_dynamic_bsz: bool | None = None  # None = actor's (verl); true wins over a micro size
    forward_max_token_len_per_gpu: int = 32768  # TOKENS per PRM micro-batch per rank
    # TOKENS an outcome RM's re-rendered input keeps (cut at the right, as verl);
    # None = data.max_prompt_length + data.max_response_length
    max_length: int | None = None
    # naive: verifiable score as is; prime: PRIME/PURE math verifier (correct 1.0 else 0.0);
    # blank: no verifiable reward (all 0; PRM-only training)
    reward_manager: Literal["naive", "prime", "blank", "dapo"] = "naive"
    # float T > 0: approximate min-form, weights softmax(-r/T) over a response's steps;
    # "min": strict min-form (paper definition); "sum": plain summation (no transform).
    credit_assignment: float | Literal["min", "sum"] = aliased(0.1, CREDIT_ALIASES)
    verifiable_reward_coef: float = 1.0  # weight of the verifiable reward next to PRM rewards
    # text that ends a step in a response (PURE's split_step_char, which is read here). PURE's
    # own ``step_separator`` is the PRM-input token: written alone in a file or override it is
    # read as prm_step_token; next to prm_step_token (megarl's recipes, saved config.yaml) it
    # keeps this meaning (see megarl.config.aliases)
    step_separator: str = "\n\n"
    # text the PRM input puts at each step-end token (PURE: "\n"); null keeps the response as is
    prm_step_token: str | None = "\n"
    pool: Literal["local", "ray"] = "local"  # where verifiable-reward functions run
    num_workers: int = 2  # reward worker processes
    timeout_s: float = 10.0  # per-response scoring timeout, seconds (timeout -> score 0)
    memory_mb: int = 1024  # per-worker memory limit, MiB
    ray: RayPoolConfig = field(default_factory=RayPoolConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    # verl's reward loop: true with rollout.name set serves model.path as a generative judge
    # (megarl.judge.judge); true without rollout.name changes nothing
    use_reward_loop: bool = False
    rollout: JudgeRolloutConfig = field(default_factory=JudgeRolloutConfig)  # the judge's engine


@dataclass
class CustomRewardFunctionConfig:
    """A user scoring function ``name(data_source, solution_str, ground_truth, extra_info,
    **reward_kwargs) -> float | dict`` loaded from the file ``path`` (verl's signature)."""

    path: str | None = None  # None = the built-in scorer for the row's data_source
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
