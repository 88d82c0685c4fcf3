"""SequenceBatch (prompt left-padded, response right-padded) -> what megatron runs.

megatron's local attention has no packed (THD) sequences and its RoPE ignores position_ids
(positions are 0..s-1 in every row). So each row's real tokens, which are contiguous (left pad,
prompt, response, right pad), are shifted to the start of the row and the batch is cut to the
longest row: the padding then only follows real tokens, the plain causal mask is exact, and
positions start at 0 as HF's ``position_ids = cumsum(mask) - 1`` gives. This removes all left
padding and the common right padding without any attention mask.

Indices kept for the heads (N = number of response tokens that have a predecessor):
``rows, resp_cols`` (entry [i, j] of the [b, L] output), ``pred_cols`` (column of the hidden
state that predicts the token: P_i + j - 1 after the shift) and ``tok_cols`` (the token's own
column P_i + j, read by token classification), ``labels`` (the token ids). Under context
parallelism each rank keeps the entries whose hidden state it holds
(`megarl.backends.megatron.context_parallel.shard`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megarl.backends.protocol import SequenceBatch


@dataclass
class MicroBatch:
    """One micro-batch in megatron's shifted layout (all tensors on the compute device)."""

    input_ids: torch.Tensor  # [b, S] int64, row i real tokens in [0, lengths[i])
    position_ids: torch.Tensor  # [b, S] int64, 0..S-1
    lengths: torch.Tensor  # [b]
    response_length: int  # L
    rows: torch.Tensor  # [N]
    resp_cols: torch.Tensor  # [N]
    pred_cols: torch.Tensor  # [N]
    tok_cols: torch.Tensor  # [N]
    labels: torch.Tensor  # [N]
    # response tokens whose own column is read (PRM: includes a token at column 0)
    cls_rows: torch.Tensor  # [M]
    cls_resp_cols: torch.Tensor  # [M]
    cls_tok_cols: torch.Tensor  # [M]
    source: SequenceBatch  # the caller's micro-batch (for loss functions)
    # under context parallelism (`context_parallel.shard`): the global column of each of the
    # rank's S / C columns; None: the columns are 0..S-1
    columns: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Rows of the caller's micro-batch (``input_ids`` may carry extra padding rows)."""
        return int(self.lengths.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def check_layout(batch: SequenceBatch) -> None:
    """Raise ValueError unless every row is [left pad, prompt, response, right pad]."""
    ids, mask = batch.input_ids, batch.attention_mask
    if ids.dim() != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"SequenceBatch.input_ids {tuple(ids.shape)} and attention_mask "
            f"{tuple(mask.shape)} must both be [B, P+L]"
        )
    L = batch.response_length
    if not 0 < L <= ids.shape[1]:
        raise ValueError(f"SequenceBatch.response_length={L} must be in [1, {ids.shape[1]}]")
    m = mask.bool()
    P = ids.shape[1] - L
    prompt_len = m[:, :P].sum(1)
    resp_len = m[:, P:].sum(1)
    cols = torch.arange(ids.shape[1], device=ids.device)
    expected = (cols[None] >= (P - prompt_len)[:, None]) & (cols[None] < (P + resp_len)[:, None])
    if not torch.equal(m, expected):
        bad = int((m != expected).any(1).nonzero()[0, 0])
        raise ValueError(
            f"SequenceBatch row {bad}: attention_mask is not [left-padded prompt | right-padded "
            "response]; real tokens must be contiguous and end the prompt / start the response"
        )


def to_micro_batch(
    batch: SequenceBatch, device: torch.device, pad_multiple: int = 1
) -> MicroBatch:
    """Shift ``batch`` into megatron's layout; the sequence length is a multiple of
    ``pad_multiple`` (TP size under sequence parallelism) and at least 1."""
    check_layout(batch)
    ids = batch.input_ids.to(device)
    mask = batch.attention_mask.to(device).bool()
    b, total = ids.shape
    L = batch.response_length
    P = total - L
    prompt_len = mask[:, :P].sum(1)
    resp_len = mask[:, P:].sum(1)
    lengths = prompt_len + resp_len
    S = max(int(lengths.max()) if b else 1, 1)
    S = -(-S // pad_multiple) * pad_multiple
    start = P - prompt_len  # first real column of each row
    k = torch.arange(S, device=device)
    src = (start[:, None] + k[None]).clamp(max=total - 1)
    valid = k[None] < lengths[:, None]
    shifted = torch.where(valid, ids.gather(1, src), torch.zeros_like(src))

    j = torch.arange(L, device=device)
    in_resp = j[None] < resp_len[:, None]  # [b, L]
    cls_rows, cls_resp_cols = in_resp.nonzero(as_tuple=True)
    cls_tok_cols = prompt_len[cls_rows] + cls_resp_cols
    has_pred = cls_tok_cols > 0
    rows, resp_cols = cls_rows[has_pred], cls_resp_cols[has_pred]
    tok_cols = cls_tok_cols[has_pred]
    return MicroBatch(
        input_ids=shifted,
        position_ids=k[None].expand(b, S).contiguous(),
        lengths=lengths,
        response_length=L,
        rows=rows,
        resp_cols=resp_cols,
        pred_cols=tok_cols - 1,
        tok_cols=tok_cols,
        labels=shifted[rows, tok_cols],
        cls_rows=cls_rows,
        cls_resp_cols=cls_resp_cols,
        cls_tok_cols=cls_tok_cols,
        source=batch.to(device),  # what loss functions read: on the model's device
    )


def pad_to(mb: MicroBatch, seq_len: int, rows: int) -> MicroBatch:
    """``mb`` with ``input_ids`` / ``position_ids`` padded to [rows, seq_len] (pipeline stages
    exchange fixed shapes); padding rows and columns come after all real tokens."""
    b, S = mb.input_ids.shape
    if (rows, seq_len) == (b, S):
        return mb
    if rows < b or seq_len < S:
        raise ValueError(f"cannot pad [{b}, {S}] down to [{rows}, {seq_len}]")
    ids = mb.input_ids.new_zeros((rows, seq_len))
    ids[:b, :S] = mb.input_ids
    pos = torch.arange(seq_len, device=ids.device)[None].expand(rows, seq_len).contiguous()
    return replace(mb, input_ids=ids, position_ids=pos)


def split_rows(batch: SequenceBatch, parts: int, index: int) -> tuple[SequenceBatch, int]:
    """Rows of share ``index`` when B rows are split into ``parts`` equal shares (the last ones
    padded with fully masked rows); returns (share, number of real rows in it)."""
    B = batch.batch_size
    per = -(-B // parts) if B else 0
    lo, hi = min(index * per, B), min((index + 1) * per, B)
    share = batch.select(slice(lo, hi))
    real = hi - lo
    if real < per:
        share = pad_rows(share, per - real)
    return share, real


def pad_rows(batch: SequenceBatch, n: int) -> SequenceBatch:
    """``batch`` plus ``n`` fully masked rows (tensors padded with zeros)."""
    if n == 0:
        return batch

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((n, *t.shape[1:]))])

    return SequenceBatch(
        input_ids=pad(batch.input_ids),
        attention_mask=pad(batch.attention_mask),
        response_length=batch.response_length,
        tensors={k: pad(v) for k, v in batch.tensors.items()},
    )


def chunk_rows(batch: SequenceBatch, size: int) -> list[SequenceBatch]:
    """Consecutive row chunks of at most ``size`` rows (at least one chunk)."""
    B = batch.batch_size
    if B == 0:
        return [batch]
    return [batch.select(slice(i, min(i + size, B))) for i in range(0, B, size)]
