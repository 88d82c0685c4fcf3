"""On-disk cache of the token ids of rendered prompts (what ``RLDataset`` feeds the tokenizer).

A training run tokenizes its whole prompt file at start, on every rank; for a file of 100k
rows that is seconds each time. ``token_ids`` keeps the tokenizer's output in one ``.npz`` per
input under ``<cache dir>/prompt_tokens/``, keyed by a sha256 over a fingerprint of the
tokenizer, the ``add_special_tokens`` flag and every text. The texts are the rendered prompts,
so the chat template, the tools, the prompt key and the file's content all reach the key
through them; nothing else decides the ids.

- Cache dir: ``$MEGARL_CACHE_DIR``, else ``$XDG_CACHE_HOME/megarl``, else ``~/.cache/megarl``;
  ``MEGARL_CACHE_DIR=off`` (or set to the empty string) turns the cache off.
- Only inputs of at least ``MIN_ROWS`` (1,000) texts are cached: smaller ones tokenize in
  milliseconds and would only fill the folder.
- Only fast tokenizers (with ``backend_tokenizer``) are cached: their whole state is the
  backend's JSON. Any other tokenizer is just called.
- A file is written to a temporary name in the same folder and renamed into place, so ranks
  that miss at the same time each write a whole file and readers never see half of one. A
  missing, unreadable or inconsistent file is a miss (the ids are recomputed and the file
  rewritten); a failed write is logged once and the run goes on.
- Files hold plain arrays (read with ``allow_pickle=False``); delete the folder at any time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ENV_VAR = "MEGARL_CACHE_DIR"
MIN_ROWS = 1000
SUBDIR = "prompt_tokens"
_FORMAT = b"megarl-prompt-tokens-v1"
_write_warned = False


def cache_dir() -> Path | None:
    """The folder the token files go to (``<cache dir>/prompt_tokens``), or None when
    ``MEGARL_CACHE_DIR`` is ``off`` or empty."""
    root = os.environ.get(ENV_VAR)
    if root is not None:
        if root.strip() in ("", "off"):
            return None
        return Path(root).expanduser() / SUBDIR
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "megarl" / SUBDIR


def package_versions(*packages: str) -> str:
    """``"name=version|..."`` of the installed ``packages`` (``name=?`` when one is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in packages:
        try:
            out.append(f"{pkg}={version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg}=?")
    return "|".join(out)


class KeyHash:
    """sha256 over length-prefixed parts: no two sequences of parts hash the same bytes."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def part(self, b: bytes) -> None:
        self._h.update(len(b).to_bytes(8, "little"))
        self._h.update(b)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> bytes | None:
    """Bytes that change whenever the tokenizer may give other ids: its class, the backend's
    whole JSON (normalizer, pre-tokenizer, model, added tokens, post-processor) and the
    versions of ``tokenizers`` and ``transformers``. None for a tokenizer without
    ``backend_tokenizer`` (a slow one): such a tokenizer is never cached."""
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        state = backend.to_str() if backend is not None else None
    except Exception:  # noqa: BLE001 - a backend that cannot describe itself is not cached
        state = None
    if state is None:
        return None
    cls = type(tokenizer)
    split = getattr(tokenizer, "split_special_tokens", None)
    versions = package_versions("tokenizers", "transformers")
    head = f"{cls.__module__}.{cls.__qualname__}|{versions}|split={split!r}|"
    return head.encode() + hashlib.sha256(state.encode()).digest()


def cache_key(fingerprint: bytes, texts: Sequence[str], add_special_tokens: bool) -> str:
    """Hex sha256 over the format tag, the tokenizer fingerprint, ``add_special_tokens`` and
    every text, each part length-prefixed (no two inputs hash the same bytes)."""
    h = KeyHash()
    h.part(_FORMAT)
    h.part(fingerprint)
    h.part(b"add_special_tokens=1" if add_special_tokens else b"add_special_tokens=0")
    h.part(len(texts).to_bytes(8, "little"))
    for t in texts:
        h.part(t.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def unpack_ids(ids: np.ndarray, offsets: np.ndarray, n_rows: int) -> list[list[int]] | None:
    """Row i is ``ids[offsets[i]:offsets[i + 1]]``; None unless ``ids`` (int32 [tokens]) and
    ``offsets`` (int64 [n_rows + 1], from 0 to the end, never falling) fit together."""
    ok = (ids.ndim == 1 and ids.dtype == np.int32 and offsets.ndim == 1
          and offsets.dtype == np.int64 and offsets.shape[0] == n_rows + 1
          and offsets[0] == 0 and offsets[-1] == ids.shape[0]
          and bool(np.all(np.diff(offsets) >= 0)))
    if not ok:
        return None
    flat = ids.tolist()
    bounds = offsets.tolist()
    return [flat[bounds[i]:bounds[i + 1]] for i in range(n_rows)]


def pack_ids(ids_list: Sequence[Sequence[int]]) -> dict[str, np.ndarray] | None:
    """``{"ids": int32 [tokens], "offsets": int64 [rows + 1]}`` (`unpack_ids`' inverse), or
    None when an id does not fit in int32."""
    lengths = np.fromiter((len(x) for x in ids_list), dtype=np.int64, count=len(ids_list))
    offsets = np.zeros(len(ids_list) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for x in ids_list for t in x), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
        return None
    return {"ids": flat.astype(np.int32), "offsets": offsets}


def write_npz(path: Path, arrays: dict[str, np.ndarray], what: str) -> None:
    """``np.savez`` of ``arrays`` to ``path`` through a temporary file renamed into place (a
    reader never sees half a file). A failure is logged, once per process at warning level:
    a cache that cannot be written never stops a run. ``what`` names the cache."""
    global _write_warned
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
        tmp = None
    except Exception as e:  # noqa: BLE001 - whatever the folder or disk says, the run goes on
        level = logging.DEBUG if _write_warned else logging.WARNING
        _write_warned = True
        logger.log(level, "%s: could not write %s (%s: %s); it is recomputed at every start "
                   "(set %s to a writable folder, or 'off')", what, path, type(e).__name__, e,
                   ENV_VAR)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def read_npz(path: Path, names: Sequence[str], what: str) -> dict[str, np.ndarray] | None:
    """The arrays ``names`` of the ``.npz`` at ``path`` (no pickle), or None when it is
    missing, torn or foreign: a miss (logged at debug level, ``what`` naming the cache)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {name: f[name] for name in names}
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a torn or foreign file is a miss, whatever np raises
        logger.debug("%s: unreadable %s (%s: %s); recomputing", what, path, type(e).__name__, e)
        return None


def _load(path: Path, n_rows: int) -> list[list[int]] | None:
    """The ids in ``path`` (n_rows lists), or None when the file is missing, unreadable or
    does not hold exactly n_rows rows."""
    arrays = read_npz(path, ("ids", "offsets"), "token cache")
    if arrays is None:
        return None
    ids_list = unpack_ids(arrays["ids"], arrays["offsets"], n_rows)
    if ids_list is None:
        logger.debug("token cache: inconsistent %s; recomputing", path)
    return ids_list


def _save(path: Path, ids_list: Sequence[Sequence[int]]) -> None:
    """`pack_ids` written to ``path`` by `write_npz` (nothing when an id is not int32)."""
    arrays = pack_ids(ids_list)
    if arrays is not None:
        write_npz(path, arrays, "token cache")


def token_ids(tokenizer: Any, texts: Sequence[str],
              add_special_tokens: bool = False) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=...)["input_ids"]``: one list of ids per text,
    read from the cache when this tokenizer has tokenized these exact texts before (module
    doc). Inputs of fewer than ``MIN_ROWS`` texts, slow tokenizers and a disabled cache go
    straight to the tokenizer."""
    folder = cache_dir() if len(texts) >= MIN_ROWS else None
    fingerprint = tokenizer_fingerprint(tokenizer) if folder is not None else None
    if folder is None or fingerprint is None:
        return tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    path = folder / f"{cache_key(fingerprint, texts, add_special_tokens)}.npz"
    cached = _load(path, len(texts))
    if cached is not None:
        return cached
    ids_list = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    _save(path, ids_list)
    return ids_list
