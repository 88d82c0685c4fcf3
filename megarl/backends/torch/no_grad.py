"""The no-grad forward of `megarl.backends.torch.backend.TorchBackend` (``logprobs``,
``values``, ``token_scores`` and the heads' extra outputs): every rank holds the full batch;
the rows are split over data-parallel ranks and into micro-batches (contiguous DP shares cut
by ``forward_max_tokens`` / ``forward_micro_batch_size``, or the caller's row lists), each
micro-batch is packed into one row, and the results are broadcast from the last pipeline stage
and all-reduced over DP (disjoint rows), so every rank returns the full ``[B, L, width]``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch.moe import pipeline_routing, replay_routing
from megarl.backends.torch.packing import (
    Packed,
    default_row_split,
    empty_batch,
    given_row_split,
    pack,
    packed_length,
)
from megarl.backends.torch.pipeline import common_length


def forward_no_grad(
    backend: Any,
    batch: SequenceBatch,
    collect: Callable[[torch.Tensor, Packed], torch.Tensor],
    width: int,
    micro_batches: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    """[B, L, width] float32 of ``collect(output, packed)`` ([b, L, width] per micro-batch)
    for the full batch on every rank, on ``batch``'s device. Collective."""
    b = backend
    B, L = batch.batch_size, batch.response_length
    lengths = batch.attention_mask.bool().sum(1).tolist()
    if micro_batches is not None:
        split = given_row_split(micro_batches, B, b.dp_size)
    else:
        split = default_row_split(
            lengths, b.dp_size, b.forward_max_tokens, b.forward_micro_batch_size
        )
    n = max(len(s) for s in split) or 1
    mine = list(split[b.dp_rank]) + [[]] * (n - len(split[b.dp_rank]))
    pieces = [batch.select(rows) if rows else empty_batch(batch) for rows in mine]
    pad_to = None
    if b._runner is not None:
        pad_to = common_length([packed_length(p) for p in pieces], b._multiple)
    packed = [pack(pc, b.device, multiple=b._multiple, pad_to=pad_to) for pc in pieces]

    out = torch.zeros((B, L, width), dtype=torch.float32, device=b.device)
    b.model.eval()
    with torch.no_grad():
        if b._runner is None:
            outputs = []
            for pc, p in zip(pieces, packed):
                outputs.append(b._run(p, replay_routing(b, pc, p)))
        else:
            outputs = b._runner.forward(packed, pipeline_routing(b, pieces, packed))
        for rows, p, o in zip(mine, packed, outputs):
            if rows:
                out[torch.tensor(rows, device=b.device)] = collect(o, p).float()
    b._reshard()
    if b.layout.pp > 1:
        src = dist.get_process_group_ranks(b.pp_group)[-1]
        dist.broadcast(out, src=src, group=b.pp_group)
    if b.dp_size > 1:
        dist.all_reduce(out, group=b.dp_group)
    return out.to(batch.input_ids.device)
