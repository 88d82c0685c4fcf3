"""Run a 2+-rank worker as ``torchrun --standalone`` would for a test, one thread per rank (the
ranks forked from a warm interpreter: `warm_runs.run_script`).

Workers end with `megarl.utils.dist.destroy`. Ending with a bare ``destroy_process_group`` let
a gloo worker thread, still freeing a finished collective's tensors, meet the interpreter's
finalization: the rank aborted from native code ("terminate called without an active
exception", SIGABRT) after its work was done (12 of 48 worker runs on a loaded 2-core machine;
0 of 48 with `destroy`). Should a rank still abort that way, the run is retried once with a
warning in the test report; a worker that fails any other way, or aborts twice, fails the test
with its output. Workers run with Python's fault handler on, so an abort prints every thread's
Python stack.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from warm_runs import run_script

REPO = Path(__file__).resolve().parents[1]
NATIVE_ABORT = "terminate called without an active exception"


def worker_env(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment for a worker: one thread, the repository importable, Python
    stacks printed on an abort, then ``env`` on top (None: remove the variable)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return full_env


def run_torchrun(worker: Path, nproc: int, args: Sequence[str], timeout: int,
                 env: Mapping[str, str | None] | None = None) -> str:
    """``worker``'s combined stdout + stderr; AssertionError with its tail when it fails.
    env: as `worker_env`."""
    full_env = worker_env(env)
    for attempt in (1, 2):  # the ranks forked from a warm interpreter (warm_runs.py)
        proc = run_script([str(worker), *args], REPO, full_env, timeout, nproc)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0:
            return out
        if attempt == 1 and NATIVE_ABORT in out and "Traceback (most recent call last)" not in (
                out.split(NATIVE_ABORT)[0]):
            warnings.warn(f"{worker.name}: a rank aborted in native code ({NATIVE_ABORT}); "
                          "running the worker again", stacklevel=2)
            continue
        break
    raise AssertionError(f"{worker.name} exited {proc.returncode}:\n{out[-6000:]}")
