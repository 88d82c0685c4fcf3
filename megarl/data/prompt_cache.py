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
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from megarl.data import token_cache

logger = logging.getLogger(__name__)

SUBDIR = "prompt_files"
MIN_ROWS = token_cache.MIN_ROWS
_FORMAT = b"megarl-prompt-files-v1"
_CLOCK_FUNCTIONS = ("strftime_now",)
_write_warned = False


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


def _versions(*packages: str) -> str:
    out = []
    for pkg in packages:
        try:
            out.append(f"{pkg}={version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg}=?")
    return "|".join(out)


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
            "versions": _versions("jinja2", "pyarrow"),
        }, sort_keys=True)
    except (TypeError, ValueError):
        return None
    h = hashlib.sha256()

    def part(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    part(_FORMAT)
    part(fingerprint)
    part(described.encode())
    part(len(files).to_bytes(8, "little"))
    for path in files:
        part(Path(path).suffix.lower().encode())
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        part(digest.digest())
    return h.hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / f"{key}.npz"


def load(key: str) -> CachedLoad | None:
    """The load cached under ``key``, or None when its file is missing, unreadable or
    inconsistent (a miss: the caller loads the files and writes the cache again)."""
    path = _path(key)
    try:
        with np.load(path, allow_pickle=False) as f:
            ids, offsets, rows, meta = f["ids"], f["offsets"], f["rows"], f["meta"]
        rows = json.loads(rows.tobytes().decode("utf-8"))
        meta = json.loads(meta.tobytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a torn or foreign file is a miss, whatever it raises
        logger.debug("prompt file cache: unreadable %s (%s: %s); loading the files", path,
                     type(e).__name__, e)
        return None
    n = len(rows) if isinstance(rows, list) else -1
    ok = (n > 0 and ids.ndim == 1 and ids.dtype == np.int32 and offsets.ndim == 1
          and offsets.dtype == np.int64 and offsets.shape[0] == n + 1 and offsets[0] == 0
          and offsets[-1] == ids.shape[0] and bool(np.all(np.diff(offsets) >= 0))
          and isinstance(meta, dict) and isinstance(meta.get("counts"), dict)
          and isinstance(meta.get("bad_examples"), list)
          and all(isinstance(r, list) and len(r) == 6 for r in rows))
    if not ok:
        logger.debug("prompt file cache: inconsistent %s; loading the files", path)
        return None
    flat, bounds = ids.tolist(), offsets.tolist()
    return CachedLoad([flat[bounds[i]:bounds[i + 1]] for i in range(n)], rows, meta["counts"],
                      meta["bad_examples"])


def save(key: str, entry: CachedLoad) -> None:
    """Writes ``entry`` under ``key`` atomically (a temporary file renamed into place), unless
    it holds fewer than ``MIN_ROWS`` prompts or a row that JSON does not give back equal. A
    failed write is logged, once per process at warning level."""
    global _write_warned
    if len(entry.rows) < MIN_ROWS:
        return
    tmp = None
    try:
        rows_json = json.dumps(entry.rows, ensure_ascii=False, allow_nan=False)
        if json.loads(rows_json) != entry.rows:
            logger.debug("prompt file cache: rows that JSON changes (tuples?); not cached")
            return
        meta = json.dumps({"counts": entry.counts, "bad_examples": entry.bad_examples})
        lengths = np.fromiter((len(x) for x in entry.ids), dtype=np.int64, count=len(entry.ids))
        offsets = np.zeros(len(entry.ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for x in entry.ids for t in x), dtype=np.int64,
                           count=int(offsets[-1]))
        if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
            return
        path = _path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, ids=flat.astype(np.int32), offsets=offsets,
                     rows=np.frombuffer(rows_json.encode("utf-8"), dtype=np.uint8),
                     meta=np.frombuffer(meta.encode("utf-8"), dtype=np.uint8))
        os.replace(tmp, path)
        tmp = None
    except (TypeError, ValueError) as e:  # bytes, NaN or another value JSON cannot carry
        logger.debug("prompt file cache: rows JSON cannot hold (%s); not cached", e)
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written never stops a run
        level = logging.DEBUG if _write_warned else logging.WARNING
        _write_warned = True
        logger.log(level, "prompt file cache: could not write %s (%s: %s); prompt files are "
                   "loaded whole at every start (set %s to a writable folder, or 'off')",
                   _path(key), type(e).__name__, e, token_cache.ENV_VAR)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
