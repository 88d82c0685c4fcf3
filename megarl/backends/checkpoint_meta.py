"""``megarl_meta.json``: the small JSON file beside a backend checkpoint's tensors that names its
format (one per backend) and what the writer knew (role, layout, step, optimizer present);
and what both backends check in it before loading (`check_role_and_adapters`).

It is written last, fsynced and renamed into place, so a directory with a readable meta file
holds a complete checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megarl.backends.protocol import LM_ROLES
from megarl.errors import UserInputError
from megarl.models.lora import adapter_identity

META_NAME = "megarl_meta.json"


def write_meta(directory: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Atomically write ``meta`` as ``directory/megarl_meta.json`` (temp file, fsync, rename)."""
    directory = Path(directory)
    tmp = directory / (META_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / META_NAME)


def read_meta(directory: str | os.PathLike, fmt: str, kind: str, how_to_write: str
              ) -> dict[str, Any]:
    """The meta of a checkpoint of format ``fmt``; a clear error when the directory is not a
    ``kind`` checkpoint (no meta file: ``how_to_write`` says how to make one) or another format."""
    file = Path(directory) / META_NAME
    if not file.is_file():
        raise FileNotFoundError(
            f"{directory} is not a megarl {kind} checkpoint (no {META_NAME}); write one with "
            f"{how_to_write}"
        )
    with open(file, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != fmt:
        raise ValueError(f"{file}: unknown checkpoint format {meta.get('format')!r}")
    return meta


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
    if adapter_identity(theirs) != adapter_identity(mine):
        raise UserInputError(
            f"checkpoint {directory} holds LoRA adapters {theirs}; this run's are "
            f"{mine}: resume with the checkpoint's actor_rollout_ref.model.lora_rank, "
            "lora_alpha, target_modules and exclude_modules")
