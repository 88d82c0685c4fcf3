"""Routing metrics against brute-force Python loops (float64) and transformers' aux loss.

Planted bugs (run by hand): counting only each token's first choice gives load_mean = N / E
instead of N * k / E (fails the load test); the entropy without the mask averages padding rows
in (off by 0.125 on the masked case); load_imbalance as the mean instead of the max over layers
gives 1.55 instead of 2.0 (balanced layer 1.1, skewed 2.0).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from megarl.models.moe_metrics import (
    expert_load,
    load_balancing_loss,
    router_entropy,
    routing_metrics,
)


def brute_counts(logits: torch.Tensor, k: int, mask: list[int]) -> list[int]:
    """Per expert, how many unmasked tokens have it among their k largest logits."""
    e = logits.shape[1]
    counts = [0] * e
    for n, row in enumerate(logits.tolist()):
        if not mask[n]:
            continue
        ranked = sorted(range(e), key=lambda j: -row[j])
        for j in ranked[:k]:
            counts[j] += 1
    return counts


def brute_entropy(logits: torch.Tensor, mask: list[int]) -> float:
    total, rows = 0.0, 0
    for n, row in enumerate(logits.tolist()):
        if not mask[n]:
            continue
        z = sum(math.exp(v) for v in row)
        total += -sum(math.exp(v) / z * (v - math.log(z)) for v in row)
        rows += 1
    return total / rows


@pytest.mark.parametrize("masked", [False, True])
def test_load_and_entropy_match_brute_force(masked):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 6, generator=gen) * 2
    mask = (torch.rand(37, generator=gen) > 0.3).long() if masked else torch.ones(37).long()
    m = mask.tolist()
    load = expert_load(logits, 2, mask if masked else None)
    assert load.tolist() == [float(c) for c in brute_counts(logits, 2, m)]
    assert float(load.sum()) == 2 * sum(m)
    ent = router_entropy(logits, mask if masked else None)
    assert abs(float(ent) - brute_entropy(logits, m)) < 1e-6


def test_routing_metrics_keys_and_values():
    gen = torch.Generator().manual_seed(1)
    balanced = torch.randn(40, 4, generator=gen) * 0.01
    skewed = torch.randn(40, 4, generator=gen) * 0.01
    skewed[:, 0] += 5.0
    skewed[:, 1] += 4.0  # every token picks experts 0 and 1
    out = routing_metrics({1: balanced, 3: skewed}, num_experts=4, top_k=2)
    assert out["moe/layer_3/load_max"] == 40 and out["moe/layer_3/load_mean"] == 20
    assert out["moe/layer_1/load_mean"] == 20
    assert out["moe/load_imbalance"] == 2.0  # E / k: all tokens on the same two experts
    assert abs(out["moe/layer_1/entropy"] - math.log(4)) < 1e-3
    expected = (out["moe/layer_1/entropy"] + out["moe/layer_3/entropy"]) / 2
    assert abs(out["moe/router_entropy"] - expected) < 1e-9
    ref = load_balancing_loss_func((balanced, skewed), 4, 2)
    assert abs(out["moe/aux_loss"] - float(ref)) < 1e-6


@pytest.mark.parametrize("k", [1, 2, 3])
def test_aux_loss_matches_transformers_with_mask(k):
    gen = torch.Generator().manual_seed(k)
    layers = tuple(torch.randn(2 * 9, 5, generator=gen) for _ in range(3))
    mask = (torch.rand(2, 9, generator=gen) > 0.25).long()
    ours = load_balancing_loss(list(layers), 5, k, mask)
    ref = load_balancing_loss_func(layers, 5, k, mask)
    assert abs(float(ours) - float(ref)) < 1e-6
    # uniform routing probabilities give exactly k
    flat = [torch.zeros(8, 5)]
    assert abs(float(load_balancing_loss(flat, 5, k)) - k) < 1e-6
