"""Mixture-of-experts feed-forward block (Qwen3-MoE; Qwen2-MoE with its shared expert).

One sparse layer's ``mlp`` holds, under the names of the published HF checkpoints:

    mlp.gate.weight                          [E, H]   router
    mlp.experts.{j}.{gate,up,down}_proj.weight        expert j, a SwiGLU MLP of width
                                                      moe_intermediate_size
    mlp.shared_expert.{gate,up,down}_proj.weight      Qwen2-MoE only
    mlp.shared_expert_gate.weight            [1, H]   Qwen2-MoE only

Routing follows transformers' Qwen3MoeTopKRouter: softmax of the router logits in fp32, the top
``k`` probabilities, divided by their sum when ``norm_topk_prob``, cast to the activation
dtype. Each token's output is the probability-weighted sum of its k experts (no capacity limit,
no token dropping: the result of a token never depends on the other tokens in the batch, so
packing and padding do not change it). Every expert runs on every call, with zero tokens when
none chose it, so every parameter gets a gradient (zeros) and sharded data-parallel ranks
always reduce the same set of gradients.

`capture_router_logits` records each sparse layer's router logits during a forward, for the
load-balancing loss and the routing metrics in `megarl.models.moe_metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.args import ModelArgs


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (an expert or a shared expert)."""

    def __init__(self, hidden: int, inner: int, *, bias: bool = False, dtype=None, device=None):
        super().__init__()
        fk = {"dtype": dtype, "device": device, "bias": bias}
        self.gate_proj = nn.Linear(hidden, inner, **fk)
        self.up_proj = nn.Linear(hidden, inner, **fk)
        self.down_proj = nn.Linear(inner, hidden, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int64).

    softmax in fp32, top-k (ties: torch.topk's order, as transformers), optional division by
    the k probabilities' sum."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def run_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, modules: nn.ModuleList
) -> torch.Tensor:
    """x [N, H], weights / experts [N, k] -> sum_k weights[n, k] * expert_{experts[n, k]}(x[n]).

    Tokens are grouped by expert with one stable sort; contributions are added to each token
    in ascending expert order (as transformers' loop over experts)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(modules)).tolist()
    token = order // k
    chunks = x[token].split(counts)
    y = torch.cat([expert(chunk) for expert, chunk in zip(modules, chunks, strict=True)])
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


class MoEBlock(nn.Module):
    """The sparse ``mlp`` of one layer (see module docstring): x [B, T, H] -> [B, T, H]."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        fk = {"dtype": dtype, "device": device}
        h = args.hidden_size
        self.layer_idx = layer_idx
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(h, args.num_experts, bias=False, **fk)
        self.experts = nn.ModuleList(
            SwiGLU(h, args.moe_intermediate_size, **fk) for _ in range(args.num_experts)
        )
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if args.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(h, args.shared_expert_intermediate_size, **fk)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        weights, experts = route(self.gate(flat), self.top_k, self.norm_topk_prob)
        out = run_experts(flat, weights, experts, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(b, t, h)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, experts={self.num_experts}, top_k={self.top_k}"


def moe_blocks(model: nn.Module) -> dict[int, MoEBlock]:
    """{layer index: MoEBlock} of the sparse layers present in ``model`` (a pipeline stage
    holds only its own)."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, MoEBlock)}


@contextmanager
def capture_router_logits(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Record the router logits [N, E] (N = B * T tokens of the call, row-major) of every sparse
    layer while the block runs: ``{layer index: logits}``, overwritten by each forward (also by
    an activation-checkpointing recompute, which gives the same values). The tensors keep their
    graph, so a loss built from them (`moe_metrics.load_balancing_loss`) trains the routers.

        with capture_router_logits(model) as router_logits:
            logits = model(input_ids)
        aux = load_balancing_loss(list(router_logits.values()), E, k)
    """
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for idx, block in moe_blocks(model).items():

        def hook(module, inputs, output, idx=idx):
            captured[idx] = output.to_local() if hasattr(output, "to_local") else output

        handles.append(block.gate.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
