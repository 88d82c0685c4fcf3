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

from typing import Any

import torch

# Dense peak TFLOP/s per device name fragment (bf16 / fp16 tensor cores, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0,
               "A800": 312.0, "L40S": 362.0, "A10": 125.0, "B200": 2250.0}


def dense_params(cfg: Any) -> int:
    """Matmul weights of a Llama / Qwen-style decoder (attention, gated MLP, lm_head)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * cfg.intermediate_size
    return layers * (attn + mlp) + h * cfg.vocab_size


def train_flops(cfg: Any, seq_lens: list[int]) -> float:
    """FLOPs of one forward + backward over sequences of ``seq_lens`` tokens."""
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    attn = 12 * sum(s * s for s in seq_lens) * hd * heads * cfg.num_hidden_layers
    return 6 * dense_params(cfg) * sum(seq_lens) + attn


def peak_flops(device: torch.device) -> float | None:
    """The dense peak FLOP/s of ``device``, or None where unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def mfu(cfg: Any, seq_lens: list[int], passes: int, seconds: float, devices: int,
        peak: float | None) -> float | None:
    """``passes`` forward + backward sweeps over ``seq_lens`` (all ranks) in ``seconds`` on
    ``devices`` devices of ``peak`` FLOP/s each, as a fraction of their peak."""
    if peak is None or seconds <= 0:
        return None
    return passes * train_flops(cfg, seq_lens) / seconds / (peak * devices)
