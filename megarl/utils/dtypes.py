"""The dtypes a model may run in: the one table of their config names (``fp32``, ``bf16``: the
values of ``actor_rollout_ref.model.dtype`` and the other roles' dtype keys), the spellings also
accepted (torch's names), and the torch dtype of each.

Importing this module does not import torch (the config schema uses it); `torch_dtype` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Dtype = Literal["fp32", "bf16"]

# config name -> torch's name of the same dtype (also vLLM's and SGLang's ``dtype`` argument)
CONFIG_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# torch's spelling -> the config name (a config may write either)
DTYPE_ALIASES = {torch_name: name for name, torch_name in CONFIG_DTYPES.items()}


def canonical_dtype(name: str, key: str = "dtype") -> str:
    """The config name of ``name`` (``fp32`` / ``bf16``, or torch's ``float32`` /
    ``bfloat16``); ValueError naming ``key`` otherwise."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in CONFIG_DTYPES:
        raise ValueError(f"{key} must be one of {sorted(CONFIG_DTYPES)}, got {name!r}")
    return name


def torch_dtype(name: str, key: str = "dtype") -> torch.dtype:
    """The torch dtype of config name ``name`` (aliases accepted; see `canonical_dtype`)."""
    import torch

    return getattr(torch, CONFIG_DTYPES[canonical_dtype(name, key)])

