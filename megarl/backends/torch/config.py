"""A role's settings (`megarl.backends.settings.RoleSettings`) -> `TorchBackend` keyword
arguments: the shared ones plus what only this backend reads (the FSDP shard group and Ulysses
sizes and the parameter dtype (``param_dtype``, `precision`; the reference: the actor's) of the
role's ``parallel`` block, the device: auto = this rank's CUDA device, else CPU), the actor's
LoRA adapters (``lora``). ``virtual_pipeline_model_parallel_size`` is refused (megatron
only)."""

from __future__ import annotations

from typing import Any

from megarl.backends.settings import RoleSettings
from megarl.backends.torch.optim import check_torch_optim
from megarl.errors import UserInputError
from megarl.utils.dist import resolve_device

_PARALLEL_KEYS = {"critic": "critic.parallel", "prm": "reward_model.parallel"}


def backend_kwargs(s: RoleSettings) -> tuple[str, dict[str, Any]]:
    """(model path, keyword arguments of `TorchBackend`) for the role of ``s``."""
    role = s.role
    kw = {"seed": s.seed, "device": resolve_device(s.device), "dtype": s.dtype,
          **_layout(s), **_micro(s), "use_fused_kernels": s.kernels.fused,
          "kernel_impl": s.kernels.impl, "chunk_size": s.kernels.chunk_size,
          "activation_checkpointing": s.activation_checkpointing,
          "param_dtype": s.param_dtype}
    if s.optim is not None:
        kw["optim"] = check_torch_optim(s.optim)
    if s.megatron is not None and getattr(s.megatron, "use_dist_checkpointing", False) and (
            role != "prm"):
        m = "critic" if role == "critic" else "actor_rollout_ref.actor"
        raise UserInputError(
            f"{m}.megatron.use_dist_checkpointing=true: megatron-core dist checkpoints are read "
            "by strategy megatron only; the torch backend loads model.path's safetensors "
            "(use strategy: megatron, or an HF folder of the weights)")
    if s.override_config:  # verl's HF config overrides (`megarl.models.overrides`)
        kw["hf_overrides"] = s.override_config
    if role == "actor":
        kw["router_replay"] = s.router_replay
        kw["lora"] = s.lora
    return s.model_path, kw


def _layout(s: RoleSettings) -> dict[str, Any]:
    par = s.parallel
    if par.vpp not in (None, 1):
        key = _PARALLEL_KEYS.get(s.role, "actor_rollout_ref.actor.parallel")
        raise UserInputError(
            f"{key}.virtual_pipeline_model_parallel_size is not supported by the torch "
            "backend (strategy: torch); leave it null or use strategy: megatron"
        )
    return {"tp": par.tp, "pp": par.pp, "sp": par.sp, "dp_shard": par.dp_shard,
            "ulysses": par.ulysses}


def _micro(s: RoleSettings) -> dict[str, Any]:
    if s.micro.dynamic:
        return {"forward_max_tokens": s.micro.max_tokens, "forward_micro_batch_size": None}
    return {"forward_max_tokens": None, "forward_micro_batch_size": s.micro.rows}
