"""Output-directory handling shared by the conversions: refuse to overwrite without --force,
write into a temp sibling, rename into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class ConversionError(Exception):
    """A conversion cannot proceed; the message is printed as the tool's one error line."""


def non_empty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"--out {out} exists and is not a directory")
    if non_empty(out) and not force:
        raise ConversionError(f"--out {out} exists and is not empty; pass --force to replace it")
    if not out.parent.is_dir():
        raise ConversionError(f"--out {out}: parent directory {out.parent} does not exist")


def temp_sibling(out: Path) -> Path:
    """An empty temp directory next to ``out`` (same file system, so the rename is atomic)."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def swap_into_place(tmp: Path, out: Path, *, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` (only with force) is moved
    aside first and deleted after."""
    old = None
    if out.exists():
        if non_empty(out) and not force:
            raise ConversionError(f"--out {out} appeared while converting; pass --force")
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "previous")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
