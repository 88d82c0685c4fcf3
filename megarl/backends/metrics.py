"""The one reduction of a training step's metrics over ranks, shared by both backends.

Each rank holds ``sums``: {name: value summed over its micro-batches} (only the last pipeline
stage computes the loss, so only its sums are real). The step's metric is the average over the
data-parallel ranks of those sums, with the UNION of the ranks' keys: a rank that did not report
a name (no micro-batch of its share produced it: no clipped token, an MoE layer absent on its
stage) counts 0 for it. Keys are gathered, never assumed equal: an all-reduce over each rank's
own key list would add values of different names, or hang when the lists differ in length.

Each rank's sum is a `megarl.metrics.Metric` MEAN of weight 1 (a rank lacking the name counts
``Metric.mean(0.0)``), merged by `megarl.metrics.merge`: the values are added in rank order, one
float64 addition per rank (not in the collective's own order), so the result is the same on gloo
and NCCL and at any process-group algorithm.

The other side of this wire format: a loss function reports each metric as this micro-batch's
contribution (`contributions`: a mean times the micro-batch's `share`, a sum as it is), the
backend adds them over its micro-batches, then `reduce_metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from megarl.metrics import Metric, Reduce, means, merge, values


def reduce_metrics(
    sums: Mapping[str, float],
    dp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """{name: average over the ranks of ``dp_group`` of their ``sums[name]`` (0 where absent)},
    the same on every rank. Collective over both groups.

    sums: this rank's {name: float}; on a pipeline, the last stage's are used (broadcast over
        ``pp_group`` from its last rank first).
    dp_group / pp_group: None, or a group of one, skips that step.
    """
    sums = {k: float(v) for k, v in sums.items()}
    if _size(pp_group) > 1:
        box = [sums]
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(pp_group)[-1],
                                   group=pp_group)
        sums = box[0]
    n = _size(dp_group)
    if n == 1:
        return sums
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, sums, group=dp_group)
    return average_union(gathered)


def average_union(per_rank: list[Mapping[str, float]]) -> dict[str, float]:
    """{name: (sum over ``per_rank`` in order of the value, 0 where absent) / len(per_rank)},
    names sorted: each rank one MEAN part of weight 1. (The sum starts at 0.0, so a name that
    is -0.0 on every rank gives +0.0; the backends' micro-batch sums also start at 0.0 and are
    never -0.0.)"""
    return values(merge([means(d) for d in per_rank], missing=Metric.mean(0.0)))


def share(weight: float, total_weight: float, dp_size: int) -> float:
    """A micro-batch's share of its mini-batch: ``weight / total_weight x dp_size`` (a total
    below 1, an empty mini-batch, counts as 1). The shares of all micro-batches of all ranks
    add up to ``dp_size``: the backend's sum over micro-batches and mean over ranks of
    value x share is the mean over the mini-batch weighted by ``weight``."""
    return weight / max(total_weight, 1) * dp_size


def contributions(metrics: Mapping[str, Metric], total_weight: float,
                  dp_size: int) -> dict[str, float]:
    """What a loss function reports to the backend for one micro-batch (``LossFn``: the backend
    sums the values over micro-batches and averages them over data-parallel ranks).

    metrics: this micro-batch's. A MEAN (its value over the micro-batch's ``weight`` tokens or
        responses) is reported as value x `share` of ``total_weight`` (the mini-batch's tokens
        or responses over all ranks); a SUM (already normalised: this micro-batch's part of the
        mini-batch's total, e.g. a loss) as it is. Other reductions do not survive the
        backend's sum: an error.
    """
    out = {}
    for name, m in metrics.items():
        if m.reduce is Reduce.MEAN:
            out[name] = m.value * share(m.weight, total_weight, dp_size)
        elif m.reduce is Reduce.SUM:
            out[name] = m.value
        else:
            raise ValueError(f"{name}: a loss function's metric is summed over micro-batches "
                             f"by the backend; {m.reduce.value!r} cannot be")
    return out


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)
