"""The typed config of a megarl run: one dataclass per section, nested as verl's YAML.

``Config`` is the top level. Sections of ``actor_rollout_ref`` live in ``schema_actor``, critic
and rewards in ``schema_reward``; everything is re-exported here. Units: ``*_batch_size`` of
data/actor/critic counts PROMPTS, ``*_micro_batch_size_per_gpu`` counts RESPONSES per rank,
``*_length`` and ``*_token_len_*`` count TOKENS. A ``None`` documented as "= X" is filled with X
by ``load_config`` (so a loaded config holds the values that will be used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.schema_actor import (
    ActorConfig,
    ActorRolloutRefConfig,
    CheckpointConfig,
    FusedKernelOptions,
    KLKind,
    MegatronConfig,
    ModelConfig,
    MultiTurnConfig,
    OptimConfig,
    ParallelConfig,
    PolicyLossConfig,
    RefConfig,
    RolloutConfig,
    SamplingConfig,
    aliased,
)
from megarl.config.schema_reward import (
    CriticConfig,
    CriticModelConfig,
    CustomRewardFunctionConfig,
    OverlongBufferConfig,
    RayPoolConfig,
    RewardModelConfig,
    RewardModelModelConfig,
)


@dataclass
class CustomDatasetConfig:
    """``data.custom_cls``: a user's ``torch.utils.data.Dataset`` class whose items are rows in
    verl's format (megarl.data.extern), instead of reading ``train_files`` / ``val_files``."""

    path: str | None = None  # pkg://<module> or a .py file; None = read the data files
    name: str | None = None  # the class's name in that module


@dataclass
class DataSamplerConfig:
    """``data.sampler``: a user's sampler class (verl's AbstractSampler; with ``update(batch)``
    a curriculum sampler) that orders the training prompts (megarl.data.extern)."""

    class_path: str | None = None  # pkg://<module> or a .py file; None = megarl's own shuffle
    class_name: str | None = None


@dataclass
class DataConfig:
    """``data``: prompt datasets (parquet/jsonl rows in verl's format)."""

    train_files: str | list[str] | None = None  # required
    val_files: str | list[str] | None = None  # None = no validation
    prompt_key: str = "prompt"  # column holding the prompt (chat messages or text)
    train_batch_size: int = 1024  # PROMPTS per training step (x rollout.n responses)
    # PROMPTS generated per round of DAPO's dynamic sampling (algorithm.filter_groups); rounds
    # go on until train_batch_size groups are kept. None = train_batch_size
    gen_batch_size: int | None = None
    val_batch_size: int | None = None  # PROMPTS per validation batch; None = the whole set
    max_prompt_length: int = 512  # TOKENS, after the chat template
    max_response_length: int = 512  # TOKENS generated at most per response
    # megarl default true (verl: false): drop prompts longer than max_prompt_length at load
    filter_overlong_prompts: bool = True
    # a prompt still too long: "error" | cut on the "left" / "right" | "filter" it out
    truncation: Literal["error", "left", "right", "filter"] = "error"
    shuffle: bool = True
    seed: int | None = 42  # shuffling seed; None = trainer.seed (verl's null)
    chat_template: str | None = None  # Jinja template; None = the tokenizer's own
    apply_chat_template: bool = True  # false: the prompt text is tokenized as is
    # extra variables for the chat template (verl's spelling), e.g. {enable_thinking: false}
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    dataloader_num_workers: int = 0  # megarl default 0 (verl: 8); CPU cores are scarce
    # a malformed row: "error" stops at load naming file, row and field; "skip" drops it
    # (counted in data/num_bad_rows)
    on_bad_row: Literal["error", "skip"] = "error"
    custom_cls: CustomDatasetConfig = field(default_factory=CustomDatasetConfig)
    sampler: DataSamplerConfig = field(default_factory=DataSamplerConfig)


@dataclass
class KLCtrlConfig:
    """KL-in-reward coefficient controller (algorithm.use_kl_in_reward)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001  # initial (fixed: constant) beta
    horizon: int = 10000  # adaptive: responses over which beta adapts
    target_kl: float = 0.1  # adaptive: the KL aimed at


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose ``metric`` is equal for all their responses and
    generate more batches until train_batch_size groups remain."""

    enable: bool = False
    # verl also names acc / seq_reward / seq_final_reward; only score is implemented (validate.py)
    # verl 0.9's default spelling "reward" is the score
    metric: Literal["score", "acc", "seq_reward", "seq_final_reward"] = aliased(
        "score", {"reward": "score"})
    # generation rounds per step at most (then train on the groups kept, at least one);
    # <= 0 = until train_batch_size groups are kept (an error after one pass over the prompts)
    max_num_gen_batches: int = 0


@dataclass
class PureConfig:
    """Options of PURE's main-branch advantage pipeline (adv_estimator: pure_rloo)."""

    mask_separator: bool = True  # zero the advantage at step-end tokens
    # replay-buffer style whitening of the advantages (PURE's algorithm.adv_norm is read here)
    normalize: bool = True


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction`` (verl's names): truncated importance sampling on the
    gap between the engine's sampling logprobs and the trainer's recomputed old logprobs
    (`megarl.algos.compute_rollout_is_weights`); the weights multiply each token's policy loss.
    Rejection sampling (`megarl.algos.compute_rollout_rejection_mask`) and bypass mode as verl
    (`megarl.trainer.correction`)."""

    # null = off; token: w_t = pi_old/mu per token; sequence: the product over the response
    rollout_is: Literal["token", "sequence"] | None = None
    # upper truncation of the weights (> 0); null is accepted while rollout_is is null (verl's
    # scripts that switch IS off write both)
    rollout_is_threshold: float | None = 2.0
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    # rejection sampling: comma-separated options of megarl.algos.ROLLOUT_RS_OPTIONS (token_k1,
    # seq_sum_k1, seq_mean_k3, seq_max_k2, ...); tokens / responses whose statistic of the
    # pi_old/mu log-ratio is out of bounds leave the actor's and the critic's loss. null = off
    rollout_rs: str | None = None
    # one bound per option or one for all: "lower_upper" or one upper (lower = 1/upper) for k1
    # options, one upper for k2/k3 (verl: no default; required with rollout_rs)
    rollout_rs_threshold: float | str | None = None
    # true: the ratio is taken against the engine's sampling logprobs (no recomputed
    # old_logprob unless something else reads it; megarl.trainer.correction)
    bypass_mode: bool = False
    # with bypass_mode: ppo_clip keeps actor.policy_loss.loss_mode (verl: always vanilla);
    # reinforce trains with loss_mode=reinforce (IS weights applied when rollout_is is set)
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"


@dataclass
class CustomAlgorithmsConfig:
    """``algorithm.custom_algorithms``: the user's own estimators and losses
    (``megarl.config.algorithms``)."""

    # a .py file imported before the config's algorithm names are checked and the run is built:
    # what it registers (@register_advantage_estimator, @register_policy_loss from megarl.algos)
    # can be chosen as algorithm.adv_estimator / actor.policy_loss.loss_mode. null = none
    path: str | None = None
    # the settings of the file's own Algorithm entries (@register_algorithm): any mapping, handed
    # to them as AlgorithmSettings.options (megarl.trainer.algorithm); megarl reads none of it
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    """``algorithm``: advantage estimation and KL in the reward."""

    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE lambda
    # a name of megarl.algos.estimator_names() (gae, grpo, rloo, ..., pure_rloo: PURE's
    # main-branch pipeline) or one registered by custom_algorithms.path
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True  # false = Dr.GRPO (no std division)
    use_kl_in_reward: bool = False  # reward -= beta * KL(actor || ref) per token
    kl_penalty: KLKind = "kl"  # estimator of the KL in the reward
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    pure: PureConfig = field(default_factory=PureConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    custom_algorithms: CustomAlgorithmsConfig = field(default_factory=CustomAlgorithmsConfig)


@dataclass
class PacsConfig:
    """``pacs``: PACS (RL as supervised BCE). PACS's own spelling ``actor_rollout_ref.pacs.*``
    is read as ``pacs.*``. With enable, the actor is trained with the PACS loss (no critic)."""

    enable: bool = False
    beta: float = 1.0  # scale of the policy-improvement reward proxy
    reward_method: Literal["1", "2"] = "1"  # 1: beta*sum(logp - old); 2: beta*mean(logp)
    adv_estimator: Literal["rloo", "grpo", "naive"] = "rloo"  # on the reward proxy, per group
    use_weight: bool = True  # class-balancing sample weights
    weight_mode: Literal["question", "only_positive", "only_negative"] = "question"
    norm_adv_by_std_in_grpo: bool = True  # for pacs.adv_estimator grpo


@dataclass
class TrainerConfig:
    """``trainer``: the loop, logging, checkpoints. Frequencies count training STEPS."""

    project_name: str = "megarl"
    experiment_name: str = "run"
    total_epochs: int = 30  # passes over data.train_files (verl: used iff no total_training_steps)
    # set = the run's length whatever total_epochs says (verl's rule); None = total_epochs x
    # steps per epoch. A recipe's value wins over total_epochs: set it to null to count epochs
    total_training_steps: int | None = None
    # a plain string (logger=console) is read as a one-element list, as verl does
    logger: list[Literal["console", "tensorboard", "jsonl", "wandb", "mlflow", "swanlab"]] = field(
        default_factory=lambda: ["console", "jsonl"]
    )
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    save_freq: int = -1  # save every N steps and at the end; -1 = never
    test_freq: int = -1  # validate every N steps and at the end; -1 = never
    val_before_train: bool = True
    val_only: bool = False  # validate once and exit
    log_val_generations: int = 0  # validation generations printed (console) per validation
    rollout_data_dir: str | None = None  # write each step's generations to {dir}/{step}.jsonl
    validation_data_dir: str | None = None  # each validation's generations to {dir}/{step}.jsonl
    # "auto": latest checkpoint in default_local_dir if any | "force": the same, accepting
    # settings that change the run's meaning (megarl.trainer.resume_config) | "disable" | a path.
    # verl's resume_mode / resume_from_path are read into this key.
    resume: str = "auto"
    max_ckpt_to_keep: int | None = None  # None = keep all
    seed: int = 42  # model init / sampling / dropout seed
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    nnodes: int | None = None  # None = launch.nnodes (kept in sync with it)
    n_gpus_per_node: int | None = None  # None = launch.nproc_per_node (kept in sync with it)
    export_hf: bool = True  # also write an HF folder (config + safetensors) at each save
    critic_warmup: int = 0  # steps that train only the critic before the actor starts
    # DP ranks get similar token counts (megarl always balances; false is announced at start)
    balance_batch: bool = True


@dataclass
class LaunchConfig:
    """``launch``: how torchrun / the multi-node launcher starts the ranks."""

    nnodes: int = 1
    nproc_per_node: int = 1  # ranks per node (one per GPU; CPU: processes)
    node_rank: int | None = None  # None = from the environment (SLURM_NODEID, ...)
    rdzv_endpoint: str | None = None  # host:port of the rendezvous; None = single node, standalone
    rdzv_backend: str = "c10d"
    master_port: int = 29500
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on GPU, gloo on CPU
    run_id: str | None = None  # rendezvous id; None = derived from the experiment name
    log_dir: str | None = None  # per-rank logs; None = <trainer.default_local_dir>/logs
    hosts: list[str] = field(default_factory=list)  # node hostnames for the launcher (SSH)


@dataclass
class AsyncTrainingConfig:
    """``async_training`` (verl's one-step-off-policy / fully-async recipes). Colocated
    (``actor_rollout_ref.hybrid_engine=true``): the engine runs in its own process and generates
    the next batches while the trainer trains. Disaggregated (``hybrid_engine=false``): rollout
    workers of their own generate continuously (docs/design.md, "Disaggregated, fully
    asynchronous RL")."""

    # colocated: whole steps a batch may lag the trainer's weights: 0 = the synchronous loop
    # (exactly), 1 = one-step off-policy (batch k+1 sampled with the weights after step k-1
    # while step k trains). Disaggregated (verl's meaning): the share of extra prompts the
    # workers may generate ahead of a sync window, up to window x (1 + threshold) prompts
    staleness_threshold: int | float = 0
    # PPO ratio against the engine's sampling logprobs (the behaviour policy); false: against
    # the trainer's recomputation with its weights before the update, and only
    # algorithm.rollout_correction.rollout_is then corrects for the behaviour policy (decoupled
    # PPO); with it null nothing does (a startup notice says so)
    use_rollout_log_probs: bool = True
    # CPUs of the engine processes (local rank r's engine, or rollout worker r:
    # engine_cpus[r % len]); [] = inherit
    engine_cpus: list[int] = field(default_factory=list)
    # seconds the trainer waits on its engine process or a rollout worker hearing nothing from
    # it (a generation, the engine's start-up) before the run fails naming it
    engine_timeout_s: float = 1800.0
    # disaggregated: a learner step trains on ppo_mini_batch_size x require_batches prompts
    # (all their n samples back)
    require_batches: int = 1
    # disaggregated: new weights go to the rollout workers every this many learner steps
    trigger_parameter_sync_step: int = 1
    # disaggregated: requests in flight at a sync go on under the new weights, their KV cache
    # recomputed, each token carrying the version that sampled it; false (the default) lets
    # them finish on the weights they started with
    partial_rollout: bool = False


@dataclass
class RolloutWorkersConfig:
    """``rollout`` (verl's fully-async recipe): the rollout workers' own devices, used when
    ``actor_rollout_ref.hybrid_engine=false``."""

    nnodes: int = 0  # nodes of rollout workers (0: none; colocated rollouts)
    n_gpus_per_node: int = 0  # rollout workers per node (one engine each; CPU: processes)
    # after each weight sync every worker reports a sha256 of each tensor its engine holds,
    # compared with what the trainer sent; a mismatch fails the run naming the tensor
    check_weight_digest: bool = False
    # the run's length in prompts handed to the workers (verl's fully-async recipe; one rollout
    # step is one prompt): total_rollout_steps // (ppo_mini_batch_size x require_batches)
    # learner steps, unless trainer.total_training_steps is set; None: trainer.total_epochs
    total_rollout_steps: int | None = None


@dataclass
class Config:
    """A whole run. Load with ``megarl.config.load_config``."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    pacs: PacsConfig = field(default_factory=PacsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    rollout: RolloutWorkersConfig = field(default_factory=RolloutWorkersConfig)


__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CheckpointConfig",
    "Config",
    "CriticConfig",
    "CriticModelConfig",
    "CustomAlgorithmsConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "FusedKernelOptions",
    "KLCtrlConfig",
    "LaunchConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PacsConfig",
    "ParallelConfig",
    "PolicyLossConfig",
    "PureConfig",
    "RayPoolConfig",
    "RefConfig",
    "RewardModelConfig",
    "RolloutWorkersConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SamplingConfig",
    "TrainerConfig",
]
