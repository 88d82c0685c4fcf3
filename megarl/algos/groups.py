"""Per-group statistics over `[B]` tensors, for any order of `group_index` (private helpers).

A group is the set of rows sharing a `group_index` value; rows of one group may sit anywhere in
the batch. Every function returns a `[B]` tensor holding the statistic of each row's group.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Groups(NamedTuple):
    inverse: torch.Tensor  # [B] int64, dense group id of each row (0 .. num_groups-1)
    num_groups: int
    size: torch.Tensor  # [B] int64, size of each row's group


def make_groups(group_index: torch.Tensor) -> Groups:
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    return Groups(inverse=inverse, num_groups=int(counts.numel()), size=counts[inverse])


def group_sum(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """`[B]`: sum of `x` over each row's group (differentiable)."""
    totals = torch.zeros(groups.num_groups, dtype=x.dtype, device=x.device)
    totals = totals.index_add(0, groups.inverse, x)
    return totals[groups.inverse]


def group_mean_std(x: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B]` mean and unbiased std of each row's group; a singleton group gets mean 0, std 1."""
    n = groups.size.to(x.dtype)
    mean = group_sum(x, groups) / n
    multi = groups.size > 1
    sq = group_sum((x - mean) ** 2, groups)
    var = sq / torch.where(multi, n - 1, torch.ones_like(n))
    # sqrt with a zero (not NaN) gradient at var == 0: an all-equal group must not poison backward
    positive = var > 0
    std = torch.where(positive, torch.sqrt(torch.where(positive, var, torch.ones_like(var))), 0.0)
    mean = torch.where(multi, mean, torch.zeros_like(mean))
    std = torch.where(multi, std, torch.ones_like(std))
    return mean, std


def leave_one_out_mean(x: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B]` mean of the *other* rows of each row's group, and a bool `[B]` "has others" flag.

    For a singleton the mean is returned as `x` itself (so `x - mean` is exactly 0) and the flag
    is False.
    """
    n = groups.size.to(x.dtype)
    multi = groups.size > 1
    others = (group_sum(x, groups) - x) / torch.where(multi, n - 1, torch.ones_like(n))
    return torch.where(multi, others, x), multi
