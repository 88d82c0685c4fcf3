"""Masked reductions and whitening over `[B, L]` token tensors (verl's torch_functional semantics).

`mask` is 0/1 of any dtype or bool. Values outside the mask never reach the result (they are
replaced by 0 with `torch.where`, so NaN or inf padding is harmless, also in the backward pass).
"""

from __future__ import annotations

import torch

from megarl.algos._checks import check_same_shape, check_tensor

MEAN_EPS = 1e-8  # inside the masked_mean denominator: sum / (count + 1e-8)
WHITEN_EPS = 1e-8  # inside the rsqrt: (x - mean) * rsqrt(var + 1e-8)


def _bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set; over everything (`dim=None`) or along `dim`."""
    check_tensor("values", values)
    check_same_shape("values", values, mask=mask)
    kept = torch.where(_bool(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`masked_sum / (number of masked entries + 1e-8)`; 0 where nothing is masked."""
    total = masked_sum(values, mask, dim)  # validates both arguments first
    count = _bool(mask).to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return total / (count + MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries (scalar): `masked_mean((x - masked_mean(x))^2)`.

    With `unbiased=True` it is multiplied by `N / (N - 1)`, N the number of masked entries.
    Raises ValueError when N == 0, or N == 1 with `unbiased=True` (the variance is undefined).
    """
    n = int(_bool(mask).sum().item())
    if n == 0:
        raise ValueError("masked_var: the mask selects no element; the variance is undefined")
    if unbiased and n == 1:
        raise ValueError(
            "masked_var: the mask selects a single element; the unbiased variance is undefined "
            "(pass unbiased=False or more valid tokens)"
        )
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(x - mean) * rsqrt(var_unbiased + 1e-8)` with mean and variance over all masked entries.

    The statistics are batch-wide and token-weighted (a long response weighs more). The result is
    not re-masked (callers multiply by the mask). With `shift_mean=False` the mean is added back.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
