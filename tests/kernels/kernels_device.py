"""Where ``impl="triton"`` runs in the kernel tests: the interpreter on CPU tensors
(``TRITON_INTERPRET=1``), or, on a CUDA machine without it, the compiled kernels on CUDA tensors.

The tests build their inputs on the CPU. ``on_cuda_when_triton`` wraps a public entry point so
that its ``impl="triton"`` calls get their tensors copied to the GPU and their results copied
back; both copies are differentiable, so the float64 references, gradients and metrics of a test
are checked unchanged against the compiled kernels at their GPU block sizes.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.utils._pytree import tree_map

ENTRY_POINTS = ("linear_logprob_entropy", "fused_ppo_loss", "fused_pacs_loss")


def compiled_triton_on_cuda() -> bool:
    """True where ``impl="triton"`` means the compiled kernels on a CUDA device."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _move(device: torch.device):
    return lambda x: x.to(device) if isinstance(x, torch.Tensor) else x


def on_cuda_when_triton(fn):
    """``fn`` with its tensor arguments on CUDA and its tensor results back on the CPU when it
    is called with ``impl="triton"``; other calls are passed through untouched."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs.get("impl") != "triton":
            return fn(*args, **kwargs)
        cuda = torch.device("cuda", torch.cuda.current_device())
        args, kwargs = tree_map(_move(cuda), (args, kwargs))
        return tree_map(_move(torch.device("cpu")), fn(*args, **kwargs))

    return call


def triton_calls_on_cuda(module) -> None:
    """Wrap ``module``'s entry points (``megarl_kernels``) in place with ``on_cuda_when_triton``."""
    for name in ENTRY_POINTS:
        setattr(module, name, on_cuda_when_triton(getattr(module, name)))
