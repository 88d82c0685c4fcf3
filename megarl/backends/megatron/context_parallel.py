"""Context parallelism on the megatron backend (megatron's and verl's ``context_parallel_size``).

The C ranks of a context-parallel group run the same micro-batch, each on a share of its
sequence. The padded sequence of S columns (S a multiple of 2C) is cut into 2C chunks of
S / (2C) columns; rank r holds chunks r and 2C - 1 - r, in that order (`chunk_columns`). This
is megatron-core's load-balanced layout: under the causal mask every rank then has the same
attention work, and it is the layout megatron's RoPE slices its position embeddings by
(``get_pos_emb_on_this_cp_rank``, applied by GPTModel whenever the context-parallel group has
more than one rank) and TransformerEngine's attention expects.

- Embeddings, norms, projections and MLPs see the rank's S / C tokens.
- Attention (`ContextParallelAttention`, in megatron's local layer spec) all-gathers the
  keys and values of the group (backward: reduce-scatter, so each rank's K/V gradient sums
  every rank's queries) and masks causally by global column. TransformerEngine's attention
  does its own context parallelism when the TE spec is in use.
- The heads read the hidden states of the rank's own columns (`shard` keeps only the response
  tokens whose hidden state is local), write zeros elsewhere, and
  `megarl.utils.dist.sum_over_group` adds the C disjoint pieces. Every rank then holds the
  whole per-token tensor and computes the same loss; that sum's backward is the identity, so
  a rank's parameter gradient is the part flowing through its own tokens.
- megatron-core does the rest as for TransformerEngine: its schedule multiplies a loss by C
  and divides the sequence length of pipeline messages by C, and DDP averages gradients over
  data parallel x context parallel (the dense parameters' group), so the update is the one
  of the whole micro-batch averaged over the data-parallel ranks.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megarl.backends.megatron.batching import MicroBatch


def chunk_columns(seq_len: int, size: int, rank: int, device: torch.device | None = None
                  ) -> torch.Tensor:
    """[seq_len / size] int64: the global columns rank ``rank`` of ``size`` holds, chunks
    ``rank`` and ``2 size - 1 - rank`` of ``2 size`` equal chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x "
                         f"context_parallel_size = {2 * size}")
    n = seq_len // (2 * size)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)
    second = torch.arange((2 * size - 1 - rank) * n, (2 * size - rank) * n, device=device)
    return torch.cat([first, second])


def group_columns(seq_len: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """[seq_len] int64: global column of each row of a tensor all-gathered over the group
    (rank 0's columns, then rank 1's, ...)."""
    return torch.cat([chunk_columns(seq_len, size, r, device) for r in range(size)])


@functools.lru_cache(maxsize=4)
def causal_mask(seq_len: int, size: int, rank: int, device: torch.device) -> torch.Tensor:
    """[1, 1, seq_len / size, seq_len] bool, True where hidden: rank ``rank``'s queries against
    the group's gathered keys, causal by global column. Built once per (length, rank, device)
    and shared by every layer (a micro-batch's layers all ask for the same one)."""
    q_cols = chunk_columns(seq_len, size, rank, device)
    k_cols = group_columns(seq_len, size, device)
    return (k_cols[None, :] > q_cols[:, None])[None, None]


class ContextParallelAttention(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` on a context-parallel share of the
    sequence: query [S/C, b, np, hn] (this rank's columns), key / value [S/C, b, ng, hn] ->
    [S/C, b, np * hn]. Keys and values are all-gathered over the context-parallel group and
    the causal mask compares global columns; the arithmetic is megatron's own (its
    ``DotProductAttention.forward`` with that mask), so results match the unsplit model up to
    the order of the softmax sums."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        if config.window_size is not None:
            raise ValueError("context parallelism on megatron's local attention has no sliding "
                             "window; use context_parallel_size=1 with window attention")
        local = copy.copy(config)
        local.context_parallel_size = 1  # the parent refuses CP: it runs on gathered K/V here
        # "arbitrary": the softmax applies our mask (its causal mode, fused or not, assumes
        # square [S, S] scores)
        super().__init__(local, layer_number, AttnMaskType.arbitrary, attention_type,
                         attention_dropout, softmax_scale, cp_comm_type, pg_collection)
        group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = group if group is not None else ps.get_context_parallel_group()
        self.cp_size = dist.get_world_size(self.cp_group)
        self.cp_rank = dist.get_rank(self.cp_group)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None:
            raise ValueError("ContextParallelAttention builds its own causal mask; megarl's "
                             "megatron backend passes attention_mask=None")
        C = self.cp_size
        key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        masked = causal_mask(key.shape[0], C, self.cp_rank, query.device)
        return super().forward(query, key, value, masked, attn_mask_type, attention_bias,
                               packed_seq_params)


def shard(mb: MicroBatch, size: int, rank: int) -> MicroBatch:
    """This rank's share of ``mb`` (in the backend's shifted layout, padded to its final
    length): the input and position columns of `chunk_columns`, and the head entries whose
    hidden state lies in them, re-indexed to local columns (``pred_cols``, ``cls_tok_cols``;
    ``tok_cols`` stays global). ``columns`` records the global columns (MoE padding masks)."""
    S = mb.seq_len
    cols = chunk_columns(S, size, rank, mb.input_ids.device)
    local_of = torch.full((S,), -1, dtype=torch.long, device=cols.device)
    local_of[cols] = torch.arange(cols.numel(), device=cols.device)
    keep = local_of[mb.pred_cols] >= 0
    keep_cls = local_of[mb.cls_tok_cols] >= 0
    return replace(
        mb,
        input_ids=mb.input_ids[:, cols].contiguous(),
        position_ids=mb.position_ids[:, cols].contiguous(),
        columns=cols,
        rows=mb.rows[keep],
        resp_cols=mb.resp_cols[keep],
        pred_cols=local_of[mb.pred_cols[keep]],
        tok_cols=mb.tok_cols[keep],
        labels=mb.labels[keep],
        cls_rows=mb.cls_rows[keep_cls],
        cls_resp_cols=mb.cls_resp_cols[keep_cls],
        cls_tok_cols=local_of[mb.cls_tok_cols[keep_cls]],
    )
