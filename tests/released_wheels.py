"""Released wheels that contract tests read as zip files (never installed, never imported)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

# make install downloads the engines' wheels here
WHEEL_CACHE = Path(__file__).resolve().parents[1] / ".venv" / "engine-wheels"


def cache_folder(request, tmp_path_factory, name: str) -> Path:
    """pytest's cache folder ``name`` (kept between runs), else a temporary one."""
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name))


def released_wheel(dist: str, version: str, download_dir: Path,
                   pip_args: Sequence[str] = ("--no-deps",)) -> Path:
    """The wheel of ``dist==version``: from ``WHEEL_CACHE`` or ``download_dir``, else
    downloaded there with ``pip download`` (skips, with pip's error, when that fails)."""
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    for folder in (WHEEL_CACHE, download_dir):
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    # Download beside the cache and move in whole, so a parallel worker never reads half.
    partial = Path(tempfile.mkdtemp(dir=download_dir))
    cmd = [sys.executable, "-m", "pip", "download", "-q", f"{dist}=={version}", *pip_args,
           "-d", str(partial)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        got = sorted(partial.glob(pattern))
        if proc.returncode or not got:
            pytest.skip(f"{dist} {version} wheel neither in {WHEEL_CACHE} nor downloadable: "
                        f"{proc.stderr.strip()[-500:]}")
        target = download_dir / got[0].name
        os.replace(got[0], target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
