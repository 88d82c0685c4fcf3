"""Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's ``ulysses_sequence_parallel_size``).

The U ranks of one sequence-parallel group work on the same packed micro-batch ``[1, T]`` (T a
multiple of U, see `packing.pack`): rank u holds the contiguous token shard
``[u T/U, (u+1) T/U)``, so the embedding, norms, projections and MLPs see T/U tokens. Attention
needs every token: `UlyssesAttention` all-to-alls q, k, v from (all heads, T/U tokens) to
(heads/U, all T tokens), runs the packed attention of the whole row, and all-to-alls the output
back (each all-to-all's backward is the inverse all-to-all). Positions are the packed row's own
(per sequence, "global"), sliced like the tokens. KV heads fewer than, or not a multiple of, U
are repeated to ``lcm(kv_heads, U)`` first (as verl does), which keeps grouped-query attention
exact.

The heads read the hidden states of the shard's own positions (`SeqShard.local`), write zeros
elsewhere, and `megarl.utils.dist.sum_over_group` adds the U disjoint pieces: every rank of the
group then holds the full per-token logprob / entropy / value / score tensor and computes the same loss and
metrics. Its backward is the identity, so a rank's parameter gradient is the part flowing
through its own tokens; summed over the group (FSDP2 shards over DP x SP and divides by DP
only), it is the gradient of the whole micro-batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from megarl.backends.torch.packing import Packed
from megarl.models.model import attend, attention_layout, repeat_kv


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of dim 0 goes to rank j; chunk j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (empty_like keeps a view's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, t, hd] (all heads, this rank's t tokens) -> [B, H/U, U t, hd] (this rank's head
    slice, every token in shard order). No autograd; see `SeqToHeads`."""
    U = dist.get_world_size(group)
    b, h, t, hd = x.shape
    recv = _all_to_all(x.reshape(b, U, h // U, t, hd).transpose(0, 1), group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // U, U * t, hd)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `seq_to_heads`: [B, H/U, U t, hd] -> [B, H, t, hd]."""
    U = dist.get_world_size(group)
    b, h, T, hd = x.shape
    recv = _all_to_all(x.reshape(b, h, U, T // U, hd).permute(2, 0, 1, 3, 4), group)
    return recv.transpose(0, 1).reshape(b, U * h, T // U, hd)


class SeqToHeads(torch.autograd.Function):
    """`seq_to_heads` whose backward is `heads_to_seq` of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """`heads_to_seq` whose backward is `seq_to_heads` of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g, ctx.group), None


class UlyssesAttention:
    """The attention layout the layers get under Ulysses (`megarl.models.model.attend`): q, k, v
    of this rank's tokens -> all tokens of a head slice -> ``inner`` (the packed row's
    `SegmentGrid` or mask) -> back to this rank's tokens, all heads."""

    def __init__(self, inner, group: dist.ProcessGroup) -> None:
        self.inner = inner
        self.group = group
        self.size = dist.get_world_size(group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> torch.Tensor:
        """q [B, n_heads, t, hd], k/v [B, n_kv, t, hd] (this rank's t tokens, post-RoPE) ->
        [B, n_heads, t, hd]."""
        n_kv = k.shape[1]
        if n_kv % self.size:
            rep = self.size // math.gcd(n_kv, self.size)
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        q, k, v = (SeqToHeads.apply(x, self.group) for x in (q, k, v))
        return HeadsToSeq.apply(attend(self.inner, q, k, v, scale), self.group)


@dataclasses.dataclass(frozen=True)
class SeqShard:
    """This rank's place in its sequence-parallel group (rank ``rank`` of ``size``)."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def span(self, p: Packed) -> tuple[int, int]:
        """(start, length) of this rank's token shard of ``p``."""
        if p.seq_len % self.size:
            raise ValueError(f"packed length {p.seq_len} is not a multiple of the sequence-"
                             f"parallel size {self.size} (pack with multiple={self.size})")
        t = p.seq_len // self.size
        return self.rank * t, t

    def model_inputs(self, p: Packed) -> dict:
        """Keyword arguments of `Transformer.forward` for this rank's shard of ``p``."""
        start, t = self.span(p)
        inner = attention_layout(None, p.segment_ids, p.seq_len)
        return {
            "input_ids": p.input_ids[:, start : start + t],
            "position_ids": p.position_ids[:, start : start + t],
            "attention": UlyssesAttention(inner, self.group),
        }

    def local(self, p: Packed) -> Packed:
        """``p`` with only the head entries whose hidden state lies in this rank's shard, their
        packed positions made shard-relative (the heads index the shard's ``[1, t, ...]``)."""
        start, t = self.span(p)
        keep = (p.pred_pos >= start) & (p.pred_pos < start + t)
        keep_cls = (p.cls_pos >= start) & (p.cls_pos < start + t)
        return dataclasses.replace(
            p,
            input_ids=p.input_ids[:, start : start + t],
            position_ids=p.position_ids[:, start : start + t],
            segment_ids=p.segment_ids[:, start : start + t],
            rows=p.rows[keep], cols=p.cols[keep], labels=p.labels[keep],
            pred_pos=p.pred_pos[keep] - start,
            cls_rows=p.cls_rows[keep_cls], cls_cols=p.cls_cols[keep_cls],
            cls_pos=p.cls_pos[keep_cls] - start,
        )
