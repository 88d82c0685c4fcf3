"""On-disk cache of what ``RLDataset`` makes of its prompt files: every prompt's token ids,
rendered text and row fields, and the load's counts.

Every rank of every run reads, validates, renders (chat template) and tokenizes its whole
prompt file at start: for 20,000 rows about 1.5 s of one core, for a million rows minutes.
With the file cache a later load of the same files with the same settings reads one ``.npz``
(about 0.1 s for 20,000 rows) instead.

The key is a sha256 over everything the load's result depends on:

- the bytes of every file (not its path or time: a file rewritten in place is another key);
- the dataset's settings: prompt key, bad-row policy, ``max_prompt_length``, truncation,
  over-long filter, whether and with which template to render, the tools, the template's
  extra variables;
- the tokenizer: its fingerprint (``token_cache.tokenizer_fingerprint``: class, backend
  JSON, versions), its own chat template and its special tokens (both reach the template);
- the versions of ``jinja2`` and ``pyarrow`` (they render and read the rows).

A template that reads the clock (``strftime_now``) renders another text another day: such a
load is never cached. So is a load whose row fields do not come back equal through JSON
(bytes, NaN, tuples from a parquet map): the cache never changes what a load returns. Loads
of fewer than ``token_cache.MIN_ROWS`` prompts are not written. The folder, the ``off``
switch (``MEGARL_CACHE_DIR``), the atomic writes and the rule that a bad file is a miss are
the token cache's (``megarl.data.token_cache``); the files go to ``<cache dir>/prompt_files``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megarl.data import token_cache

logger = logging.getLogger(__name__)

SUBDIR = "prompt_files"
MIN_ROWS = token_cache.MIN_ROWS
_FORMAT = b"megarl-prompt-files-v1"
_CLOCK_FUNCTIONS = ("strftime_now",)


@dataclass
class CachedLoad:
    """A load as the cache holds it: ``rows`` are ``[raw_prompt, data_source, ground_truth,
    extra_info, index, prompt_text]`` per prompt (``PromptItem``'s fields but the ids),
    ``ids`` the prompt ids, ``counts`` the load's ``num_bad_rows`` / ``num_filtered`` /
    ``num_truncated`` and ``bad_examples`` its first bad-row messages."""

    ids: list[list[int]]
    rows: list[list[Any]]
    counts: dict[str, int]
    bad_examples: list[str]


def cache_dir() -> Path | None:
    """``<cache dir>/prompt_files``, or None when the cache is off (``MEGARL_CACHE_DIR``)."""
    tokens = token_cache.cache_dir()
    return None if tokens is None else tokens.parent / SUBDIR


def _templates(tokenizer: Any, chat_template: str | None) -> list[str]:
    own = getattr(tokenizer, "chat_template", None)
    named = own.values() if isinstance(own, dict) else [own]
    return [t for t in (chat_template, *named) if isinstance(t, str)]


def cache_key(files: Sequence[str], tokenizer: Any, settings: dict[str, Any],
              chat_template: str | None) -> str | None:
    """Hex sha256 over the module doc's inputs, or None when this load cannot be cached (the
    cache is off, a slow tokenizer, a template that reads the clock, settings that are not
    JSON)."""
    if cache_dir() is None or not all(os.path.isfile(p) for p in files):
        return None  # off, or a missing file: the load names it
    fingerprint = token_cache.tokenizer_fingerprint(tokenizer)
    templates = _templates(tokenizer, chat_template)
    if fingerprint is None or any(f in t for t in templates for f in _CLOCK_FUNCTIONS):
        return None
    try:
        described = json.dumps({
            "settings": settings, "chat_template": chat_template,
            "tokenizer_template": getattr(tokenizer, "chat_template", None),
            "special_tokens": getattr(tokenizer, "special_tokens_map", None),
            "versions": token_cache.package_versions("jinja2", "pyarrow"),
        }, sort_keys=True)
    except (TypeError, ValueError):
        return None
    h = token_cache.KeyHash()
    h.part(_FORMAT)
    h.part(fingerprint)
    h.part(described.encode())
    h.part(len(files).to_bytes(8, "little"))
    for path in files:
        h.part(Path(path).suffix.lower().encode())
        digest = hashlib.sha256()
        with open(path, "rb") as f:  # (hashlib.file_digest is Python >= 3.11)
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        h.part(digest.digest())
    return h.hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / f"{key}.npz"


def load(key: str) -> CachedLoad | None:
    """The load cached under ``key``, or None when its file is missing, unreadable or
    inconsistent (a miss: the caller loads the files and writes the cache again)."""
    path = _path(key)
    arrays = token_cache.read_npz(path, ("ids", "offsets", "rows", "meta"), "prompt file cache")
    if arrays is None:
        return None
    try:
        rows = json.loads(arrays["rows"].tobytes().decode("utf-8"))
        meta = json.loads(arrays["meta"].tobytes().decode("utf-8"))
    except ValueError:  # torn JSON, or bytes that are not UTF-8
        logger.debug("prompt file cache: unreadable rows in %s; loading the files", path)
        return None
    ok = (isinstance(rows, list) and rows and isinstance(meta, dict)
          and isinstance(meta.get("counts"), dict) and isinstance(meta.get("bad_examples"), list)
          and all(isinstance(r, list) and len(r) == 6 for r in rows))
    ids_list = (token_cache.unpack_ids(arrays["ids"], arrays["offsets"], len(rows))
                if ok else None)
    if ids_list is None:
        logger.debug("prompt file cache: inconsistent %s; loading the files", path)
        return None
    return CachedLoad(ids_list, rows, meta["counts"], meta["bad_examples"])


def save(key: str, entry: CachedLoad) -> None:
    """Writes ``entry`` under ``key`` (`token_cache.write_npz`: atomic, a failure only
    logged), unless it holds fewer than ``MIN_ROWS`` prompts, an id that is not int32 or a
    row that JSON does not give back equal."""
    if len(entry.rows) < MIN_ROWS:
        return
    try:
        rows_json = json.dumps(entry.rows, ensure_ascii=False, allow_nan=False)
        if json.loads(rows_json) != entry.rows:
            raise ValueError("rows that JSON changes (tuples?)")
    except (TypeError, ValueError) as e:  # bytes, NaN or another value JSON cannot carry
        logger.debug("prompt file cache: rows JSON cannot hold (%s); not cached", e)
        return
    arrays = token_cache.pack_ids(entry.ids)
    if arrays is None:
        return
    meta = json.dumps({"counts": entry.counts, "bad_examples": entry.bad_examples})
    arrays["rows"] = np.frombuffer(rows_json.encode("utf-8"), dtype=np.uint8)
    arrays["meta"] = np.frombuffer(meta.encode("utf-8"), dtype=np.uint8)
    token_cache.write_npz(_path(key), arrays, "prompt file cache")
