"""AdamW through megatron's optimizer (DistributedOptimizer = ZeRO-1 over DP), the LR schedule of
the project config, and one optimizer step that skips on a non-finite grad norm.

LR schedule (verl's ``optim`` semantics, as torch's LambdaLR applies them): update k (0-based)
uses ``lr * f(k)`` with W warmup steps (``lr_warmup_steps`` if >= 0, else
``int(lr_warmup_steps_ratio * total_training_steps)``):

- ``f(k) = k / max(1, W)`` while k < W;
- constant: 1 afterwards;
- cosine: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = (k - W) / max(1, T - W)`` (T = total_training_steps).

A skipped step (non-finite grad norm) does not advance the schedule.
Weight decay applies to every parameter (as ``torch.optim.AdamW(model.parameters())``, the
torch backend and verl's FSDP path), not megatron's default of skipping biases and norms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megarl.backends.megatron import cpu_compat


@dataclass
class OptimSettings:
    """Optimizer + schedule settings of one backend (the project's ``optim`` block plus
    ``grad_clip``)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0  # None or 0: no clipping
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    total_training_steps: int = -1

    @classmethod
    def coerce(cls, value: OptimSettings | Mapping[str, Any] | Any | None) -> OptimSettings:
        """From None, a mapping, or any object with (some of) these attributes."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        get = value.get if isinstance(value, Mapping) else lambda k, d: getattr(value, k, d)
        kwargs = {}
        for f in fields(cls):
            v = get(f.name, None)
            if v is None and f.name == "lr_scheduler_type":
                v = get("warmup_style", None)  # verl's older name
            if v is not None:
                kwargs[f.name] = v
        out = cls(**kwargs)
        out.betas = tuple(float(b) for b in out.betas)
        if out.lr_scheduler_type not in ("constant", "cosine"):
            raise ValueError(
                f"optim.lr_scheduler_type must be 'constant' or 'cosine', got "
                f"{out.lr_scheduler_type!r}"
            )
        return out

    def warmup_steps(self) -> int:
        if self.lr_warmup_steps is not None and self.lr_warmup_steps >= 0:
            return int(self.lr_warmup_steps)
        return int(self.lr_warmup_steps_ratio * max(self.total_training_steps, 0))

    def lr_at(self, step: int) -> float:
        """Learning rate of update ``step`` (0-based)."""
        warmup = self.warmup_steps()
        if step < warmup:
            return self.lr * step / max(1, warmup)
        if self.lr_scheduler_type == "constant":
            return self.lr
        if self.total_training_steps <= 0:
            raise ValueError(
                "optim.total_training_steps must be set (> 0) for the cosine LR schedule"
            )
        progress = min(1.0, (step - warmup) / max(1, self.total_training_steps - warmup))
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos)


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
