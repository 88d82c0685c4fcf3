"""Vocabulary-parallel TP=2 on gloo equals TP=1 (worker: tests/dist/kernels_tp.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kernels_device import compiled_triton_on_cuda
from warm_runs import run_script

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
    argv = [str(WORKER), impl, "cuda" if on_cuda else "cpu"]
    proc = run_script(argv, ROOT, env, timeout=240, nproc=2)  # as torchrun, forked warm
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert out.count(f"rank{rank} OK") == 4, out[-4000:]
