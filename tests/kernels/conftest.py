"""The kernel tests on a CUDA machine with compiled Triton (``TRITON_INTERPRET`` unset or 0):
every ``impl="triton"`` call runs the compiled kernels on CUDA copies of the CPU inputs
(kernels_device.py)."""

from __future__ import annotations

import pytest
from kernels_device import ENTRY_POINTS, compiled_triton_on_cuda, on_cuda_when_triton

import megarl_kernels as mk


@pytest.fixture(autouse=True)
def _triton_calls_on_cuda(monkeypatch):
    if compiled_triton_on_cuda():
        for name in ENTRY_POINTS:
            monkeypatch.setattr(mk, name, on_cuda_when_triton(getattr(mk, name)))
