"""Process-group setup and the few collectives the trainer needs, on gloo or NCCL.

Works the same under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set) and as a plain
``python`` process (a world of one on an in-memory store: no port to pick or race for, and the
same code paths, including DCP and megatron's parallel_state, run unchanged).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> this rank's CUDA device when CUDA is available, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device: cuda requested but CUDA is not available; use cpu or auto")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise ValueError(f"trainer.device: expected auto, cpu or cuda, got {device!r}")
    return torch.device("cpu")


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: int = 1800) -> None:
    """Initialise the default process group once (idempotent)."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # torchrun, megarl-launch, SLURM: env:// rendezvous
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # A world of one leaves the environment alone: child processes (tests, a torchrun started
    # from here) must not inherit a RANK that makes them take the env:// path.
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Every rank returns rank ``src``'s ``obj`` (pickled; for small metadata, not tensors)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """List of every rank's ``obj`` in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_sum(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise sum of a list of floats over ranks (float64)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (the consumer is replicated over the group,
    so each rank keeps the gradient of its own contribution)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of the group's ``x`` (disjoint pieces, zeros elsewhere: exact), differentiable."""
    if group is None:
        return x
    return _SumOverGroup.apply(x, group)


# How long `destroy` leaves the GIL to gloo's worker threads (seconds).
GLOO_DRAIN_S = 0.2


def destroy() -> None:
    """Destroy every process group; call it last, before the interpreter exits.

    On gloo, the main thread then sleeps ``GLOO_DRAIN_S`` with the GIL released. A gloo worker
    thread frees a finished collective's tensors after the caller's ``wait`` has returned, and
    freeing a tensor Python has seen takes the GIL. If the interpreter is already finalizing by
    then, that thread exits inside a C++ destructor and the process aborts with "terminate
    called without an active exception" (SIGABRT after the work is done). On a loaded 2-core
    machine a quarter of 2-rank runs ended that way."""
    if not dist.is_initialized():
        return
    gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        time.sleep(GLOO_DRAIN_S)
