"""Mini-batch / data-parallel / micro-batch splitting and the update loops.

Every rank holds the same full step batch, so every rank computes the same split:
  mini-batches  ppo_mini_batch_size prompts (x n responses) each, whole groups kept together;
  DP shards     each mini-batch spread over dp_size ranks, balanced by tokens (whole groups
                when the loss needs them, i.e. PACS);
  micro-batches by token budget (use_dynamic_bsz: ceil(tokens / budget) token-balanced parts)
                or, as verl without dynamic batching, consecutive chunks of exactly
                ``ppo_micro_batch_size_per_gpu`` responses (the last may be shorter); padded so
                every DP rank runs the same number of micro-batches (FSDP / DDP collectives
                match). PACS keeps whole groups in a micro-batch (token-balanced over groups).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from megarl.backends.protocol import Backend, SequenceBatch
from megarl.metrics import means, merge, values
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.losses import Norm


def group_order(group_index: torch.Tensor) -> list[list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_index.tolist()):
        groups[g].append(i)
    return list(groups.values())


def mini_batches(batch: RolloutBatch, prompts_per_mini: int, shuffle: bool,
                 generator: torch.Generator | None) -> list[list[int]]:
    """Row indices of each mini-batch (whole groups; ``prompts_per_mini`` groups each)."""
    groups = group_order(batch.group_index)
    if shuffle:
        perm = torch.randperm(len(groups), generator=generator).tolist()
        groups = [groups[i] for i in perm]
    size = max(1, prompts_per_mini)
    return [sum(groups[i:i + size], []) for i in range(0, len(groups), size)]


def balanced_partition(costs: list[int], parts: int, units: list[list[int]]) -> list[list[int]]:
    """Greedy longest-first assignment of ``units`` (lists of rows, cost = sum of their costs)
    to ``parts`` bins; deterministic. Returns rows per bin, each in ascending order."""
    unit_cost = [sum(costs[i] for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-unit_cost[u], u))
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    count = [0] * parts
    for u in order:
        b = min(range(parts), key=lambda k: (load[k], count[k], k))
        bins[b].extend(units[u])
        load[b] += unit_cost[u]
        count[b] += 1
    return [sorted(b) for b in bins]


def micro_split(rows: list[int], costs: list[int], *, num_micro: int) -> list[list[int]]:
    """Split ``rows`` into exactly ``num_micro`` token-balanced, order-preserving chunks
    (some may be empty when rows are fewer)."""
    if num_micro <= 1 or len(rows) <= 1:
        return [rows] + [[] for _ in range(num_micro - 1)]
    units = [[r] for r in rows]
    parts = balanced_partition(costs, num_micro, units)
    return parts


def fixed_chunks(rows: list[int], size: int, num_micro: int) -> list[list[int]]:
    """``rows`` in order, cut into chunks of ``size`` (the last may be shorter), then padded
    with empty chunks to ``num_micro`` (verl's split by ppo_micro_batch_size_per_gpu)."""
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    return chunks + [[] for _ in range(num_micro - len(chunks))]


def count_micro(rows: list[int], costs: list[int], max_tokens: int | None,
                micro_size: int | None) -> int:
    if max_tokens:  # as verl's dynamic bsz: ceil(total / budget) token-balanced parts
        total = sum(costs[r] for r in rows)
        return max(1, -(-total // max_tokens))
    if micro_size:
        return max(1, -(-len(rows) // micro_size))
    return 1


def empty_like(batch: SequenceBatch) -> SequenceBatch:
    """A one-row micro-batch that contributes nothing (response mask all zero)."""
    mb = batch.select(slice(0, 1))
    mb.tensors = {k: v.clone() for k, v in mb.tensors.items()}
    mb.tensors["response_mask"] = torch.zeros_like(mb.tensors["response_mask"])
    return mb


def run_update(
    backend: Backend,
    batch: RolloutBatch,
    keys: tuple[str, ...],
    make_loss_fn: Callable[[Norm], Callable],
    *,
    prompts_per_mini: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    max_tokens_per_micro: int | None,
    micro_size: int | None,
    keep_groups_on_rank: bool,
    loss_scale_factor: float,
    temperature: float = 1.0,
) -> list[dict[str, float]]:
    """PPO-style update: for each epoch and mini-batch, one ``backend.train_step``.

    Returns the metrics of every optimizer step (the trainer averages them)."""
    dp_size, dp_rank = backend.dp_size, backend.dp_rank
    seq = batch.sequence_batch(keys)
    lengths = seq.attention_mask.sum(-1).tolist()
    resp_tokens = batch.response_mask.sum(-1)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        for rows in mini_batches(batch, prompts_per_mini, shuffle, generator):
            if keep_groups_on_rank:
                units = group_order(batch.group_index[rows])
                units = [[rows[i] for i in u] for u in units]
            else:
                units = [[r] for r in rows]
            shards = balanced_partition(lengths, dp_size, units)
            mine = shards[dp_rank]
            num_micro = max(count_micro(s, lengths, max_tokens_per_micro, micro_size)
                            for s in shards)
            if keep_groups_on_rank:  # micro-batches of whole groups
                groups = group_order(batch.group_index[mine])
                units = [[mine[i] for i in g] for g in groups]
                parts = balanced_partition(lengths, num_micro, units)
            elif not max_tokens_per_micro and micro_size:
                parts = fixed_chunks(mine, micro_size, num_micro)
            else:
                parts = micro_split(mine, lengths, num_micro=num_micro)
            micro = [seq.select(p) if p else empty_like(seq) for p in parts]
            norm = Norm(
                dp_size=dp_size,
                batch_num_tokens=int(resp_tokens[rows].sum()),
                global_batch_size=int((resp_tokens[rows] > 0).sum()),
                # seq-mean-token-sum-norm is not scaled by dp_size (verl): dividing the
                # constant by dp_size makes the DP-averaged gradient the one-batch gradient
                loss_scale_factor=loss_scale_factor / dp_size,
            )
            out.append(backend.train_step(micro, make_loss_fn(norm), temperature=temperature))
    return out


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The update's metrics: each name averaged over the optimizer steps (mini-batches x epochs)
    that report it, one weight per step (`megarl.metrics.merge`)."""
    return values(merge([means(m) for m in steps]))
