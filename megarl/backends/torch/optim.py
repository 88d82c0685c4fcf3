"""AdamW, the LR schedule of the project config, and gradient clipping over DTensor shards and
pipeline stages.

LR schedule (verl's ``optim`` semantics; identical to the megatron backend's): update k
(0-based, skipped steps do not count) uses ``lr * f(k)`` with W warmup steps
(``lr_warmup_steps`` if >= 0, else ``int(lr_warmup_steps_ratio * total_training_steps)``):

- ``f(k) = k / max(1, W)`` while k < W;
- constant: 1 afterwards;
- cosine: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (k - W) / max(1, T - W))`` (T = total_training_steps).

The LR is a pure function of the update counter, so checkpoints only store that counter.
Weight decay applies to every parameter (``torch.optim.AdamW(model.parameters())``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


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


def build_optimizer(params: Iterable[torch.nn.Parameter], s: OptimSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        list(params), lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay
    )


@torch.no_grad()
def align_grad_placements(params: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements. Without FSDP (which does this
    itself), tensor parallelism leaves some gradients ``Partial`` (replicated weights fed by
    sequence- or head-sharded inputs: summed over TP here) or ``Replicate`` for a sharded
    weight (the embedding: each rank keeps its own slice here)."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def _mesh_key(t: torch.Tensor):
    return (t.device_mesh, t.placements) if isinstance(t, DTensor) else None


@torch.no_grad()
def total_grad_norm(
    params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Global L2 norm (float32 scalar, plain tensor) of all gradients: DTensor shards reduced
    over their mesh, plain (replicated) tensors counted once, summed over pipeline stages."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p.grad), []).append(p.grad)
    device = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.float().to(device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_grads_(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total + 1e-6))``."""
    coef = max_norm / (float(total) + 1e-6)
    if coef >= 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
