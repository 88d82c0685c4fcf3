"""megatron's parallel_state: initialised once per process, shared by every role.

Megatron keeps its process groups in module globals, so all backends living in one process
(actor, ref, critic, PRM) share one tensor x pipeline x context-parallel layout; they may differ in sequence
parallelism, virtual pipeline size, dtype and recompute. The virtual-pipeline size megatron
reads from parallel_state is set only while a backend runs its own schedule (`virtual_pp`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megarl.backends.megatron import cpu_compat

_SEEDED: int | None = None
_WORLD: object | None = None  # the default process group megatron's groups were built from


def ensure_model_parallel(
    tp: int, pp: int, seed: int, ep: int | None = 1, etp: int | None = None, cp: int = 1
) -> None:
    """Initialise megatron's process groups for (tp, pp, ``cp`` context-parallel ranks) and the
    expert layout (``ep`` expert parallel ranks, ``etp`` tensor-parallel ranks per expert,
    default ``tp``) unless already done with the same sizes; the caller must have called
    ``torch.distributed.init_process_group``. ``ep=None`` (a dense model): any expert layout
    already initialised is fine, a fresh one has none."""
    global _SEEDED, _WORLD
    any_experts = ep is None
    ep = 1 if ep is None else ep
    etp = tp if etp is None else etp
    if not dist.is_initialized():
        raise RuntimeError(
            "MegatronBackend needs torch.distributed: call "
            "torch.distributed.init_process_group('gloo' on CPU, 'nccl' on GPU) first "
            "(megarl.utils.dist.init_distributed does it)"
        )
    cpu_compat.apply()
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = dist.get_world_size()
    if ps.model_parallel_is_initialized() and _WORLD is not None and _WORLD is not dist.group.WORLD:
        # The process group was destroyed and created again (e.g. a second run in this
        # process): megatron's groups belong to the old one.
        ps.destroy_model_parallel()
        _SEEDED = None
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        if any_experts:
            ep, etp = have[2:4]
        if have != (tp, pp, ep, etp, cp):
            raise ValueError(
                f"megatron parallel_state is already initialised with tensor/pipeline/expert/"
                f"expert-tensor/context sizes {have} in this process, but this backend asks "
                f"for {(tp, pp, ep, etp, cp)}: every megatron role in one process must use the "
                "same tensor_model_parallel_size, pipeline_model_parallel_size, "
                "expert_model_parallel_size, expert_tensor_parallel_size and "
                "context_parallel_size"
            )
    else:
        if world % (tp * pp * cp):
            raise ValueError(
                f"world size {world} is not a multiple of tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp}"
            )
        if world % (etp * ep * pp):
            raise ValueError(
                f"world size {world} is not a multiple of expert_tensor_parallel_size x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = {etp} x {ep} x {pp}"
            )
        with cpu_compat.cuda_to_cpu():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
                context_parallel_size=cp,
            )
    _WORLD = dist.group.WORLD
    if _SEEDED is None:
        with cpu_compat.cuda_to_cpu():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        _SEEDED = seed


def reset_model_parallel() -> None:
    """Tear megatron's process groups down, so that the next backend of this process may use
    another layout (no backend built before may be used afterwards)."""
    global _SEEDED
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _SEEDED = None


@contextlib.contextmanager
def data_parallel_rng() -> Iterator[None]:
    """Inside: torch's default generator (CUDA's on a GPU) holds megatron's data-parallel RNG
    state, the same on every TP rank whatever region the caller is in (under sequence
    parallelism megatron runs the transformer block in the model-parallel state, which differs
    per TP rank); megatron's activation recompute restores it with the other tracked states."""
    from megatron.core.tensor_parallel import random as mrandom

    with tensor_parallel.get_cuda_rng_tracker().fork(mrandom.get_data_parallel_rng_tracker_name()):
        yield


def rng_tracker_states() -> dict[str, torch.Tensor] | None:
    """Megatron's named RNG states of this process (data-parallel, model-parallel, expert), for
    an exact resume; None where no megatron backend seeded them."""
    if _SEEDED is None:
        return None
    return {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Put back what `rng_tracker_states` returned (after the backend seeded the tracker)."""
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(states))


@contextlib.contextmanager
def virtual_pp(vpp: int | None) -> Iterator[None]:
    """Set megatron's global virtual-pipeline size (and rank 0) for the duration."""
    old_size = ps.get_virtual_pipeline_model_parallel_world_size()
    old_rank = ps.get_virtual_pipeline_model_parallel_rank()
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    ps.set_virtual_pipeline_model_parallel_rank(0 if vpp else None)
    try:
        yield
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(old_size)
        ps.set_virtual_pipeline_model_parallel_rank(old_rank)


def tp_group() -> dist.ProcessGroup:
    return ps.get_tensor_model_parallel_group()


def pp_group() -> dist.ProcessGroup:
    return ps.get_pipeline_model_parallel_group()


def dp_group() -> dist.ProcessGroup:
    return ps.get_data_parallel_group()


def tp_cp_group() -> dist.ProcessGroup:
    """Tensor x context-parallel ranks: together they hold one micro-batch's tokens (SP, CP)."""
    return ps.get_tensor_and_context_parallel_group()


def cp_group() -> dist.ProcessGroup:
    return ps.get_context_parallel_group()


def cp_rank() -> int:
    return ps.get_context_parallel_rank()


def cp_size() -> int:
    return ps.get_context_parallel_world_size()


def ep_group() -> dist.ProcessGroup:
    return ps.get_expert_model_parallel_group()


def ep_rank() -> int:
    return ps.get_expert_model_parallel_rank()


def ep_size() -> int:
    return ps.get_expert_model_parallel_world_size()


def etp_group() -> dist.ProcessGroup:
    return ps.get_expert_tensor_parallel_group()


def etp_rank() -> int:
    return ps.get_expert_tensor_parallel_rank()


def etp_size() -> int:
    return ps.get_expert_tensor_parallel_world_size()


def tp_rank() -> int:
    return ps.get_tensor_model_parallel_rank()


def pp_rank() -> int:
    return ps.get_pipeline_model_parallel_rank()


def pp_ranks() -> list[int]:
    """Global ranks of this rank's pipeline group, by stage."""
    return dist.get_process_group_ranks(pp_group())


def is_last_stage() -> bool:
    return pp_rank() == ps.get_pipeline_model_parallel_world_size() - 1


def device() -> torch.device:
    """This rank's device: the current CUDA device, or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
