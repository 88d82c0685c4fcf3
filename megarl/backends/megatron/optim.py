"""AdamW through megatron's optimizer (DistributedOptimizer = ZeRO-1 over DP), the LR schedule of
the project config, and one optimizer step that skips on a non-finite grad norm.

The settings and the LR schedule (`OptimSettings.lr_at`) are shared with the torch backend
(`megarl.backends.optim_settings`); a skipped step (non-finite grad norm) does not advance it.
Weight decay applies to every parameter (as ``torch.optim.AdamW(model.parameters())``, the
torch backend and verl's FSDP path), not megatron's default of skipping biases and norms.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megarl.backends.megatron import cpu_compat
from megarl.backends.optim_settings import OptimSettings
from megarl.errors import UserInputError

__all__ = ["OptimSettings", "build_optimizer", "optimizer_config", "optimizer_step", "set_lr"]

# OptimizerConfig fields megarl sets from its own keys (an override must keep their value)
MEGARL_OPTIM_FIELDS = {
    "optimizer": "AdamW (megarl's only optimizer)",
    "lr": "optim.lr (set on every step from the schedule)",
    "min_lr": "optim.min_lr_ratio with optim.lr_scheduler_type=cosine",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.betas", "adam_beta2": "optim.betas", "adam_eps": "optim.eps",
    "decoupled_weight_decay": "AdamW (megarl's only optimizer)",
    "bf16": "the role's dtype (model.dtype, megatron.param_dtype)",
    "params_dtype": "the role's dtype (model.dtype, megatron.param_dtype)",
    "use_distributed_optimizer": "megatron.use_distributed_optimizer",
    "clip_grad": "grad_clip",
}


def optimizer_config(settings: OptimSettings, *, bf16: bool, distributed: bool
                     ) -> OptimizerConfig:
    """megatron-core's OptimizerConfig of ``settings``: Adam with decoupled weight decay
    (= AdamW), fp32 main params and grads, then the fields of
    ``settings.override_optimizer_config`` (verl's key: set on the config as verl's
    ``init_megatron_optim_config`` sets them; ``settings.override_key`` names the block in
    errors)."""
    key = settings.override_key
    base = dict(
        optimizer="adam",
        lr=settings.lr,
        min_lr=0.0,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        decoupled_weight_decay=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distributed,
        clip_grad=float(settings.grad_clip or 0.0),
    )
    base.update(optimizer_overrides(settings.override_optimizer_config, base, key))
    try:
        return OptimizerConfig(**base)
    except (AssertionError, ValueError, TypeError, ImportError) as e:
        raise UserInputError(f"{key}: megatron-core's OptimizerConfig refuses "
                             f"{settings.override_optimizer_config!r}: {e}{te_note()}") from e


def te_note() -> str:
    """A hint for megatron-core's refusals of TransformerEngine-backed features ('' when TE
    imports)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or RuntimeError from TE's empty meta package
        return (" (TransformerEngine is not installed here: megatron-core's features that "
                "need it, such as use_precision_aware_optimizer's FusedAdam or the fused "
                "kernels, fail its checks)")
    return ""


def optimizer_overrides(overrides: Mapping[str, Any] | None, base: Mapping[str, Any],
                        key: str) -> dict[str, Any]:
    """{field: value} of ``overrides`` checked against megatron-core's OptimizerConfig: a name
    it does not have, or a field megarl sets from its own keys (``base``) to another value, is
    refused (`UserInputError` naming the key and the fix)."""
    if not overrides:
        return {}
    if not isinstance(overrides, Mapping):
        raise UserInputError(f"{key}={overrides!r}: expected a mapping of megatron-core "
                             "OptimizerConfig fields, e.g. {optimizer_cpu_offload: true}")
    names = sorted(f.name for f in dataclasses.fields(OptimizerConfig) if f.init)
    out: dict[str, Any] = {}
    for name, value in overrides.items():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserInputError(
                f"{key}.{name}: megatron-core's OptimizerConfig has no field {name!r}{hint}; "
                f"its fields: {', '.join(names)}")
        if name in base and base[name] != value:
            raise UserInputError(
                f"{key}.{name}={value!r}: megarl sets {name} itself ({base[name]!r} here); "
                f"use {MEGARL_OPTIM_FIELDS.get(name, 'the optim block (optim.*)')}")
        out[name] = value
    return out


def build_optimizer(chunks: list, settings: OptimSettings, *, bf16: bool, distributed: bool):
    """megatron's (Distributed)Optimizer over the DDP-wrapped chunks from `optimizer_config`
    (with ``optimizer_cpu_offload``, megatron-core's HybridDeviceOptimizer)."""
    config = optimizer_config(settings, bf16=bf16, distributed=distributed)
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        # config_overrides={} : weight decay on every parameter (see module docstring).
        if not settings.override_optimizer_config:
            return get_megatron_optimizer(config, chunks, config_overrides={})
        try:
            return get_megatron_optimizer(config, chunks, config_overrides={})
        except (AssertionError, ValueError, TypeError, RuntimeError) as e:
            where = "" if torch.cuda.is_available() else (
                "; without CUDA, megatron-core's optimizer_cpu_offload (HybridDeviceOptimizer) "
                "does not build")
            raise UserInputError(
                f"{settings.override_key}: megatron-core could not build its optimizer with "
                f"{settings.override_optimizer_config!r} ({type(e).__name__}: {e}){where}"
            ) from e


def set_lr(optimizer, lr: float, weight_decay: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def optimizer_step(optimizer, settings: OptimSettings, step: int) -> tuple[float, bool, float]:
    """Clip and apply one update with the LR of update ``step``; returns (grad_norm, skipped,
    lr). Gradients must already be reduced (DDP / finalize_model_grads)."""
    lr = settings.lr_at(step)
    set_lr(optimizer, lr, settings.weight_decay)
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        found_inf = optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            return grad_norm, True, lr
        clip = float(settings.grad_clip or 0.0)
        if clip > 0:
            for sub in _sub_optimizers(optimizer):
                params = sub.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, clip, grad_norm)
        optimizer.step_with_ready_grads()
    return grad_norm, False, lr
