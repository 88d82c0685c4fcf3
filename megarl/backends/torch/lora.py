"""LoRA on the torch backend: the actor's adapters (`megarl.trainer.settings.lora_settings`)
applied to the model (`apply_actor_lora`); the reference role of a LoRA run is
`megarl.backends.torch.lora_reference`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megarl.errors import UserInputError
from megarl.models.lora import LoraSettings, apply_lora, load_adapter_into
from megarl.models.model import Transformer

if TYPE_CHECKING:
    from megarl.backends.torch.layout import Layout

logger = logging.getLogger(__name__)


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
                       lora.dropout, generator=gen, init_a=lora.init_a, init_b=lora.init_b,
                       dropout_position=lora.dropout_position)
    if lora.adapter_path:
        load_adapter_into(model, lora.adapter_path)
        logger.info("LoRA adapters start from %s", lora.adapter_path)
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA rank %d on %d modules: %d trainable parameters of %d (%.3f%%)",
                lora.rank, len(names), adapter, total, 100.0 * adapter / total)
