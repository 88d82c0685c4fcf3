"""Pieces shared by the vLLM and SGLang adapters (no engine import here)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megarl.rollout.reshard import weight_buckets

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def missing_engine(name: str, extra: str) -> ImportError:
    return ImportError(
        f"actor_rollout_ref.rollout.name={name} needs the {name} package, which is not "
        f"installed: pip install megarl[{extra}] (GPU only); or use rollout.name=torch"
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
