"""How much memory an engine may take: free and total bytes of a device, and the KV-cache size
a model needs for a number of concurrent sequences. Shared by the torch and vLLM engines so
``rollout.gpu_memory_utilization`` means the same for both: a fraction of what is free when the
engine is built (on a GPU vLLM also caps it by its own reading of the device)."""

from __future__ import annotations

import math
from typing import Any

import torch


def device_memory(device: torch.device | str) -> tuple[int, int]:
    """(free, total) bytes of ``device`` now. CUDA: the driver's reading (memory held by every
    process counts as used). CPU: MemAvailable and MemTotal of /proc/meminfo (8 GiB of 16
    assumed where it cannot be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        kib = {k: int(v.split()[0]) for k, v in info.items() if k in ("MemAvailable", "MemTotal")}
        return kib["MemAvailable"] * 1024, kib["MemTotal"] * 1024
    except (OSError, KeyError, ValueError):
        return 8 * 2**30, 16 * 2**30


def kv_bytes_per_token(hf_config: dict[str, Any], dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of K and V for one token over all layers on one tensor-parallel rank of a
    decoder described by an HF ``config.json`` dict (GQA: ``num_key_value_heads``; KV heads
    are split over TP ranks, and replicated when there are fewer than ranks)."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    layers = hf_config["num_hidden_layers"]
    per_rank = max(1, math.ceil(kv_heads / tp_size))
    return 2 * layers * per_rank * head_dim * torch.empty(0, dtype=dtype).element_size()


def kv_bytes_for(
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    max_num_seqs: int,
    max_model_len: int,
    *,
    tp_size: int = 1,
    block_size: int = 128,
) -> int:
    """KV-cache bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens, each rounded
    up to whole blocks of ``block_size`` tokens (vLLM's CPU backend uses 128)."""
    blocks = math.ceil(max_model_len / block_size)
    return max_num_seqs * blocks * block_size * kv_bytes_per_token(hf_config, dtype, tp_size)
