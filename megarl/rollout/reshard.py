"""Training layout -> (HF name, full tensor) buckets for engines and HF export.

Both training backends implement ``Backend.export_weights()``: a collective stream of (HF name,
full tensor) pairs, in HF order, that gathers ONE tensor at a time (over the tensor-parallel
group from the owner's shards, then broadcast across pipeline stages), so no rank materialises
more than one full tensor beyond its own shards. This module groups that stream into buckets of
at most ``bucket_bytes`` for engines whose weight-update call takes a batch (vLLM
``load_weights``, SGLang ``update_weights_from_tensor``): a rank holds at most one bucket plus
the one tensor that did not fit in it, provided the consumer drops each bucket before asking
for the next (the iterator keeps no reference to a bucket it has handed out). A tensor larger
than the bucket size forms a bucket of its own.

Every rank of the backend must iterate the whole stream (it is collective); ranks that do not
feed an engine simply discard the buckets. The same stream writes an HF folder:
`save_hf_from_backend` (rank 0 writes, the others iterate).

    buckets = weight_buckets(actor.export_weights(), rollout.bucket_bytes)  # RolloutSettings
    engine.update_weights(buckets)          # engines accept buckets or a flat stream
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

Named = tuple[str, torch.Tensor]
Bucket = list[Named]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_buckets(
    weights: Iterable[Named],
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[Bucket]:
    """Group consecutive (name, tensor) pairs into lists of at most ``bucket_bytes`` bytes.

    dtype / device: cast floating tensors / move every tensor as it arrives (e.g. fp32 master
    weights to the engine's bf16), so the bucket bound applies to the cast size.
    Order is preserved; names must be unique.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise ValueError(f"weight stream gave {name!r} twice")
        seen.add(name)
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            out, bucket, size = bucket, [], 0
            yield out
            del out  # hold nothing of a bucket already handed out
        bucket.append((name, tensor))
        size += nbytes
        del tensor
    if bucket:
        out, bucket = bucket, []
        yield out


def flatten_buckets(buckets: Iterable[Bucket]) -> Iterator[Named]:
    """Buckets back to a flat (name, tensor) stream (releasing each bucket after use)."""
    for bucket in buckets:
        bucket.reverse()
        while bucket:
            yield bucket.pop()


def as_named(weights: Iterable[Any]) -> Iterator[Named]:
    """(name, tensor) pairs from either a flat stream or an iterable of buckets (lists of
    pairs), in order; buckets are not copied."""
    for item in weights:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:
            yield from item


def backend_buckets(backend: Any, bucket_bytes: int, **kwargs: Any) -> Iterator[Bucket]:
    """`weight_buckets` of ``backend.export_weights()`` (collective: every rank iterates)."""
    return weight_buckets(backend.export_weights(), bucket_bytes, **kwargs)


def save_hf_from_backend(
    backend: Any,
    directory: str | os.PathLike,
    *,
    config: dict[str, Any] | None = None,
    bucket_bytes: int = 512 * 2**20,
    dtype: torch.dtype | None = None,
    source_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path | None:
    """Write the backend's current weights as an HF folder from the same bucketed stream the
    engines get. Collective: every rank iterates; the global rank 0 writes and returns the
    path, the others return None. config: default ``backend.hf_export_config()``."""
    import torch.distributed as dist

    from megarl.models import save_hf_checkpoint

    if config is None:
        if not hasattr(backend, "hf_export_config"):
            raise ValueError(
                f"{type(backend).__name__} has no hf_export_config(); pass config= (the "
                "config.json dict, e.g. megarl.models.hf_config_for(model))"
            )
        config = backend.hf_export_config()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    stream = flatten_buckets(backend_buckets(backend, bucket_bytes))
    if rank != 0:
        for _ in stream:
            pass
        return None
    return save_hf_checkpoint(
        directory, stream, config, dtype=dtype, source_dir=source_dir, overwrite=overwrite
    )
