"""AdamW, the LR schedule of the project config, and gradient clipping over DTensor shards and
pipeline stages.

The settings and the LR schedule are shared with the megatron backend
(`megarl.backends.optim_settings`).
Weight decay applies to every parameter (``torch.optim.AdamW(model.parameters())``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megarl.backends.optim_settings import OptimSettings
from megarl.errors import UserInputError

__all__ = [
    "OptimSettings", "align_grad_placements", "build_optimizer", "clip_grads_", "set_lr",
    "total_grad_norm",
]


def check_torch_optim(s: OptimSettings) -> OptimSettings:
    """``s``, refused (naming its key) when it carries megatron-core optimizer fields
    (``override_optimizer_config``): the torch backend's optimizer is torch.optim.AdamW."""
    if s.override_optimizer_config:
        raise UserInputError(
            f"{s.override_key}={s.override_optimizer_config!r}: megatron-core optimizer fields, "
            "read by strategy megatron only; the torch backend's optimizer is "
            "torch.optim.AdamW (set optim.lr, betas, eps, weight_decay), or use strategy: "
            "megatron")
    return s


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
