"""Project config -> `TorchBackend` keyword arguments, per role: the shared settings of
`megarl.backends.settings` plus what only this backend has (the FSDP shard group and Ulysses
sizes of the role's ``parallel`` block, ``trainer.device``: auto = this rank's CUDA device, else
CPU). ``virtual_pipeline_model_parallel_size`` is refused (megatron only)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from megarl.backends.settings import RoleSettings, role_settings
from megarl.errors import UserInputError
from megarl.utils.dist import resolve_device

_PARALLEL_KEYS = {"critic": "critic.parallel", "prm": "reward_model.parallel"}


def backend_kwargs(role: str, cfg: Any, model_path: str | None) -> tuple[str, dict[str, Any]]:
    """(model path, keyword arguments of `TorchBackend`) for ``role``."""
    s = role_settings(role, cfg, model_path)
    kw = {"seed": s.seed, "device": resolve_device(cfg.trainer.device), "dtype": s.dtype,
          **_layout(s), **_micro(s), "use_fused_kernels": s.kernels.fused,
          "kernel_impl": s.kernels.impl, "chunk_size": s.kernels.chunk_size,
          "activation_checkpointing": s.activation_checkpointing}
    if s.optim is not None:
        kw.update(asdict(s.optim))
    if role == "actor":
        kw["router_replay"] = s.router_replay
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
