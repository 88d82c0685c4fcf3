"""LoRA on the torch backend: the actor's adapters from the config (`lora_settings`, also read
by the megatron backend) and on the model (`apply_actor_lora`); the reference role of a LoRA run
is `megarl.backends.torch.lora_ref`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from megarl.errors import UserInputError
from megarl.models.lora import (
    LORA_INITS,
    LoraSettings,
    adapter_settings,
    apply_lora,
    load_adapter_into,
)
from megarl.models.model import Transformer

if TYPE_CHECKING:
    from megarl.backends.torch.layout import Layout

logger = logging.getLogger(__name__)
_M = "actor_rollout_ref.model"


def _listed(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else list(value)


def lora_settings(cfg: Any) -> LoraSettings | None:
    """The actor's LoRA adapters from ``actor_rollout_ref.model.{lora_rank, lora_alpha,
    target_modules, exclude_modules, lora_A_init_method, lora_B_init_method,
    lora_adapter_path}``; None when ``lora_rank`` is 0 and no ``lora_adapter_path`` is set.
    With ``lora_adapter_path`` the adapter folder gives rank, alpha and modules
    (`megarl.models.lora.adapter_settings`)."""
    m = cfg.actor_rollout_ref.model
    rank = getattr(m, "lora_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UserInputError(f"{_M}.lora_rank={rank!r}: expected a whole number >= 0 (0 = no "
                             "LoRA; e.g. 8, 16, 32, 64)")
    path = getattr(m, "lora_adapter_path", None)
    if rank == 0 and not path:
        return None
    alpha = m.lora_alpha
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise UserInputError(f"{_M}.lora_alpha={alpha!r}: expected a number > 0 (the adapters' "
                             "update is scaled by lora_alpha / lora_rank)")
    inits = {}
    for key, field_name in (("lora_A_init_method", "init_a"), ("lora_B_init_method", "init_b")):
        value = getattr(m, key, "kaiming" if field_name == "init_a" else "zero")
        if value not in LORA_INITS:
            raise UserInputError(f"{_M}.{key}={value!r}: expected one of "
                                 f"{', '.join(LORA_INITS)}")
        inits[field_name] = value
    if path:
        return adapter_settings(path, rank, float(alpha))
    return LoraSettings(rank=rank, alpha=float(alpha), target_modules=_listed(m.target_modules),
                        exclude_modules=_listed(m.exclude_modules), **inits)


def apply_actor_lora(model: Transformer, lora: LoraSettings, layout: Layout, seed: int) -> None:
    """`apply_lora` on the actor's loaded (not yet parallelised) model: A (and B) drawn from
    ``seed`` (the same on every rank) by ``lora.init_a`` / ``init_b``, or read from
    ``lora.adapter_path`` (a PEFT folder); the base frozen. Refused: tensor parallelism (its
    plan shards the base linears, not the adapters) and mixture-of-experts models."""
    if layout.tp > 1:
        raise UserInputError(
            "actor_rollout_ref.model.lora_rank > 0 with actor_rollout_ref.actor.parallel."
            f"tensor_model_parallel_size={layout.tp}: LoRA on the torch backend runs with FSDP, "
            "pipeline and Ulysses parallelism, not tensor parallelism; set "
            "tensor_model_parallel_size=1")
    if model.args.is_moe:
        raise UserInputError(
            "actor_rollout_ref.model.lora_rank > 0 with a mixture-of-experts policy "
            f"({model.args.model_type}): LoRA is implemented for dense models only (PEFT adapts "
            "transformers' fused expert tensors, which megarl's per-expert layers do not "
            "match); set lora_rank=0 or use a dense model")
    gen = torch.Generator().manual_seed(seed)
    names = apply_lora(model, lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules,
                       lora.dropout, generator=gen, init_a=lora.init_a, init_b=lora.init_b)
    if lora.adapter_path:
        load_adapter_into(model, lora.adapter_path)
        logger.info("LoRA adapters start from %s", lora.adapter_path)
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA rank %d on %d modules: %d trainable parameters of %d (%.3f%%)",
                lora.rank, len(names), adapter, total, 100.0 * adapter / total)
