"""Router statistics of a mixture-of-experts forward: the load-balancing loss and the metrics
MoE RL runs watch (per-layer expert load, router entropy).

Inputs are the router logits recorded by `megarl.models.moe.capture_router_logits`
(``{layer index: [N, E]}``, N = tokens of the call) and an optional token mask [N] (or any
shape with N elements: the ``[B, T]`` attention mask / a packed row's real-token mask), so
padding is neither counted nor penalised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def _flat_mask(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    mask = mask.reshape(-1).to(device=device, dtype=torch.float32)
    if mask.numel() != n:
        raise ValueError(f"token mask has {mask.numel()} entries, the router logits {n} rows")
    return mask


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss as transformers' ``load_balancing_loss_func`` (the
    ``aux_loss`` of Qwen3MoeForCausalLM; the training loss adds ``router_aux_loss_coef`` x it).

    Over all layers' tokens together (a token counted once per layer):
    ``E * sum_e f_e * P_e`` with f_e = (top-k assignments to expert e) / tokens (so sum_e f_e
    = k) and P_e = the mean router probability of e. Uniform routing gives k; the gradient
    flows through P only. router_logits: one [N, E] per sparse layer. Returns a 0-dim fp32
    tensor."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        w = _flat_mask(mask, logits.shape[0], device)
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts.index_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * w[:, None]).sum(0)
        rows = rows + w.sum()
    return num_experts * ((counts / rows) * (prob_sum / rows)).sum()


def expert_load(router_logits: torch.Tensor, top_k: int, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Tokens routed to each expert [E] (float32; a token counts once for each of its k
    experts; masked tokens not at all). router_logits [N, E]."""
    n, e = router_logits.shape
    w = _flat_mask(mask, n, router_logits.device)
    probs = torch.softmax(router_logits.detach().float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # the experts `moe.route` picks
    return torch.zeros(e, device=router_logits.device).index_add(
        0, chosen.reshape(-1), w.repeat_interleave(top_k)
    )


def router_entropy(router_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over (unmasked) tokens of the entropy, in nats, of the router's softmax over all E
    experts (log E: uniform; 0: one expert takes all the mass). 0-dim fp32."""
    w = _flat_mask(mask, router_logits.shape[0], router_logits.device)
    logp = torch.log_softmax(router_logits.detach().float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return (ent * w).sum() / w.sum().clamp(min=1.0)


def routing_metrics(
    router_logits: Mapping[int, torch.Tensor],
    num_experts: int,
    top_k: int,
    mask: torch.Tensor | None = None,
    *,
    prefix: str = "moe/",
) -> dict[str, float]:
    """Per-layer and summary routing metrics of one forward:

    ``{prefix}layer_{i}/load_max``, ``load_mean``: tokens of the busiest expert and the mean
    over experts (= tokens * k / E); ``{prefix}layer_{i}/entropy``: `router_entropy`;
    ``{prefix}load_imbalance``: max over layers of load_max / load_mean (1 = balanced, E / k =
    every token on the same k experts); ``{prefix}router_entropy``: mean over layers;
    ``{prefix}aux_loss``: `load_balancing_loss` over all layers."""
    out: dict[str, float] = {}
    imbalance, entropies = [], []
    for i in sorted(router_logits):
        logits = router_logits[i]
        load = expert_load(logits, top_k, mask)
        ent = float(router_entropy(logits, mask))
        mean = float(load.mean())
        out[f"{prefix}layer_{i}/load_max"] = float(load.max())
        out[f"{prefix}layer_{i}/load_mean"] = mean
        out[f"{prefix}layer_{i}/entropy"] = ent
        imbalance.append(float(load.max()) / mean if mean > 0 else 0.0)
        entropies.append(ent)
    if router_logits:
        out[f"{prefix}load_imbalance"] = max(imbalance)
        out[f"{prefix}router_entropy"] = sum(entropies) / len(entropies)
        aux = load_balancing_loss([t.detach() for t in router_logits.values()], num_experts,
                                  top_k, mask)
        out[f"{prefix}aux_loss"] = float(aux)
    return out
