"""Clipped value (critic) loss."""

from __future__ import annotations

import torch

from megarl.algos._checks import check_2d, check_float, check_mask, check_same_shape
from megarl.algos.agg import agg_loss, check_norm
from megarl.algos.masked import masked_mean


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    agg_mode: str = "token-mean",
    **norm,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss with value clipping (verl `compute_value_loss`).

    `v_clip = clip(vpreds, values - c, values + c)`;
    `loss = 0.5 * agg_loss(max((vpreds - R)^2, (v_clip - R)^2), m, agg_mode, **norm)`.

    Args:
        vpreds: [B, L] current critic predictions (grad flows).
        returns: [B, L] targets R; values: [B, L] critic values at rollout time (constants).
        response_mask: [B, L] 0/1 or bool.
        cliprange_value: c >= 0.
    Returns:
        (loss scalar, {"vf_loss": float, "vf_clipfrac": frac((v_clip - R)^2 > (vpreds - R)^2)}).
    """
    check_2d("vpreds", check_float("vpreds", vpreds))
    check_same_shape("vpreds", vpreds, returns=returns, values=values)
    mask = check_mask("response_mask", response_mask, "vpreds", vpreds)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    vpreds = torch.where(mask, vpreds, zero)
    returns = torch.where(mask, check_float("returns", returns).detach().to(vpreds.dtype), zero)
    values = torch.where(mask, check_float("values", values).detach().to(vpreds.dtype), zero)
    clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    loss1 = (vpreds - returns).square()
    loss2 = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), mask, agg_mode, **check_norm(norm))
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(vpreds.dtype), mask)
    return loss, {"vf_loss": float(loss.detach().item()), "vf_clipfrac": float(clipfrac.item())}
