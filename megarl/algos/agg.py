"""`agg_loss`: reduce a `[B, L]` per-token loss to a scalar with global normalisation.

The normalisers are those of verl's new engine. The caller passes the totals of the whole
mini-batch (`**norm`) so that summing the gradients of the micro-batches (and averaging over
data-parallel ranks, which is why losses are multiplied by `dp_size`) gives the gradient of one big
batch:

| mode                      | value                                                               |
|---------------------------|---------------------------------------------------------------------|
| `token-mean`              | `sum_{i,t} l m / batch_num_tokens * dp_size`                        |
| `seq-mean-token-sum`      | `sum_{i non-empty} (sum_t l m) / global_batch_size * dp_size`       |
| `seq-mean-token-mean`     | `sum_{i non-empty} (sum_t l m / (n_i + 1e-8)) / global_batch_size * dp_size` |
| `seq-mean-token-sum-norm` | `sum_{i,t} l m / loss_scale_factor` (no batch size, no dp_size)     |

Defaults: `batch_num_tokens` = valid tokens of this call, `global_batch_size` = non-empty rows of
this call, `loss_scale_factor` = the padded length L. `seq-mean-token-sum-norm` is Dr.GRPO's
constant normaliser and, as in verl, is not multiplied by `dp_size`: under a DP-mean gradient
reduction pass `loss_scale_factor = L / dp_size` to get the one-big-batch gradient.
"""

from __future__ import annotations

import torch

from megarl.algos._checks import check_2d, check_float, check_mask
from megarl.algos.masked import MEAN_EPS

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
NORM_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def check_norm(norm: dict) -> dict:
    unknown = sorted(set(norm) - set(NORM_KEYS))
    if unknown:
        raise TypeError(f"unknown normalisation argument(s) {unknown}; valid: {list(NORM_KEYS)}")
    return dict(norm)


def _positive(name: str, value):
    if value is None:
        return None
    v = value.item() if isinstance(value, torch.Tensor) else value
    if not v > 0:
        raise ValueError(f"{name} must be > 0 (a total over the mini-batch), got {v}")
    return value


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` [B, L] over `response_mask` [B, L] to a scalar (see module doc).

    A call with no valid token returns 0 (keeping the graph) when the default normaliser is used.
    """
    check_2d("loss_mat", check_float("loss_mat", loss_mat))
    mask = check_mask("response_mask", response_mask, "loss_mat", loss_mat)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {mode!r}; valid: {list(AGG_MODES)}")
    if not dp_size >= 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    _positive("batch_num_tokens", batch_num_tokens)
    _positive("global_batch_size", global_batch_size)
    _positive("loss_scale_factor", loss_scale_factor)

    kept = torch.where(mask, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    seq_sum = kept.sum(dim=-1)  # [B]
    if mode == "token-mean":
        denom = batch_num_tokens if batch_num_tokens is not None else mask.sum().clamp_min(1)
        return seq_sum.sum() / denom * dp_size
    if mode == "seq-mean-token-sum-norm":
        factor = loss_scale_factor if loss_scale_factor is not None else loss_mat.shape[-1]
        return seq_sum.sum() / factor
    count = mask.sum(dim=-1)
    non_empty = count > 0
    if mode == "seq-mean-token-mean":
        seq_loss = seq_sum / (count.to(loss_mat.dtype) + MEAN_EPS)
    else:  # seq-mean-token-sum
        seq_loss = seq_sum
    total = torch.where(non_empty, seq_loss, 0.0).sum()
    denom = global_batch_size if global_batch_size is not None else non_empty.sum().clamp_min(1)
    return total / denom * dp_size
