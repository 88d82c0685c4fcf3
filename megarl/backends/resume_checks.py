"""What both backends check before loading a checkpoint into a backend: that it holds a model
of a compatible role and the same LoRA adapters as this run."""

from __future__ import annotations

from typing import Any

from megarl.backends.protocol import LM_ROLES
from megarl.errors import UserInputError


def check_role_and_adapters(directory: str, meta: dict[str, Any], role: str, mine: Any,
                            theirs: Any) -> None:
    """Refuse to load checkpoint ``directory`` (its ``megarl_meta.json`` is ``meta``) into a
    backend of ``role`` when it holds another role's model (any two LM roles are
    interchangeable) or when its LoRA settings ``theirs`` differ from this run's ``mine``
    (both as `megarl.models.lora.settings_meta` writes them; None without LoRA)."""
    if meta.get("role") != role and not {meta.get("role"), role} <= set(LM_ROLES):
        raise ValueError(
            f"checkpoint {directory} holds a {meta.get('role')} model; this backend is a "
            f"{role}"
        )
    if theirs != mine:
        raise UserInputError(
            f"checkpoint {directory} holds LoRA adapters {theirs}; this run's are "
            f"{mine}: resume with the checkpoint's actor_rollout_ref.model.lora_rank, "
            "lora_alpha, target_modules and exclude_modules")
