"""The shared memory of vLLM's CPU communicators: named after the torchrun job, never left behind.

vLLM 0.32's CPU build runs the all-reduce / gather of each process group of more than one rank
(TP, PP, ...) through POSIX shared memory: every rank creates ``/dev/shm/<group name>_<rank in
group>`` with ``O_EXCL`` and maps the others'. The group name starts with ``VLLM_DIST_IDENT``
(megarl sets it to `launch.cpu_shm_ident`, one name per torchrun job). vLLM never unlinks
these segments: they outlive the engine, the process and the job, and a later job that gets
the same rendezvous port (ports are reused) dies creating its own ("create shm in SHMManager
failed. errno: 17"). So:

- `named_after_job` sets the ident while vLLM builds its groups and, first, removes segments
  of that ident left by a dead job (one rank per host, then a barrier of the whole world, so no
  rank has created its own segment yet);
- `own_segments` lists the segments this rank created, read from vLLM's groups once built;
- `unlink` removes them when the engine closes (`VLLMEngine.close`, and at interpreter exit
  for an engine never closed). Ranks that still map a segment keep it until they unmap it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def stale_segments(ident: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Every segment of a communicator whose name starts with ``ident``."""
    if not shm_dir.is_dir():
        return []
    return sorted(p for p in shm_dir.glob(f"{ident}-*") if "-cpushm_" in p.name)


def unlink(paths: list[Path]) -> int:
    """Remove these segments (missing ones are skipped). Returns how many were removed."""
    removed = 0
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed += 1
    return removed


def _first_on_host(env: Mapping[str, str]) -> bool:
    return env.get("LOCAL_RANK", "0") == "0"


def clear_stale(ident: str, env: Mapping[str, str] = os.environ, shm_dir: Path = SHM_DIR
                ) -> int:
    """Called by every rank before vLLM creates any segment: the host's first rank removes
    segments named with ``ident`` (a dead job's: a live job holding the same rendezvous port
    cannot exist), then the world waits for it. Returns how many this rank removed."""
    removed = 0
    if _first_on_host(env):
        removed = unlink(stale_segments(ident, shm_dir))
        if removed:
            log.warning("vLLM CPU engine: removed %d shared-memory segment(s) of an earlier "
                        "job named %s-* from %s", removed, ident, shm_dir)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return removed


@contextlib.contextmanager
def named_after_job(ident: str | None) -> Iterator[None]:
    """While the engine starts, vLLM's CPU worker sets ``VLLM_DIST_IDENT`` just before it
    initialises its process groups; the ident is put in between and a dead job's segments of
    that name are removed first (None: vLLM's own name, nothing removed)."""
    if ident is None:
        yield
        return
    from vllm.v1.worker import cpu_worker

    original = cpu_worker.init_worker_distributed_environment

    def init_with_ident(*args: Any, **kwargs: Any) -> Any:
        os.environ["VLLM_DIST_IDENT"] = ident
        clear_stale(ident)
        return original(*args, **kwargs)

    cpu_worker.init_worker_distributed_environment = init_with_ident
    try:
        yield
    finally:
        cpu_worker.init_worker_distributed_environment = original


def own_segments(shm_dir: Path = SHM_DIR) -> list[Path]:
    """The segments this rank created: one per vLLM process group on shared memory."""
    from vllm.distributed import parallel_state

    out = []
    for ref in list(parallel_state._groups.values()):
        group = ref()
        comm = getattr(group, "device_communicator", None)
        shm = getattr(comm, "dist_module", None)
        name = getattr(shm, "group_name", None)
        if name is not None:
            out.append(shm_dir / f"{name}_{comm.rank}")
    return out


def unlink_at_exit(paths: list[Path]) -> None:
    """Remove ``paths`` when the interpreter exits (an engine never closed)."""
    if paths:
        atexit.register(unlink, list(paths))
