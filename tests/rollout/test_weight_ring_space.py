"""A shared-memory folder too small for the weight ring is a start-up error in words, not a
SIGBUS at the second publish: the ring reserves all its pages when it is created.

Run in a private mount namespace (root) on a 1 MiB tmpfs standing in for a container's small
/dev/shm (Docker's default is 64 MiB): one copy of the weights (640 KiB) fits, two do not.
Before the reservation the ring mapped a sparse file, and writing the second slot killed the
process with SIGBUS (exit -7), leaving the ring file behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import ctypes, os, sys
from pathlib import Path
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x00020000) == 0, "unshare(CLONE_NEWNS)"
assert libc.mount(None, b"/", None, ctypes.c_ulong((1 << 18) | 16384), None) == 0
shm = Path(sys.argv[1])
assert libc.mount(b"tmpfs", str(shm).encode(), b"tmpfs", ctypes.c_ulong(0), b"size=1m") == 0
import torch
from megarl.errors import UserInputError
from megarl.rollout import weight_ring
weight_ring.shm_dir = lambda: shm
weights = [("w", torch.ones(160 * 1024, dtype=torch.float32))]  # 640 KiB a copy
try:
    ring = weight_ring.WeightRing.create(weights, slots=2)
    ring.write(1, weights)
    print("wrote both slots")
except UserInputError as e:
    print("refused:", e)
print("left:", sorted(p.name for p in shm.iterdir()))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the small tmpfs needs root")
def test_a_small_shared_memory_is_a_start_up_error_in_words(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(shm)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    refused, left = proc.stdout.splitlines()[-2:]
    assert refused.startswith("refused: weight ring: "), proc.stdout
    assert f"{shm} has 1.0 MiB free" in refused and "needs 1.2 MiB (2 copies of 0.6 MiB" in refused
    assert "docker run --shm-size=1g" in refused
    assert "async_training.staleness_threshold" in refused
    assert left == "left: []"
