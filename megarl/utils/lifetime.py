"""Processes that die with their parent.

Every process a run starts calls `die_with_parent` first thing: a training rank (its parent is
the torchrun agent), the reward pool's zygote and workers, the asynchronous engine process. When
the parent dies, however it dies (``kill -9``, an OOM kill, a container stop), the child is
killed too, and its own children after it, so nothing of the run keeps training, writing or
holding memory.

On Linux the kernel does it: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``. The parent's pid is checked
right after, closing the race with a parent that died before the call. Where that call does not
exist, a daemon thread polls ``os.getppid()`` and kills the process within ``poll_s`` of the
parent's death. The Linux signal follows the *thread* that started the child: megarl starts its
processes from the main thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A child started with a fresh interpreter finds its parent's pid here (set by the parent).
PARENT_PID_ENV = "MEGARL_PARENT_PID"


def _set_parent_death_signal(sig: int) -> bool:
    """True if the kernel will send ``sig`` at the parent's death (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    _die()


def die_with_parent(parent_pid: int | None = None, poll_s: float = 0.5,
                    use_signal: bool = True) -> str:
    """Kill this process (SIGKILL) when ``parent_pid`` (default: the current parent) dies.

    parent_pid: the pid of the process that started this one, as it knew it; if this process's
    parent is already another (the parent died before this call), it dies now.
    poll_s: seconds between checks of the watchdog thread (where the kernel cannot signal).
    use_signal: False forces the watchdog (tests run it on Linux too).
    Returns how it is enforced: ``"signal"`` or ``"watchdog"``.
    """
    parent = os.getppid() if parent_pid is None else parent_pid
    enforced = "signal" if use_signal and _set_parent_death_signal(signal.SIGKILL) else None
    if os.getppid() != parent:
        _die()
    if enforced is None:
        threading.Thread(target=_watch, args=(parent, poll_s), name="megarl-die-with-parent",
                         daemon=True).start()
        enforced = "watchdog"
    return enforced
