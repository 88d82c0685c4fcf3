"""Pieces shared by the vLLM and SGLang adapters (no engine import here)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megarl.rollout.reshard import weight_buckets
from megarl.utils.dtypes import CONFIG_DTYPES

# config dtype name -> the engine's ``dtype`` argument (torch's name), for both adapters
DTYPE_NAMES = CONFIG_DTYPES


def missing_engine(name: str, extra: str) -> ImportError:
    return ImportError(
        f"actor_rollout_ref.rollout.name={name} needs the {name} package, which is not "
        f"installed: pip install megarl[{extra}]; or use rollout.name=torch"
    )


def check_engine_version(name: str, installed: str, supported: str, extra: str) -> None:
    """Refuse an engine release outside the range megarl was tested with (its API moves
    between minor releases). ``supported``: a PEP 440 specifier such as ">=0.32,<0.33"."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(installed)
    except InvalidVersion:
        version = None
    # A local or dev build of a supported release (0.32.0+cpu, 0.32.1.dev3) counts as it.
    if version is not None and SpecifierSet(supported).contains(version.public, prereleases=True):
        return
    raise ImportError(
        f"actor_rollout_ref.rollout.name={name}: {name} {installed} is installed, but megarl "
        f"supports {name}{supported} (the releases its adapter was checked against); install "
        f"one with pip install 'megarl[{extra}]', or use rollout.name=torch"
    )


def derived_seed(seed: int, *parts: int) -> int:
    """A 31-bit seed per (seed, prompt index, ...), so prompts do not share one noise stream."""
    return zlib.crc32(repr((int(seed), *parts)).encode()) & 0x7FFFFFFF


def as_buckets(
    weights: Iterable[Any], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets from either a flat (name, tensor) stream or an iterable of buckets (kept as
    they come)."""
    it = iter(weights)
    first = next(it, None)
    if first is None:
        return
    if isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], str):

        def flat():
            yield first
            yield from it

        yield from weight_buckets(flat(), bucket_bytes)
    else:
        yield list(first)
        for bucket in it:
            yield list(bucket)


def check_finish(reason: Any, engine: str) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"{engine} finished a sequence with reason {reason!r} (aborted?)")
