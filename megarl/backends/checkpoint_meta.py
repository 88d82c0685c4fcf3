"""``megarl_meta.json``: the small JSON file beside a backend checkpoint's tensors that names its
format (one per backend) and what the writer knew (role, layout, step, optimizer present).

It is written last, fsynced and renamed into place, so a directory with a readable meta file
holds a complete checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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
