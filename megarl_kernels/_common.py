"""Shared pieces of both implementations: combining partial softmax statistics (across vocabulary
splits and tensor-parallel ranks) and small distributed helpers.

Partial statistics of one vocabulary range, per token (all float32, shape [T]):

- ``m``: the max scaled logit ``z = h . w / temperature`` over the range,
- ``s = sum_v exp(z_v - m)``,
- ``t = sum_v exp(z_v - m) * (z_v - m)`` (shifted by ``m`` so the entropy is not a difference of
  two large numbers),
- ``zl``: the label's logit if the label lies in the range, else 0.

A range with no vocabulary entry has ``m = NEG_INIT`` (finite, so ``0 * (m - M)`` is 0, not NaN),
``s = t = 0``. Combined over all ranges with ``M = max m``: ``lse = M + log S`` and
``entropy = log S - T / S`` where ``S = sum s e^(m - M)``, ``T = sum e^(m - M) (t + s (m - M))``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NEG_INIT = -1.0e30


def tp_rank_world(tp_group) -> tuple[int, int]:
    """(rank, world size) in ``tp_group``; (0, 1) when there is no group."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def combine_partials(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, zl: torch.Tensor, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine ``[P, T]`` partial statistics (P vocabulary splits of this rank) into global
    ``(logprob [T], entropy [T], lse [T])``, reducing across ``tp_group`` (two all_reduces)."""
    big_m = m.amax(dim=0)
    if tp_group is not None:
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
    shift = m - big_m
    scale = torch.exp(shift)
    packed = torch.stack(
        [(s * scale).sum(dim=0), (scale * (t + s * shift)).sum(dim=0), zl.sum(dim=0)]
    )
    if tp_group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    big_s, big_t, label_logit = packed.unbind(0)
    log_s = torch.log(big_s)
    lse = big_m + log_s
    entropy = log_s - big_t / big_s
    return label_logit - lse, entropy, lse


def all_reduce_sum_(x: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp_group)
    return x
