"""Input validation shared by the algos modules (private).

Every public function of ``megarl.algos`` validates its inputs here so that a wrong shape or dtype
fails with a message naming the argument, its shape and the fix, instead of broadcasting silently.
"""

from __future__ import annotations

import torch


def check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float(name: str, x: object) -> torch.Tensor:
    x = check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32 or float64), got {x.dtype}")
    return x


def check_2d(name: str, x: object) -> torch.Tensor:
    x = check_tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, L] (2-D), got shape {tuple(x.shape)}")
    return x


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise if any of ``others`` (None is skipped) does not have ``ref``'s shape."""
    for name, t in others.items():
        if t is None:
            continue
        check_tensor(name, t)
        if t.shape != ref.shape:
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(t.shape)} but {ref_name} has shape "
                f"{tuple(ref.shape)}; they must match"
            )


def check_per_row(name: str, x: object, batch: int) -> torch.Tensor:
    """A per-response tensor must be [B]."""
    x = check_tensor(name, x)
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B]=({batch},), got shape {tuple(x.shape)}")
    return x


def check_mask(name: str, mask: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor after checking its shape against ``ref``."""
    mask = check_tensor(name, mask)
    check_same_shape(ref_name, ref, **{name: mask})
    if mask.dtype == torch.bool:
        return mask
    return mask != 0


def check_group_index(group_index: object, batch: int) -> torch.Tensor:
    if group_index is None:
        raise ValueError("group_index is required: an int64 [B] tensor, same value = same prompt")
    g = check_per_row("group_index", group_index, batch)
    if g.dtype.is_floating_point or g.dtype.is_complex or g.dtype == torch.bool:
        raise TypeError(f"group_index must be an integer tensor (int64), got {g.dtype}")
    return g


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32 and cast back; float32/64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
