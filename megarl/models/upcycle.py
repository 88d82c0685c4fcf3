"""Sparse upcycling (Komatsuzaki et al., 2022): a dense Qwen2 checkpoint turned into a Qwen2-MoE
one that computes the same function, so a mixture-of-experts policy starts where a trained
dense one stands.

Every decoder layer's MLP becomes a sparse block (`megarl.models.moe`) of ``num_experts``
routed experts, top-``k`` with ``norm_topk_prob`` (the k weights sum to 1), and a shared
expert whose sigmoid gate starts at 0 (factor 1/2):

    routed expert j   = the dense MLP, down_proj x 1/2 (x (1 + noise) where asked)
    shared expert     = the dense MLP, down_proj unchanged; shared_expert_gate = 0
    router (mlp.gate) = N(0, router_std)

so ``out = sum_k w_k * MLP(x)/2 + sigmoid(0) * MLP(x) = MLP(x)``: with ``noise=0`` the upcycled
model's logits equal the dense model's up to float rounding, whatever the router chooses.
``noise > 0`` multiplies each routed expert's weights by ``1 + noise * N(0, 1)`` (independent
per expert) so that experts differ and the router's choice, and its gradient, matter from the
first update. Attention, norms, embeddings and the head are copied unchanged (Qwen2 and
Qwen2-MoE share them, q/k/v biases included).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

_MLP = re.compile(r"^(model\.layers\.\d+\.mlp)\.(gate_proj|up_proj|down_proj)\.weight$")


def upcycle_qwen2_config(dense: dict[str, Any], num_experts: int, top_k: int) -> dict[str, Any]:
    """The Qwen2-MoE config.json dict of an upcycled dense Qwen2 ``dense`` config: every layer
    sparse, experts and shared expert as wide as the dense MLP."""
    if dense.get("model_type") != "qwen2":
        raise ValueError(f"upcycling takes a qwen2 config, got model_type="
                         f"{dense.get('model_type')!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    cfg = copy.deepcopy(dense)
    width = int(dense["intermediate_size"])
    cfg.update(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=num_experts,
        num_experts_per_tok=top_k, norm_topk_prob=True, moe_intermediate_size=width,
        shared_expert_intermediate_size=width, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, router_aux_loss_coef=0.001, qkv_bias=True,
    )
    return cfg


def upcycle_qwen2_state(dense: dict[str, torch.Tensor], config: dict[str, Any], *,
                        noise: float = 0.0, router_std: float = 0.02,
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named Qwen2-MoE weights from HF-named dense Qwen2 weights (module doc).

    dense: ``{name: tensor}`` of Qwen2ForCausalLM; config: `upcycle_qwen2_config`'s result.
    noise: relative per-expert weight noise (0: exactly the dense function).
    """
    if noise < 0 or router_std < 0:
        raise ValueError(f"noise and router_std must be >= 0, got {noise}, {router_std}")
    gen = torch.Generator().manual_seed(seed)
    experts, hidden = int(config["num_experts"]), int(config["hidden_size"])
    out: dict[str, torch.Tensor] = {}
    layers: set[str] = set()
    for name, tensor in dense.items():
        m = _MLP.match(name)
        if m is None:
            out[name] = tensor.clone()
            continue
        prefix, proj = m.groups()
        layers.add(prefix)
        out[f"{prefix}.shared_expert.{proj}.weight"] = tensor.clone()
        base = tensor * 0.5 if proj == "down_proj" else tensor
        for j in range(experts):
            w = base.clone()
            if noise:
                w = w * (1 + noise * torch.randn(w.shape, generator=gen, dtype=w.dtype))
            out[f"{prefix}.experts.{j}.{proj}.weight"] = w
    for prefix in sorted(layers):
        dtype = dense[f"{prefix}.gate_proj.weight"].dtype
        out[f"{prefix}.gate.weight"] = router_std * torch.randn(
            experts, hidden, generator=gen, dtype=dtype)
        out[f"{prefix}.shared_expert_gate.weight"] = torch.zeros(1, hidden, dtype=dtype)
    if len(layers) != int(config["num_hidden_layers"]):
        raise ValueError(f"found the MLP of {len(layers)} layers in the dense weights, expected "
                         f"{config['num_hidden_layers']}")
    return out
