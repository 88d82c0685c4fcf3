"""Choosing an implementation: ``"torch"`` (chunked PyTorch) or ``"triton"`` (fused kernels).

``impl="auto"`` resolves to the process-wide default when one is set (``set_default_impl`` or the
``MEGARL_KERNELS_IMPL`` environment variable), else to ``"triton"`` for CUDA tensors when Triton
imports, else ``"torch"``. On CPU ``auto`` is always ``"torch"``, also under ``TRITON_INTERPRET=1``:
only an explicit ``impl="triton"`` runs the (slow) interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

IMPLS = ("auto", "torch", "triton")
ENV_VAR = "MEGARL_KERNELS_IMPL"

_default: str | None = None


def _check_name(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown megarl_kernels impl {impl!r}; valid: {list(IMPLS)}")
    return impl


def set_default_impl(impl: str | None) -> None:
    """Force an implementation process-wide for ``impl="auto"`` calls (``None`` or ``"auto"``
    restores automatic choice; the ``MEGARL_KERNELS_IMPL`` env var is read when nothing is set)."""
    global _default
    _default = None if impl is None else _check_name(impl)


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available_impls() -> list[str]:
    """Implementations usable in this process: ``"torch"`` always; ``"triton"`` when Triton
    imports and either a CUDA device exists or ``TRITON_INTERPRET=1``."""
    out = ["torch"]
    if triton_importable() and (torch.cuda.is_available() or interpreter_on()):
        out.append("triton")
    return out


def resolve(impl: str, device: torch.device) -> str:
    """The concrete implementation name for a call with ``impl`` on ``device``."""
    _check_name(impl)
    if impl == "auto":
        impl = _default or os.environ.get(ENV_VAR, "auto") or "auto"
        _check_name(impl)
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if impl == "triton":
        if not triton_importable():
            raise RuntimeError("impl='triton' but triton is not installed; use impl='torch'")
        if device.type != "cuda" and not interpreter_on():
            raise RuntimeError(
                f"impl='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 set before "
                "megarl_kernels.triton_impl is imported (slow; for tests); use impl='torch'"
            )
    return impl


def load(impl: str) -> ModuleType:
    """The module implementing ``forward_stats`` / ``backward_grads`` for ``impl``."""
    if impl == "triton":
        from megarl_kernels import triton_impl

        return triton_impl
    from megarl_kernels import torch_impl

    return torch_impl
