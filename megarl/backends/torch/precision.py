"""The dtype a torch-backend role holds its parameters in (``param_dtype``), apart from the
dtype it computes in (``dtype``, the role's ``model.dtype``).

``param_dtype`` None keeps mixed precision on the trainable roles: fp32 parameters, gradients
and AdamW state, bf16 compute through FSDP2. ``param_dtype`` bf16 holds all of them in bf16
(half the memory of parameters, gradients and optimizer state, verl's
``fsdp_config.model_dtype: bf16``): every AdamW update is rounded to bf16 as it is applied,
so an update smaller than half a bf16 spacing of the weight (between ``|w| / 512`` and
``|w| / 256``) is lost. With a small learning rate most updates are: AdamW's first step
moves each weight by about ``lr``, which at ``lr = 1e-6`` changes only the weights below
about ``5e-4`` in magnitude (a small fraction of a trained model's; `rounding_notice` is the
start-up line that says so).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.utils.dtypes import DTYPE_ALIASES, torch_dtype

_SECTIONS = {"critic": "critic", "prm": "reward_model"}


def param_dtype_key(role: str) -> str:
    """The config key of ``role``'s parameter dtype (the reference: the actor's)."""
    return f"{_SECTIONS.get(role, 'actor_rollout_ref.actor')}.parallel.param_dtype"


def held_dtype(compute: torch.dtype, param_dtype: str | None, trainable: bool,
               key: str) -> torch.dtype:
    """The dtype the parameters are held in: ``param_dtype`` (a config name or alias), or
    None: fp32 on a trainable role, ``compute`` on a frozen one. Parameters narrower than
    the compute dtype (bf16 held, fp32 compute) are refused."""
    if param_dtype is None:
        return torch.float32 if trainable else compute
    held = torch_dtype(param_dtype, key)
    if held.itemsize < compute.itemsize:
        raise UserInputError(
            f"{key}={param_dtype!r} with the role's model.dtype fp32: fp32 compute on bf16 "
            f"parameters is not supported; set model.dtype: bf16 (bf16 parameters and compute) or "
            f"{key}: null (fp32 parameters)")
    return held


def dtype_name(dtype: torch.dtype) -> str:
    """The config name (fp32 / bf16) of a torch dtype."""
    return DTYPE_ALIASES[str(dtype).removeprefix("torch.")]


def rounding_notice(held: torch.dtype, lr: float, key: str) -> str:
    """The start-up line of a trainable role whose parameters are held in ``held`` (not
    fp32): the updates that rounding to it loses at learning rate ``lr``."""
    eps = torch.finfo(held).eps  # the spacing at 1 (bf16: 1/128)
    name = dtype_name(held)
    return (
        f"parameters, gradients and AdamW state are held in {name} ({key}={name}): each "
        f"update is rounded to {name}, so a step smaller than half the {name} spacing of its "
        f"weight (|w| / {round(4 / eps)} to |w| / {round(2 / eps)}) is lost; AdamW moves a "
        f"weight by about lr = {lr:g} per step, which only weights below about "
        f"{lr * 4 / eps:.2g} in magnitude keep (a weight of 0.01 moves only at lr above "
        f"{0.01 * eps / 4:.1g} to {0.01 * eps / 2:.1g}); for small learning rates hold fp32 "
        f"parameters ({key}: null)")


def check_resume_dtype(meta: dict[str, Any], role: str, held: torch.dtype,
                       directory: Any, key: str) -> None:
    """Refuse resuming a trainable role's checkpoint (parameters and AdamW state) written
    with parameters of another dtype (checkpoints without the field held fp32)."""
    if meta.get("role") != role or role not in ("actor", "critic"):
        return
    saved = meta.get("param_dtype", "fp32")
    if saved != dtype_name(held):
        raise UserInputError(
            f"checkpoint {directory} holds {saved} parameters and AdamW state and this run holds "
            f"{dtype_name(held)}: resume with {key}: {'null' if saved == 'fp32' else saved} "
            "(the dtype the checkpoint was written with)")
