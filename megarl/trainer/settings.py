"""Project config -> the typed settings the run's parts take, made once where the run is built:
each training role's (`role_settings` -> `megarl.backends.settings.RoleSettings`), the rollout
engine's (`rollout_settings` -> `megarl.rollout.settings.RolloutSettings`) and the algorithm's
(`algorithm_settings` -> `megarl.trainer.algorithm.AlgorithmSettings`).

Sections read per role (``model`` is ``actor_rollout_ref.model``):

    actor  model.{path, dtype, enable_gradient_checkpointing}, actor_rollout_ref.actor.{parallel,
           megatron, optim, grad_clip, router_replay.mode (R3: router_replay)}; no-grad
           micro-batching from actor_rollout_ref.rollout.log_prob_*
    ref    the actor's model, parallel and megatron blocks, no optimizer; micro-batching from
           actor_rollout_ref.ref.log_prob_* (None = the rollout's)
    critic critic.{model, parallel, megatron, optim, grad_clip} (model.path / dtype None = the
           actor's); no-grad micro-batching from critic.ppo_* / use_dynamic_bsz
    prm    reward_model.{model, parallel}; micro-batching from reward_model.*; the actor's megatron
           block (megatron's expert layout is one per process)
    every  seed = trainer.seed; kernels = model.use_fused_kernels / fused_kernel_options (the LM
           head's); device = trainer.device; param_dtype = the role's parallel.param_dtype
           (read by the torch backend)
    lora   the actor's adapters: model.{lora_rank, lora_alpha, target_modules, ...} or the
           folder of model.lora_adapter_path (`lora_settings`)

Micro-batching of the no-grad passes (verl's rule, as ``load_config`` fills it): a dynamic flag
None means dynamic unless the role's micro size is given; dynamic packs by ``max_tokens`` and
ignores the micro size. Critic and PRM flags None follow the actor's. A ``*_max_token_len_per_gpu``
budget counts one GPU's tokens: where Ulysses or context parallelism splits each sequence over
S ranks, a micro-batch holds S times the budget (as verl's workers multiply it;
`micro_batch_tokens`, also used by the trainer's updates).

The backends map these onto their own constructors (`megarl.backends.torch.config`,
`megarl.backends.megatron.config`); what only one backend has (torch: FSDP shard group, Ulysses;
megatron: param_dtype, recompute, distributed optimizer, expert layout) stays there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from megarl.backends.optim_settings import OptimSettings
from megarl.backends.protocol import LM_ROLES, ROLES, TRAINABLE_ROLES
from megarl.backends.settings import (
    Kernels,
    MicroBatching,
    Parallel,
    RoleSettings,
    micro_batch_tokens,
)
from megarl.config.schema import Config
from megarl.errors import UserInputError
from megarl.models.lora import DROPOUT_POSITIONS, LORA_INITS, LoraSettings, adapter_settings
from megarl.models.overrides import override_key
from megarl.rollout.settings import RolloutSettings
from megarl.trainer.advantage import AdvantageSettings
from megarl.trainer.algorithm import AlgorithmSettings, PacsLoss, PureSettings
from megarl.trainer.losses import ActorLossSettings
from megarl.utils.dtypes import canonical_dtype
from megarl.utils.plain import plain

_PATH_KEYS = {"critic": "critic.model.path", "prm": "reward_model.model.path"}
_SECTIONS = {"critic": "critic", "prm": "reward_model"}


def role_settings(role: str, cfg: Config, model_path: str | None = None,
                  run_steps: int | None = None) -> RoleSettings:
    """The settings of ``role`` (actor | ref | critic | prm) from ``cfg`` (a `megarl.config.Config`;
    `load_config`'s output or a bare one: unfilled None keys follow the rules above).
    ``model_path`` overrides the role's ``model.path``. ``run_steps``: the run's training steps,
    the learning-rate schedule's length when ``optim.total_training_steps`` is unset
    (`schedule_length`)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    arr = cfg.actor_rollout_ref
    model, actor = arr.model, arr.actor
    if role in LM_ROLES:
        own_model, section, path = model, actor, model.path
    elif role == "critic":
        own_model, section = cfg.critic.model, cfg.critic
        path = _first(own_model.path, model.path)
    else:
        own_model, section = cfg.reward_model.model, cfg.reward_model
        path = own_model.path
    path = _first(model_path, path)
    if not path:
        key = _PATH_KEYS.get(role, "actor_rollout_ref.model.path")
        raise UserInputError(f"{key}: an HF model folder is required for the {role} backend")
    optim = None
    if role in TRAINABLE_ROLES:
        optim = _optim(section.optim, section.grad_clip,
                       f"{_SECTIONS.get(role, 'actor_rollout_ref.actor')}.optim."
                       "override_optimizer_config",
                       schedule_length(section, cfg.data.train_batch_size, run_steps))
    opts = model.fused_kernel_options
    return RoleSettings(
        role=role,
        model_path=str(path),
        dtype=canonical_dtype(_first(own_model.dtype, model.dtype), _dtype_key(role)),
        parallel=_parallel(section.parallel),
        micro=_split_budget(micro_batching(role, cfg), section.parallel),
        kernels=Kernels(fused=model.use_fused_kernels, impl=opts.impl_backend,
                        chunk_size=opts.chunk_size),
        seed=int(cfg.trainer.seed),
        optim=optim,
        activation_checkpointing=role != "prm" and bool(own_model.enable_gradient_checkpointing),
        router_replay=actor.router_replay.mode if role == "actor" else "disabled",
        megatron=cfg.critic.megatron if role == "critic" else actor.megatron,
        override_config=plain(getattr(own_model, "override_config", None)) or None,
        override_key=override_key(role),
        lora=lora_settings(cfg) if role == "actor" else None,
        device=str(cfg.trainer.device),
        param_dtype=getattr(section.parallel, "param_dtype", None),
    )


def _split_budget(micro: MicroBatching, par: Any) -> MicroBatching:
    return MicroBatching(dynamic=micro.dynamic, max_tokens=micro_batch_tokens(micro.max_tokens, par),
                         rows=micro.rows)


def micro_batching(role: str, cfg: Config) -> MicroBatching:
    """The no-grad micro-batching of ``role`` (see the module docstring)."""
    arr = cfg.actor_rollout_ref
    ro, ref, actor_dynamic = arr.rollout, arr.ref, arr.actor.use_dynamic_bsz
    if role == "actor":
        return _micro(ro.log_prob_use_dynamic_bsz, ro.log_prob_max_token_len_per_gpu,
                      ro.log_prob_micro_batch_size_per_gpu)
    if role == "ref":
        dynamic = ref.log_prob_use_dynamic_bsz
        if dynamic is None:  # the ref's own micro size means fixed rows; else the rollout's flag
            own = ref.log_prob_micro_batch_size_per_gpu is not None
            dynamic = False if own else ro.log_prob_use_dynamic_bsz
        return _micro(dynamic,
                      _first(ref.log_prob_max_token_len_per_gpu, ro.log_prob_max_token_len_per_gpu),
                      _first(ref.log_prob_micro_batch_size_per_gpu,
                             ro.log_prob_micro_batch_size_per_gpu))
    if role == "critic":
        c = cfg.critic
        return _micro(_first(c.use_dynamic_bsz, actor_dynamic), c.ppo_max_token_len_per_gpu,
                      c.ppo_micro_batch_size_per_gpu)
    if role == "prm":
        rm = cfg.reward_model
        # no row count: pack by the token budget (verl's reward loop needs none either)
        dynamic = _first(rm.use_dynamic_bsz, actor_dynamic) or rm.micro_batch_size_per_gpu is None
        return _micro(dynamic, rm.forward_max_token_len_per_gpu, rm.micro_batch_size_per_gpu)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _micro(dynamic: bool | None, max_tokens: int | None, rows: int | None) -> MicroBatching:
    return MicroBatching(dynamic=rows is None if dynamic is None else bool(dynamic),
                         max_tokens=max_tokens, rows=rows)


def schedule_length(role: Any, prompts_per_step: int, run_steps: int | None) -> int:
    """Optimizer updates the learning-rate schedule spans: ``optim.total_training_steps``, or
    when that is unset (<= 0) the run's length, so a warmup ratio or a cosine schedule needs no
    second copy of the step count. The schedule advances once per optimizer update: ppo_epochs
    x mini-batches per training step (``role``: the actor's or the critic's section). -1 when
    unset and no run length is given."""
    if role.optim.total_training_steps > 0 or run_steps is None:
        return role.optim.total_training_steps
    return run_steps * role.ppo_epochs * math.ceil(prompts_per_step / role.ppo_mini_batch_size)


def _optim(optim: Any, grad_clip: float | None, override_key: str,
           total_training_steps: int) -> OptimSettings:
    overrides = getattr(optim, "override_optimizer_config", None)
    return OptimSettings(
        override_optimizer_config=dict(overrides) if overrides else None,
        override_key=override_key,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        grad_clip=grad_clip,
        lr_scheduler_type=optim.lr_scheduler_type,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
        min_lr_ratio=optim.min_lr_ratio,
        total_training_steps=total_training_steps,
    )


def _parallel(par: Any) -> Parallel:
    return Parallel(
        tp=int(par.tensor_model_parallel_size),
        pp=int(par.pipeline_model_parallel_size),
        vpp=par.virtual_pipeline_model_parallel_size,
        sp=bool(par.sequence_parallel),
        dp_shard=int(par.data_parallel_shard),
        ulysses=int(par.ulysses_sequence_parallel_size),
        cp=int(par.context_parallel_size),
    )


def _dtype_key(role: str) -> str:
    return {"critic": "critic.model.dtype", "prm": "reward_model.model.dtype"}.get(
        role, "actor_rollout_ref.model.dtype")



def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


_M = "actor_rollout_ref.model"


def _listed(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else list(value)


def lora_settings(cfg: Config) -> LoraSettings | None:
    """The actor's LoRA adapters from ``actor_rollout_ref.model.{lora_rank, lora_alpha,
    target_modules, exclude_modules, lora_A_init_method, lora_B_init_method, lora_dropout,
    lora_dropout_position, lora_adapter_path}``; None when ``lora_rank`` is 0 and no
    ``lora_adapter_path`` is set. With ``lora_adapter_path`` the adapter folder gives rank,
    alpha and modules (`megarl.models.lora.adapter_settings`); the dropout is the run's (a
    folder's ``lora_dropout`` is how it was trained, not part of its function)."""
    m = cfg.actor_rollout_ref.model
    rank = getattr(m, "lora_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UserInputError(f"{_M}.lora_rank={rank!r}: expected a whole number >= 0 (0 = no "
                             "LoRA; e.g. 8, 16, 32, 64)")
    path = getattr(m, "lora_adapter_path", None)
    if rank == 0 and not path:
        return None
    alpha = m.lora_alpha
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise UserInputError(f"{_M}.lora_alpha={alpha!r}: expected a number > 0 (the adapters' "
                             "update is scaled by lora_alpha / lora_rank)")
    inits = {}
    for key, field_name in (("lora_A_init_method", "init_a"), ("lora_B_init_method", "init_b")):
        value = getattr(m, key, "kaiming" if field_name == "init_a" else "zero")
        if value not in LORA_INITS:
            raise UserInputError(f"{_M}.{key}={value!r}: expected one of "
                                 f"{', '.join(LORA_INITS)}")
        inits[field_name] = value
    dropout = getattr(m, "lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0):
        raise UserInputError(f"{_M}.lora_dropout={dropout!r}: expected a probability in [0, 1) "
                             "(0 = no adapter dropout; e.g. 0.05)")
    position = getattr(m, "lora_dropout_position", "pre")
    if position not in DROPOUT_POSITIONS:
        raise UserInputError(f"{_M}.lora_dropout_position={position!r}: expected one of "
                             f"{', '.join(DROPOUT_POSITIONS)} (the adapter's input or output)")
    regulariser = {"dropout": float(dropout), "dropout_position": position}
    if path:
        return replace(adapter_settings(path, rank, float(alpha)), **regulariser)
    return LoraSettings(rank=rank, alpha=float(alpha), target_modules=_listed(m.target_modules),
                        exclude_modules=_listed(m.exclude_modules), **inits, **regulariser)


def rollout_settings(cfg: Config) -> RolloutSettings:
    """The run's rollout engine (`megarl.rollout.settings.RolloutSettings` says what each field
    reads). A bucket size that is not a positive number of MiB is a UserInputError."""
    arr, ro = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    mb = ro.update_weights_bucket_megabytes
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or mb <= 0:
        raise UserInputError("actor_rollout_ref.rollout.update_weights_bucket_megabytes must be "
                             f"a positive number of MiB, got {mb!r}")
    given = getattr(ro, "engine_kwargs", None)
    engine_kwargs = {e: dict((given.get(e) if isinstance(given, Mapping) else
                              getattr(given, e, None)) or {}) for e in ("vllm", "sglang")}
    return RolloutSettings(
        name=ro.name,
        dtype=arr.model.dtype,
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        seed=ro.seed if ro.seed is not None else cfg.trainer.seed,
        tokenizer_path=arr.model.tokenizer_path,
        trust_remote_code=arr.model.trust_remote_code,
        override_config=plain(arr.model.override_config) or {},
        tensor_model_parallel_size=ro.tensor_model_parallel_size,
        expert_parallel_size=ro.expert_parallel_size,
        gpu_memory_utilization=ro.gpu_memory_utilization,
        max_num_seqs=ro.max_num_seqs,
        max_num_batched_tokens=ro.max_num_batched_tokens,
        enable_chunked_prefill=ro.enable_chunked_prefill,
        enforce_eager=ro.enforce_eager,
        free_cache_engine=ro.free_cache_engine,
        device=str(cfg.trainer.device),
        engine_kwargs=engine_kwargs,
        bucket_bytes=int(mb * 2**20),
        routed_experts=arr.actor.router_replay.mode == "R3",
    )


def algorithm_name(cfg: Config) -> str:
    """The one name that selects a run's algorithm: "pacs" under PACS's own switch
    ``pacs.enable``, else ``algorithm.adv_estimator``."""
    return "pacs" if cfg.pacs.enable else str(cfg.algorithm.adv_estimator)


def advantage_settings(cfg: Config) -> AdvantageSettings:
    """The reward placement and estimator settings of a config."""
    alg, rm = cfg.algorithm, cfg.reward_model
    return AdvantageSettings(
        estimator=alg.adv_estimator, gamma=alg.gamma, lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        use_kl_in_reward=alg.use_kl_in_reward, kl_penalty=alg.kl_penalty,
        prm_enabled=rm.enable, vr_enabled=rm.reward_manager != "blank",
        credit_assignment=rm.credit_assignment,
        verifiable_reward_coef=rm.verifiable_reward_coef)


def actor_loss_settings(cfg: Config) -> ActorLossSettings:
    """The PPO family's actor loss settings of a config."""
    arr = cfg.actor_rollout_ref
    a = arr.actor
    rc = cfg.algorithm.rollout_correction
    # verl's bypass mode with loss_type=reinforce trains REINFORCE whatever loss_mode says
    reinforce = rc.bypass_mode and rc.loss_type == "reinforce"
    return ActorLossSettings(
        loss_mode="reinforce" if reinforce else a.policy_loss.loss_mode, agg_mode=a.loss_agg_mode,
        tau_pos=a.tau_pos, tau_neg=a.tau_neg,
        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
        fused=arr.model.use_fused_kernels)


def algorithm_settings(cfg: Config) -> AlgorithmSettings:
    """Everything the algorithms read of ``cfg``: the selecting name (`algorithm_name`), the
    advantage and actor loss settings, ``algorithm.pure``, PACS's objective (``pacs.*``) and the
    user's file of algorithms."""
    p, pacs = cfg.algorithm.pure, cfg.pacs
    return AlgorithmSettings(
        name=algorithm_name(cfg), adv=advantage_settings(cfg), loss=actor_loss_settings(cfg),
        pure=PureSettings(mask_separator=p.mask_separator, normalize=p.normalize),
        pacs=PacsLoss(beta=pacs.beta, reward_method=str(pacs.reward_method),
                      adv_estimator=pacs.adv_estimator,
                      weight_mode=pacs.weight_mode if pacs.use_weight else None,
                      norm_adv_by_std=pacs.norm_adv_by_std_in_grpo),
        custom_path=cfg.algorithm.custom_algorithms.path,
        options=MappingProxyType(plain(cfg.algorithm.custom_algorithms.options)))
