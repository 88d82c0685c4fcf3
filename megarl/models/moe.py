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

Routing replay (rollout routing replay, "R3"): `record_experts` returns the experts each token
chose in every sparse layer of a forward (what a rollout engine reports); the ``routing`` argument
of `megarl.models.model.Transformer.forward` (checked by `check_routing`) makes a forward use
given experts instead of the router's top-k. A replayed token's weights are
the router's softmax probabilities at the given experts (divided by their sum when
``norm_topk_prob``), so the router still gets a gradient through them (verl's megatron router
replay and the R3 paper gather the router scores at the replayed indices the same way). A row of
-1 (padding, or a token the engine never ran) is routed by the router as usual. Replaying the
experts a forward chose itself reproduces that forward bitwise (the same probabilities are
gathered and summed in the same order).

Routing tensors are laid out ``[..., n_sparse, k]``: one ``k``-vector of expert ids per sparse
layer, layers in ascending index (`sparse_layers`), dtype `routing_dtype` (int16; -1 = none).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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


def replay_route(
    router_logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool
) -> torch.Tensor:
    """Weights [N, k] (the logits' dtype) of the given ``experts`` [N, k] (ids in [0, E)): the
    fp32 softmax of ``router_logits`` [N, E] gathered at ``experts``, divided by their sum when
    ``norm_topk_prob`` (differentiable in the logits)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


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
        # `record_experts` state, not parameters
        self.recorded: dict[int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, t, h] -> [b, t, h]. replay: [b, t, k] experts for this call instead of the
        router's top-k (-1 rows: the router decides)."""
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        logits = self.gate(flat)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        if replay is not None:
            weights, experts = self._replayed(replay.reshape(-1, replay.shape[-1]), logits,
                                              weights, experts)
        if self.recorded is not None:
            self.recorded[self.layer_idx] = experts.detach()
        out = run_experts(flat, weights, experts, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(b, t, h)

    def _replayed(self, given: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(given.shape) != tuple(experts.shape):
            raise ValueError(
                f"layer {self.layer_idx}: replayed experts have shape {tuple(given.shape)}, the "
                f"call routes {tuple(experts.shape)} (tokens x top_k); record and replay the same "
                "tokens"
            )
        given = given.to(device=experts.device, dtype=torch.long)
        have = (given >= 0).all(-1, keepdim=True)
        given = torch.where(have, given, experts)
        return torch.where(have, replay_route(logits, given, self.norm_topk_prob), weights), given

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, experts={self.num_experts}, top_k={self.top_k}"


def sparse_layers(args: ModelArgs) -> list[int]:
    """Indices of the model's sparse (MoE) layers, ascending: the layer axis of routing tensors."""
    return [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]


def routing_dtype(num_experts: int) -> torch.dtype:
    """dtype of routing tensors: int16 (expert ids and the -1 of "none")."""
    if num_experts > torch.iinfo(torch.int16).max:
        raise ValueError(f"{num_experts} experts do not fit the int16 routing tensors")
    return torch.int16


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


@contextmanager
def record_experts(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Record the experts [N, k] (int64, N = B * T tokens of the call, row-major) every sparse
    layer uses while the block runs: ``{layer index: experts}``, overwritten by each forward.
    Under replay (a ``routing`` argument) these are the replayed experts.

        with record_experts(model) as chosen:
            model(input_ids)
        routing = stack_layers(chosen, args)        # [B * T, n_sparse, k]
    """
    captured: dict[int, torch.Tensor] = {}
    blocks = list(moe_blocks(model).values())
    for block in blocks:
        block.recorded = captured
    try:
        yield captured
    finally:
        for block in blocks:
            block.recorded = None


def stack_layers(chosen: Mapping[int, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """``{layer index: [N, k]}`` of `record_experts` -> [N, n_sparse, k] in `routing_dtype`."""
    layers = sparse_layers(args)
    missing = [i for i in layers if i not in chosen]
    if missing:
        raise ValueError(f"no experts recorded for sparse layers {missing}")
    return torch.stack([chosen[i] for i in layers], dim=1).to(routing_dtype(args.num_experts))


def check_routing(args: ModelArgs, routing: torch.Tensor, tokens: tuple[int, int]) -> None:
    """Refuse a ``routing`` argument that does not fit a forward of ``tokens`` = (B, T): it must
    be [B, T, n_sparse, k] integer expert ids (all sparse layers of the model, as
    `sparse_layers`; a pipeline stage reads its own layers' entries), each -1 or in
    [0, num_experts)."""
    n, k = len(sparse_layers(args)), args.num_experts_per_tok
    if not n:
        raise ValueError("a routing argument needs a model with sparse (MoE) layers")
    if tuple(routing.shape) != (*tokens, n, k):
        raise ValueError(f"routing must be [B, T, n_sparse={n}, k={k}] = "
                         f"{[*tokens, n, k]} for this forward, got {list(routing.shape)}")
    if routing.dtype.is_floating_point:
        raise ValueError(f"routing must hold integer expert ids, got {routing.dtype}")
    if routing.numel() and (int(routing.min()) < -1 or int(routing.max()) >= args.num_experts):
        raise ValueError(
            f"routing holds expert ids outside [-1, {args.num_experts}): "
            f"[{int(routing.min())}, {int(routing.max())}]"
        )
