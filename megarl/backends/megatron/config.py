"""Project config -> `MegatronBackend` keyword arguments, per role: the shared settings of
`megarl.backends.settings` plus the role's ``megatron`` block (critic: its own; actor, ref and
prm: the actor's), which only this backend reads:

    param_dtype             the dtype of actor / ref / critic (None = the model's dtype); the
                            PRM computes in reward_model.model.dtype
    recompute_granularity   full | selective (+ recompute_method, recompute_num_layers); unset:
                            full when the role's model.enable_gradient_checkpointing
    use_distributed_optimizer, expert_model_parallel_size, expert_tensor_parallel_size,
    moe_aux_loss_coeff      (trainable roles only)

No-grad micro-batches: the role's micro size when its dynamic batching is off, else None (the
DP share in ``pp`` pieces: this backend has no token budget).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.backends.settings import role_settings


def backend_kwargs(role: str, cfg: Any, model_path: str | None = None
                   ) -> tuple[str, dict[str, Any]]:
    """(model path, keyword arguments of `MegatronBackend`) for ``role``."""
    s = role_settings(role, cfg, model_path)
    mega, par = s.megatron, s.parallel
    recompute: dict[str, Any] | str | None = None
    if mega.recompute_granularity:
        recompute = {"granularity": mega.recompute_granularity,
                     "method": mega.recompute_method, "num_layers": mega.recompute_num_layers}
    elif s.activation_checkpointing:
        recompute = "full"
    dtype = s.dtype if role == "prm" else (mega.param_dtype or s.dtype)
    return s.model_path, {
        "tp": par.tp, "pp": par.pp, "vpp": par.vpp, "sp": par.sp,
        "ep": int(mega.expert_model_parallel_size or 1),
        "etp": mega.expert_tensor_parallel_size,
        "dtype": dtype,
        "optim_config": s.optim,
        "use_distributed_optimizer": mega.use_distributed_optimizer is not False,
        "recompute": recompute,
        "seed": s.seed,
        "use_fused_kernels": s.kernels.fused,
        "forward_micro_batch_size": None if s.micro.dynamic else s.micro.rows,
        "moe_aux_loss_coeff": float(mega.moe_aux_loss_coeff or 0.0) if s.trainable else 0.0,
        "router_replay": s.router_replay,
    }


def recompute_settings(recompute: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """megatron's TransformerConfig recompute fields from None | "full" | "selective" |
    {granularity, method, num_layers, modules} (full recompute: uniform, one layer per chunk
    unless given)."""
    if recompute is None or recompute is False:
        return None
    if isinstance(recompute, str):
        if recompute == "full":
            return {"granularity": "full", "method": "uniform", "num_layers": 1}
        if recompute == "selective":
            return {"granularity": "selective"}
        raise ValueError(f"recompute must be None, 'full', 'selective' or a dict, got {recompute!r}")
    out = {k: v for k, v in dict(recompute).items() if v is not None}
    if out.get("granularity") == "full":
        out.setdefault("method", "uniform")
        out.setdefault("num_layers", 1)
    return out
