"""Hugging Face Hub ids: when megarl lets the Hub download, and what it says when it cannot.

verl downloads ``actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct`` on first use; so does
megarl, unless the user asked for offline (``HF_HUB_OFFLINE=1``) or nothing the run reads is a
hub id (the embedded demo, local folders: then the run goes offline, so that it never waits on
the network). The tests set ``HF_HUB_OFFLINE=1`` (tests/conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}
HOW_TO_DOWNLOAD = ("downloads are off (HF_HUB_OFFLINE=1); on a machine with network, unset "
                   "HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE (or set them to 0) and the hub id is "
                   "downloaded on first use, or download it yourself (huggingface-cli download "
                   "ID) and give its folder")


def is_hub_id(path: object) -> bool:
    """``org/name`` that is not a local path nor a ``scheme://`` location."""
    if not isinstance(path, str) or "://" in path or os.path.exists(path):
        return False
    return (not os.path.isabs(path) and not path.startswith(("./", "../", "~"))
            and path.count("/") == 1 and all(path.split("/")))


def offline() -> bool:
    """Whether the user (or `decide_offline`) turned Hub downloads off."""
    return any(os.environ.get(v, "").upper() in _TRUE for v in OFFLINE_VARS)


def decide_offline(paths: Iterable[object]) -> bool:
    """Set ``HF_HUB_OFFLINE=1`` (and TRANSFORMERS_OFFLINE) unless one of ``paths`` is a hub id;
    a value the user set is kept. Call it before huggingface_hub is imported (it reads the
    variable once). Returns whether downloads are off."""
    if not any(is_hub_id(p) for p in paths) and not any(v in os.environ for v in OFFLINE_VARS):
        for v in OFFLINE_VARS:
            os.environ[v] = "1"
    return offline()


def in_cache(repo_id: str) -> bool:
    """Whether the local HF cache holds ``repo_id``'s config.json (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for name in ("config.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(repo_id, name), str):
                return True
        except Exception:  # noqa: BLE001 - a malformed id is simply not cached
            return False
    return False
