"""AdamW through megatron's optimizer (DistributedOptimizer = ZeRO-1 over DP), the LR schedule of
the project config, and one optimizer step that skips on a non-finite grad norm.

The settings and the LR schedule (`OptimSettings.lr_at`) are shared with the torch backend
(`megarl.backends.optim_settings`); a skipped step (non-finite grad norm) does not advance it.
Weight decay applies to every parameter (as ``torch.optim.AdamW(model.parameters())``, the
torch backend and verl's FSDP path), not megatron's default of skipping biases and norms.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megarl.backends.megatron import cpu_compat
from megarl.backends.optim_settings import OptimSettings

__all__ = ["OptimSettings", "build_optimizer", "optimizer_step", "set_lr"]


def build_optimizer(chunks: list, settings: OptimSettings, *, bf16: bool, distributed: bool):
    """megatron's (Distributed)Optimizer over the DDP-wrapped chunks: Adam with decoupled weight
    decay (= AdamW), fp32 main params and grads."""
    config = OptimizerConfig(
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
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        # config_overrides={} : weight decay on every parameter (see module docstring).
        return get_megatron_optimizer(config, chunks, config_overrides={})


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
