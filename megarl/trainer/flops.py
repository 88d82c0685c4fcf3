"""Model FLOPs utilisation (perf/mfu/*) for dense decoders, as verl's FlopsCounter counts it.

Training FLOPs of one pass over sequences of lengths s_i (forward + backward = 3x forward):
  6 * N_dense * sum(s_i)                      every matmul weight, lm_head included, 2 FLOPs
                                              per multiply-add, x3
  + 12 * sum(s_i^2) * head_dim * heads * L    QK^T and PV (full, not causal-halved)
N_dense counts the attention projections, the MLP and the lm_head, not the embedding lookup.
MFU = achieved FLOP/s / the device's dense peak; only devices in PEAK_TFLOPS have one (a CPU
has none: no perf/mfu metric there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Dense peak TFLOP/s per device name fragment (bf16 / fp16 tensor cores, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0,
               "A800": 312.0, "L40S": 362.0, "A10": 125.0, "B200": 2250.0}


def _fields(cfg: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    """An HF config's fields: ``config.json`` as read by ``read_hf_config`` (a dict), or a
    transformers config / any object with the same attributes."""
    if isinstance(cfg, Mapping):
        return cfg
    return cfg.to_dict() if hasattr(cfg, "to_dict") else {
        k: getattr(cfg, k) for k in dir(cfg) if not k.startswith("_")}


def dense_params(cfg: Mapping[str, Any] | Any) -> int:
    """Matmul weights of a Llama / Qwen-style decoder (attention, gated MLP, lm_head)."""
    f = _fields(cfg)
    h, layers, heads = f["hidden_size"], f["num_hidden_layers"], f["num_attention_heads"]
    kv = f.get("num_key_value_heads") or heads
    hd = f.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * f["intermediate_size"]
    return layers * (attn + mlp) + h * f["vocab_size"]


def train_flops(cfg: Mapping[str, Any] | Any, seq_lens: list[int]) -> float:
    """FLOPs of one forward + backward over sequences of ``seq_lens`` tokens (``cfg``: the HF
    config, as ``config.json``'s dict or a config object)."""
    f = _fields(cfg)
    heads = f["num_attention_heads"]
    hd = f.get("head_dim") or f["hidden_size"] // heads
    attn = 12 * sum(s * s for s in seq_lens) * hd * heads * f["num_hidden_layers"]
    return 6 * dense_params(f) * sum(seq_lens) + attn


def peak_flops(device: torch.device) -> float | None:
    """The dense peak FLOP/s of ``device``, or None where unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def mfu(cfg: Mapping[str, Any] | Any, seq_lens: list[int], passes: int, seconds: float, devices: int,
        peak: float | None) -> float | None:
    """``passes`` forward + backward sweeps over ``seq_lens`` (all ranks) in ``seconds`` on
    ``devices`` devices of ``peak`` FLOP/s each, as a fraction of their peak."""
    if peak is None or seconds <= 0:
        return None
    return passes * train_flops(cfg, seq_lens) / seconds / (peak * devices)
