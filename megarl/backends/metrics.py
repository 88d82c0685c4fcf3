"""The one reduction of a training step's metrics over ranks, shared by both backends.

Each rank holds ``sums``: {name: value summed over its micro-batches} (only the last pipeline
stage computes the loss, so only its sums are real). The step's metric is the average over the
data-parallel ranks of those sums, with the UNION of the ranks' keys: a rank that did not report
a name (no micro-batch of its share produced it: no clipped token, an MoE layer absent on its
stage) counts 0 for it. Keys are gathered, never assumed equal: an all-reduce over each rank's
own key list would add values of different names, or hang when the lists differ in length.

Sums are added in rank order, one float64 addition per rank (not in the collective's own order),
so the result is the same on gloo and NCCL and at any process-group algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist


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
    names sorted."""
    out = {}
    for key in sorted({k for d in per_rank for k in d}):
        total = per_rank[0].get(key, 0.0)
        for d in per_rank[1:]:
            total += d.get(key, 0.0)
        out[key] = total / len(per_rank)
    return out


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)
