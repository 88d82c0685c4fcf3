"""Project config -> `TorchBackend` keyword arguments, per role.

    actor  actor_rollout_ref.model (dtype, enable_gradient_checkpointing, use_fused_kernels,
           fused_kernel_options), actor_rollout_ref.actor.{parallel, optim, grad_clip,
           router_replay.mode (R3: router_replay=True)};
           no-grad micro-batching from actor_rollout_ref.rollout.log_prob_*
    ref    the actor's model and parallel settings, no optimizer; micro-batching from
           actor_rollout_ref.ref.log_prob_* (None = the rollout's)
    critic critic.{model, optim, parallel, grad_clip} (model.dtype None = the actor's);
           no-grad micro-batching from critic.ppo_* / use_dynamic_bsz
    prm    reward_model.{model, parallel}; micro-batching from reward_model.*
seed = trainer.seed, device = trainer.device (auto: this rank's CUDA device, else CPU).
"""

from __future__ import annotations

from typing import Any

from megarl.utils.dist import resolve_device


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _optim(optim: Any, grad_clip: Any) -> dict[str, Any]:
    return {
        "lr": optim.lr,
        "betas": tuple(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
        "grad_clip": grad_clip,
        "lr_scheduler_type": optim.lr_scheduler_type,
        "lr_warmup_steps": optim.lr_warmup_steps,
        "lr_warmup_steps_ratio": optim.lr_warmup_steps_ratio,
        "min_lr_ratio": optim.min_lr_ratio,
        "total_training_steps": optim.total_training_steps,
    }


def _parallel(par: Any, where: str) -> dict[str, Any]:
    if getattr(par, "virtual_pipeline_model_parallel_size", None) not in (None, 1):
        raise ValueError(
            f"{where}.virtual_pipeline_model_parallel_size is not supported by the torch "
            "backend (strategy: torch); leave it null or use strategy: megatron"
        )
    return {
        "tp": par.tensor_model_parallel_size,
        "pp": par.pipeline_model_parallel_size,
        "sp": par.sequence_parallel,
        "dp_shard": par.data_parallel_shard,
        "ulysses": par.ulysses_sequence_parallel_size,
    }


def _micro(dynamic: Any, max_tokens: Any, rows: Any) -> dict[str, Any]:
    if dynamic is False:
        return {"forward_max_tokens": None, "forward_micro_batch_size": rows}
    return {"forward_max_tokens": max_tokens, "forward_micro_batch_size": None}


def backend_kwargs(role: str, cfg: Any, model_path: str | None) -> tuple[str, dict[str, Any]]:
    """(model path, keyword arguments of `TorchBackend`) for ``role``."""
    arr = cfg.actor_rollout_ref
    model = arr.model
    kernel = {
        "use_fused_kernels": model.use_fused_kernels,
        "kernel_impl": model.fused_kernel_options.impl_backend,
        "chunk_size": model.fused_kernel_options.chunk_size,
    }
    common = {"seed": cfg.trainer.seed, "device": resolve_device(cfg.trainer.device), **kernel}
    if role in ("actor", "ref"):
        path = _first(model_path, model.path)
        kw = {
            "dtype": model.dtype,
            "activation_checkpointing": model.enable_gradient_checkpointing,
            **_parallel(arr.actor.parallel, "actor_rollout_ref.actor.parallel"),
        }
        ro = arr.rollout
        if role == "actor":
            kw.update(_optim(arr.actor.optim, arr.actor.grad_clip))
            kw["router_replay"] = arr.actor.router_replay.mode == "R3"
            kw.update(_micro(ro.log_prob_use_dynamic_bsz, ro.log_prob_max_token_len_per_gpu,
                             ro.log_prob_micro_batch_size_per_gpu))
        else:
            ref = arr.ref
            kw.update(_micro(
                _first(ref.log_prob_use_dynamic_bsz, ro.log_prob_use_dynamic_bsz),
                _first(ref.log_prob_max_token_len_per_gpu, ro.log_prob_max_token_len_per_gpu),
                _first(ref.log_prob_micro_batch_size_per_gpu, ro.log_prob_micro_batch_size_per_gpu),
            ))
    elif role == "critic":
        c = cfg.critic
        path = _first(model_path, c.model.path, model.path)
        kw = {
            "dtype": _first(c.model.dtype, model.dtype),
            "activation_checkpointing": c.model.enable_gradient_checkpointing,
            **_parallel(c.parallel, "critic.parallel"),
            **_optim(c.optim, c.grad_clip),
            **_micro(_first(c.use_dynamic_bsz, arr.actor.use_dynamic_bsz),
                     c.ppo_max_token_len_per_gpu, c.ppo_micro_batch_size_per_gpu),
        }
    elif role == "prm":
        rm = cfg.reward_model
        path = _first(model_path, rm.model.path)
        kw = {
            "dtype": _first(rm.model.dtype, model.dtype),
            **_parallel(rm.parallel, "reward_model.parallel"),
            **_micro(_first(rm.use_dynamic_bsz, arr.actor.use_dynamic_bsz),
                     rm.forward_max_token_len_per_gpu, rm.micro_batch_size_per_gpu),
        }
    else:
        raise ValueError(f"unknown role {role!r}; expected actor, ref, critic or prm")
    if path is None:
        raise ValueError(f"no model path for the {role} backend: set the config's model.path")
    return str(path), {**common, **kw}
