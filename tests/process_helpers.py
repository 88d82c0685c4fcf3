"""Which processes are still alive, for the tests that kill a parent and check its children."""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed process whose new parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout_s: float) -> set[int]:
    """The pids still alive after at most ``timeout_s`` (empty as soon as none is)."""
    pids = set(pids)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return set()
        time.sleep(0.1)
    return {p for p in pids if alive(p)}
