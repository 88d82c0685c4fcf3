"""Config values as plain Python: OmegaConf containers and other mappings -> dicts and lists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def plain(value: Any) -> Any:
    """``value`` with every mapping (a dict, or OmegaConf's) turned into a dict with str keys and
    every list or tuple into a list, recursively; other values as they are."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
