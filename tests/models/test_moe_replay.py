"""Routing replay of the MoE block (the ``routing`` argument of the model's forward /
`moe.record_experts`).

Reference: a float64 loop over tokens written from the definition (softmax of the router logits
over all E experts, the probabilities at the replayed experts, divided by their sum when
``norm_topk_prob``, the weighted sum of those experts' SwiGLU outputs, plus the gated shared
expert); gradients of the router and experts by autograd through that loop. A token whose
replayed row is -1 is routed by the router's own top-k. Bound 1e-6: the model runs in float64
but its router probabilities and their renormalisation are computed in fp32 whatever the model
dtype (as transformers' router), measured 5.4e-8. Replaying the
experts a forward recorded reproduces the plain forward bitwise (fp32 logits and gradients).

Planted bugs (run by hand): replayed weights taken from the router's own top-k values instead
of the probabilities at the replayed experts: output off by 0.31 (qwen3_moe) / 0.36
(qwen2_moe); renormalisation skipped under ``norm_topk_prob``: qwen3_moe off by 0.44; the
replayed weights detached (no router gradient): router gradient off by 1.2 / 0.89 relative, and
the replay-of-own-choices gradients no longer bitwise; -1 rows replayed as expert 0 instead of
routed: off by 0.74 / 0.53. Each fails below.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.models import load_model
from megarl.models.moe import (
    MoEBlock,
    moe_blocks,
    record_experts,
    routing_dtype,
    stack_layers,
)

FAMILIES = ("qwen3_moe", "qwen2_moe")
TOL = 1e-6


def swiglu64(m, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight),
                    m.down_proj.weight)


def reference_block(block: MoEBlock, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """float64 loop: x [N, H], experts [N, k] (-1 rows: the router's top-k) -> [N, H]."""
    rows = []
    for n in range(x.shape[0]):
        xn = x[n]
        probs = torch.softmax(F.linear(xn, block.gate.weight), -1)
        chosen = experts[n].tolist()
        if min(chosen) < 0:
            chosen = sorted(range(block.num_experts), key=lambda e: -float(probs[e].detach()))
            chosen = chosen[: block.top_k]
        w = probs[chosen]
        if block.norm_topk_prob:
            w = w / w.sum()
        y = sum(w[j] * swiglu64(block.experts[e], xn) for j, e in enumerate(chosen))
        if block.shared_expert is not None:
            gate = torch.sigmoid(F.linear(xn, block.shared_expert_gate.weight))
            y = y + gate * swiglu64(block.shared_expert, xn)
        rows.append(y)
    return torch.stack(rows)


def random_experts(n: int, num_experts: int, k: int, seed: int, none_rows=()) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(n)])
    out[list(none_rows)] = -1
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_block_matches_float64_reference(hf_folder, family):
    """Output and router / expert gradients of a replayed block equal the float64 loop."""
    model = load_model(hf_folder(family), dtype=torch.float64)
    block = moe_blocks(model)[0]
    k, E = block.top_k, block.num_experts
    x = torch.randn(2, 7, model.args.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    experts = random_experts(14, E, k, seed=2, none_rows=(3, 10))
    got = block(x, experts.view(2, 7, k).to(torch.int16))
    got.pow(2).sum().backward()
    got_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    want = reference_block(block, x.reshape(14, -1), experts)
    want.pow(2).sum().backward()
    assert (got.reshape(14, -1) - want).abs().max() <= TOL
    for name, p in block.named_parameters():
        scale = max(1.0, float(p.grad.abs().max()))  # router grads reach ~5
        assert (got_grads[name] - p.grad).abs().max() / scale <= TOL, name
    assert block.gate.weight.grad.abs().max() > 1e-3  # the router is trained through replay
    # the replay really differs from what the router would choose
    with torch.no_grad():
        plain = block(x).reshape(14, -1)
    assert (plain - want).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_recorded_experts_is_bitwise_the_plain_forward(hf_folder, family):
    """fp32, 2 sparse layers: record the experts of a forward, replay them: logits and every
    gradient are bitwise those of the plain forward."""
    ids = torch.randint(3, 128, (3, 11), generator=torch.Generator().manual_seed(4))
    runs = []
    for replay in (False, True):
        model = load_model(hf_folder(family))
        with record_experts(model) as chosen:
            plain = model(ids).detach()
        routing = stack_layers(chosen, model.args)
        assert routing.shape == (33, 2, 2) and routing.dtype == routing_dtype(4)
        if replay:
            logits = model(ids, routing=routing.view(3, 11, 2, 2))
            logits.logsumexp(-1).sum().backward()
            assert torch.equal(logits.detach(), plain)
        else:
            logits = model(ids)
            logits.logsumexp(-1).sum().backward()
        runs.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_checkpointed_recompute_replays_the_same_experts(hf_folder):
    """Under activation checkpointing the recompute in backward gets the same ``routing`` (it is
    an argument of each layer's call): logits and every gradient are bitwise those of the
    model without checkpointing, on random experts with -1 rows; the routing really changes
    the result. Planted: the checkpointed call not passing the routing (forward and recompute
    routed by the router): the logits differ, fails."""
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(8))
    routing = torch.stack([random_experts(18, 4, 2, seed=s) for s in (9, 10)], dim=1)
    routing[::4] = -1
    routing = routing.view(2, 9, 2, 2)
    runs = []
    for checkpointing in (False, True):
        model = load_model(hf_folder("qwen3_moe"), activation_checkpointing=checkpointing)
        model.train()
        logits = model(ids, routing=routing)
        logits.logsumexp(-1).sum().backward()
        runs.append((logits.detach(),
                     {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys()
    for name in runs[0][1]:
        assert torch.equal(runs[0][1][name], runs[1][1][name]), name
    plain = load_model(hf_folder("qwen3_moe"))(ids).detach()
    assert (plain - runs[1][0]).abs().max() > 1e-2


def test_record_under_replay_reports_the_replayed_experts(hf_folder):
    model = load_model(hf_folder("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    routing = torch.stack([random_experts(6, 4, 2, seed=s) for s in (6, 7)], dim=1)
    with torch.no_grad(), record_experts(model) as chosen:
        model(ids, routing=routing.view(1, 6, 2, 2))
    assert torch.equal(stack_layers(chosen, model.args).long(), routing)


def test_bad_routing_is_refused(hf_folder):
    model = load_model(hf_folder("qwen3_moe"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"routing must be \[B, T, n_sparse=2, k=2\] = "
                                             r"\[1, 4, 2, 2\] for this forward, got \[1, 4, 3, 2\]"):
            model(ids, routing=torch.zeros(1, 4, 3, 2, dtype=torch.long))
        with pytest.raises(ValueError, match=r"got \[1, 5, 2, 2\]"):
            model(ids, routing=torch.zeros(1, 5, 2, 2, dtype=torch.long))
        with pytest.raises(ValueError, match=r"expert ids outside \[-1, 4\): \[4, 4\]"):
            model(ids, routing=torch.full((1, 4, 2, 2), 4, dtype=torch.long))
        with pytest.raises(ValueError, match="integer expert ids"):
            model(ids, routing=torch.zeros(1, 4, 2, 2))
        with pytest.raises(ValueError, match=r"layer 0: replayed experts have shape \(5, 2\)"):
            moe_blocks(model)[0](torch.zeros(1, 4, model.args.hidden_size),
                                 torch.zeros(1, 5, 2, dtype=torch.long))
        dense = load_model(hf_folder("qwen3"))
        with pytest.raises(ValueError, match="sparse"):
            dense(ids, routing=torch.zeros(1, 4, 0, 2, dtype=torch.long))
