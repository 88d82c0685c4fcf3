"""`megarl.utils.lifetime.die_with_parent`: a process dies with its parent, by the kernel's
parent-death signal or by the watchdog thread (a whole run: tests/trainer/test_no_orphans.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import alive, wait_gone

REPO = Path(__file__).resolve().parents[2]

# The middle process starts a grandchild, prints its pid, then waits to be killed.
MIDDLE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(600)
"""
GRANDCHILD = """
import os, time
from megarl.utils.lifetime import die_with_parent
{call}
time.sleep(600)
"""


def _orphan_after_parent_kill(call: str) -> tuple[int, set[int]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, GRANDCHILD.format(call=call)],
                              stdout=subprocess.PIPE, text=True, env=env)
    child = int(middle.stdout.readline())
    time.sleep(1.0)  # the grandchild has imported and called die_with_parent
    assert alive(child)
    middle.kill()
    middle.wait(timeout=10)
    return child, wait_gone({child}, 3.0)


@pytest.mark.parametrize("call", [
    "die_with_parent()",  # the kernel's signal (Linux)
    "die_with_parent(poll_s=0.1, use_signal=False)",  # the watchdog thread
])
def test_child_dies_with_its_parent(call):
    child, left = _orphan_after_parent_kill(call)
    assert not left, f"pid {child} outlived its parent ({call})"


def test_without_the_call_the_child_outlives_its_parent():
    """The control: an orphan lives on unless it asked to die (the test above can fail)."""
    child, left = _orphan_after_parent_kill("pass")
    try:
        assert left == {child}
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_parent_dead_before_the_call_kills_at_once():
    proc = subprocess.run([sys.executable, "-c", "from megarl.utils.lifetime import "
                           "die_with_parent; die_with_parent(parent_pid=-1); print('alive')"],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "alive" not in proc.stdout
