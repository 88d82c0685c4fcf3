"""The no-grad forward of `megarl.backends.megatron.backend.MegatronBackend` (``logprobs``,
``values``, ``token_scores``, ``logits``): each data-parallel rank runs its contiguous share of
the rows in micro-batches of ``forward_micro_batch_size`` rows (by default one per pipeline
stage) through megatron's forward-only schedule; the last stage's results are broadcast over
the pipeline and gathered over DP, so every rank returns the full batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megarl.backends.megatron import parallel
from megarl.backends.megatron.batching import MicroBatch, chunk_rows, pad_rows, split_rows
from megarl.backends.megatron.heads import MegatronHeadOutputs
from megarl.backends.protocol import SequenceBatch


def forward_no_grad(
    backend: Any,
    batch: SequenceBatch,
    collect: Callable[[MegatronHeadOutputs], torch.Tensor],
    temperature: float,
    width: int,
) -> torch.Tensor:
    """[width, B, L] float32 (CPU) of ``collect(outputs)`` ([width, b, L] per micro-batch)
    for the full batch, computed over this rank's DP share and gathered on every rank.
    Collective."""
    b = backend
    B, L = batch.batch_size, batch.response_length
    share, _ = split_rows(batch, b.dp_size, b.dp_rank)
    per = share.batch_size
    size = b.forward_micro_batch_size or max(1, -(-per // b.layout.pp))
    pieces = chunk_rows(share, size)
    if b.layout.vpp:  # interleaving needs a multiple of pp micro-batches
        while len(pieces) % b.layout.pp:
            pieces.append(pad_rows(share.select(slice(0, 0)), 1))
    mbs = [b._prepare(p) for p in pieces]

    def loss_func(mb: MicroBatch, hidden: torch.Tensor, non_loss_data: bool = False):
        return collect(b._head_outputs(hidden, mb, temperature)).float()

    for m in b.modules:
        m.eval()
    with torch.no_grad():
        stored = b._run_schedule(mbs, loss_func, forward_only=True)
    out = torch.zeros((width, per, L), dtype=torch.float32, device=parallel.device())
    if parallel.is_last_stage():
        local = torch.cat([s for s in stored], dim=1)[:, :per]
        out.copy_(local)
    if b.layout.pp > 1:
        dist.broadcast(out, src=parallel.pp_ranks()[-1], group=parallel.pp_group())
    if b.dp_size > 1:
        parts = [torch.empty_like(out) for _ in range(b.dp_size)]
        dist.all_gather(parts, out, group=parallel.dp_group())
        out = torch.cat(parts, dim=1)
    return out[:, :B].cpu()
