"""Vocabulary-parallel TP=2 on gloo equals TP=1 (worker: tests/dist/kernels_tp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernels_device import compiled_triton_on_cuda

import megarl_kernels as mk

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "kernels_tp.py"


@pytest.mark.dist
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tp2_equals_tp1(impl):
    if impl not in mk.available_impls():
        pytest.skip("triton not importable / no interpreter")
    # Triton: the compiled kernels on CUDA tensors (gloo all-reduces them) where a GPU runs
    # them, else the interpreter on the CPU.
    on_cuda = impl == "triton" and compiled_triton_on_cuda()
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="0" if on_cuda else "1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), impl, "cuda" if on_cuda else "cpu"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert out.count(f"rank{rank} OK") == 4, out[-4000:]
