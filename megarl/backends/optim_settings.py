"""The optimizer and LR-schedule settings both training backends share (verl's ``optim`` block
plus ``grad_clip``), and the schedule as a pure function of the update counter.

LR schedule (verl's ``optim`` semantics, as torch's LambdaLR applies them): update k (0-based,
skipped steps do not count) uses ``lr * f(k)`` with W warmup steps (``lr_warmup_steps`` if >= 0,
else ``int(lr_warmup_steps_ratio * total_training_steps)``):

- ``f(k) = k / max(1, W)`` while k < W;
- constant: 1 afterwards;
- cosine: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (k - W) / max(1, T - W))`` (T = total_training_steps).

Checkpoints therefore only store the update counter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class OptimSettings:
    """Optimizer + schedule settings of one backend (the config's ``optim`` block plus
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
    # megatron only: OptimizerConfig fields set on megatron-core's optimizer config (verl's
    # optim.override_optimizer_config; `megarl.backends.megatron.optim.optimizer_config`), and
    # the config key they came from (named in errors)
    override_optimizer_config: dict[str, Any] | None = None
    override_key: str = "actor_rollout_ref.actor.optim.override_optimizer_config"

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas must have two entries, got {self.betas}")
        if self.lr_scheduler_type not in ("constant", "cosine"):
            raise ValueError(
                f"optim.lr_scheduler_type must be 'constant' or 'cosine', got "
                f"{self.lr_scheduler_type!r}"
            )
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")

    @classmethod
    def coerce(cls, value: OptimSettings | Mapping[str, Any] | Any | None) -> OptimSettings:
        """From None, a mapping, or any object with (some of) these attributes."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        get = value.get if isinstance(value, Mapping) else lambda k, d: getattr(value, k, d)
        kwargs = {f.name: get(f.name, None) for f in fields(cls)}
        if kwargs["lr_scheduler_type"] is None:
            kwargs["lr_scheduler_type"] = get("warmup_style", None)  # verl's older name
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "grad_clip"})

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
