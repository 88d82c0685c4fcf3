"""SequenceBatch -> one packed row without padding, and the row splits of the no-grad methods.

A micro-batch of b sequences is packed into ONE row ``[1, T]``: the real tokens (attention mask
1) of every sequence, in row order, each sequence with its own positions ``0..n_i-1`` and its
own ``segment_id`` (= its row index), so the model's block-diagonal causal mask keeps them
apart. Padding costs nothing; only the tail is padded (``pad_to``: a multiple of the TP size
under sequence parallelism, or the common length of all micro-batches of a pipeline step).

Positions follow HF / verl: ``cumsum(attention_mask) - 1`` along the row, i.e. the first real
token of a sequence has position 0 whatever padding precedes it.

Indices kept for the heads (response column j of row i is input column ``P + j``):

- ``rows, cols`` [N]: the response entries that have a predecessor token (everything but a
  response token that is the first real token of its row); ``pred_pos`` [N] the packed position
  of the hidden state that predicts the token (logprob / value), ``labels`` [N] the token ids;
- ``cls_rows, cls_cols, cls_pos`` [M]: every real response entry and its own packed position
  (token classification of a PRM reads the token's own column).

The same micro-batch always packs to the same tensors (nothing depends on other micro-batches
unless ``pad_to`` says so), which keeps ``logprobs`` and the forward of ``train_step``
bit-identical for the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megarl.backends.protocol import SequenceBatch


@dataclass
class Packed:
    """One micro-batch packed into a single row (tensors on the compute device)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    segment_ids: torch.Tensor  # [1, T] int64; padding tail gets id b
    num_tokens: int  # real tokens (T minus the padding tail)
    batch_size: int  # b
    response_length: int  # L
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    pred_pos: torch.Tensor  # [N]
    labels: torch.Tensor  # [N]
    cls_rows: torch.Tensor  # [M]
    cls_cols: torch.Tensor  # [M]
    cls_pos: torch.Tensor  # [M]

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_batch(batch: SequenceBatch) -> None:
    """Raise ValueError naming the field when a SequenceBatch is malformed."""
    ids, mask = batch.input_ids, batch.attention_mask
    if ids.dim() != 2 or tuple(ids.shape) != tuple(mask.shape):
        raise ValueError(
            f"SequenceBatch.input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} "
            "must both be [B, P+L]"
        )
    if not 0 < batch.response_length <= ids.shape[1]:
        raise ValueError(
            f"SequenceBatch.response_length={batch.response_length} must be in [1, {ids.shape[1]}]"
        )
    if ids.dtype.is_floating_point:
        raise ValueError(f"SequenceBatch.input_ids must be integer token ids, got {ids.dtype}")


def packed_length(batch: SequenceBatch) -> int:
    """Real tokens of ``batch`` (the packed length before tail padding)."""
    return int(batch.attention_mask.bool().sum())


def pack(
    batch: SequenceBatch, device: torch.device, *, multiple: int = 1, pad_to: int | None = None
) -> Packed:
    """Pack ``batch`` into one row of length ``max(pad_to, round_up(real tokens, multiple))``
    (at least ``multiple``, so an empty micro-batch still runs a forward)."""
    check_batch(batch)
    ids = batch.input_ids.to(device)
    mask = batch.attention_mask.to(device).bool()
    b, width = ids.shape
    L = batch.response_length
    P = width - L
    n = int(mask.sum())
    T = max(round_up(max(n, 1), multiple), pad_to or 0)
    if pad_to is not None and T % multiple:
        raise ValueError(f"pad_to={pad_to} must be a multiple of {multiple}")

    flat_pos = (mask.reshape(-1).long().cumsum(0) - 1).view(b, width)  # packed index per column
    row_of = torch.arange(b, device=device)[:, None].expand(b, width)
    positions = mask.long().cumsum(1) - 1

    input_ids = torch.zeros(1, T, dtype=torch.long, device=device)
    position_ids = torch.zeros(1, T, dtype=torch.long, device=device)
    segment_ids = torch.full((1, T), b, dtype=torch.long, device=device)
    input_ids[0, :n] = ids[mask]
    position_ids[0, :n] = positions[mask]
    segment_ids[0, :n] = row_of[mask]

    resp_mask = mask[:, P:]
    cls_rows, cls_cols = resp_mask.nonzero(as_tuple=True)
    cls_pos = flat_pos[cls_rows, P + cls_cols]
    has_pred = positions[cls_rows, P + cls_cols] > 0
    rows, cols = cls_rows[has_pred], cls_cols[has_pred]
    return Packed(
        input_ids=input_ids,
        position_ids=position_ids,
        segment_ids=segment_ids,
        num_tokens=n,
        batch_size=b,
        response_length=L,
        rows=rows,
        cols=cols,
        pred_pos=cls_pos[has_pred] - 1,
        labels=ids[rows, P + cols],
        cls_rows=cls_rows,
        cls_cols=cls_cols,
        cls_pos=cls_pos,
    )


# ---------------------------------------------------------------------------------------------
# Row splits of the no-grad methods (every rank holds the full batch and computes the same split)
# ---------------------------------------------------------------------------------------------


def default_row_split(
    lengths: Sequence[int], dp_size: int, max_tokens: int | None, max_rows: int | None
) -> list[list[list[int]]]:
    """Rows per micro-batch per DP rank: DP rank r takes the r-th contiguous share of the rows
    (``ceil(B / dp_size)`` rows), cut in order into micro-batches of at most ``max_rows`` rows
    and ``max_tokens`` real tokens (a longer single row gets a micro-batch of its own)."""
    B = len(lengths)
    per = -(-B // dp_size) if B else 0
    out = []
    for r in range(dp_size):
        rows = list(range(min(r * per, B), min((r + 1) * per, B)))
        micro: list[list[int]] = []
        cur: list[int] = []
        tokens = 0
        for i in rows:
            full_rows = max_rows is not None and len(cur) >= max_rows
            full_tokens = max_tokens is not None and cur and tokens + lengths[i] > max_tokens
            if full_rows or full_tokens:
                micro.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += lengths[i]
        if cur:
            micro.append(cur)
        out.append(micro)
    return out


def given_row_split(
    micro_batches: Sequence[Sequence[int]], batch_size: int, dp_size: int
) -> list[list[list[int]]]:
    """Rows per micro-batch per DP rank from a caller's flat split: entry k goes to DP rank
    ``k % dp_size`` (so a trainer's per-rank lists ``per_rank[r][k]`` map to
    ``flat[k * dp_size + r]``, see `interleave_rank_splits`). Every row must appear exactly
    once."""
    seen = sorted(int(i) for mb in micro_batches for i in mb)
    if seen != list(range(batch_size)):
        raise ValueError(
            "micro_batches must partition the rows 0..B-1 of the batch (every row exactly once); "
            f"got {len(seen)} entries for B={batch_size}"
        )
    out: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for k, mb in enumerate(micro_batches):
        out[k % dp_size].append([int(i) for i in mb])
    return out


def interleave_rank_splits(per_rank: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """A trainer's per-DP-rank micro-batch row lists -> the flat ``micro_batches`` argument of
    ``TorchBackend.logprobs`` that gives every rank the same micro-batches (shorter rank lists
    are padded with empty micro-batches)."""
    n = max((len(r) for r in per_rank), default=0)
    flat: list[list[int]] = []
    for k in range(n):
        for r in per_rank:
            flat.append(list(r[k]) if k < len(r) else [])
    return flat


def empty_batch(like: SequenceBatch) -> SequenceBatch:
    """A one-row, fully masked SequenceBatch with ``like``'s columns (runs a forward that
    contributes nothing; keeps collectives matched across ranks)."""
    return SequenceBatch(
        input_ids=torch.zeros_like(like.input_ids[:1]),
        attention_mask=torch.zeros_like(like.attention_mask[:1]),
        response_length=like.response_length,
        tensors={k: torch.zeros_like(v[:1]) for k, v in like.tensors.items()},
    )
