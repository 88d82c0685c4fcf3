"""The kernel tests on a CUDA machine with compiled Triton (``TRITON_INTERPRET`` unset or 0).

The tests build their inputs on the CPU, where ``impl="triton"`` needs the interpreter. Where a
CUDA device runs the compiled kernels instead, every ``impl="triton"`` call of the public API
gets its tensors copied to the GPU and its results copied back: both copies are differentiable,
so the tests' float64 references, gradients and metrics are checked unchanged against the
compiled kernels at their GPU block sizes.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.utils._pytree import tree_map

import megarl_kernels as mk

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


@pytest.fixture(autouse=True)
def _triton_calls_on_cuda(monkeypatch):
    if compiled_triton_on_cuda():
        for name in ENTRY_POINTS:
            monkeypatch.setattr(mk, name, on_cuda_when_triton(getattr(mk, name)))
