"""Copy a (HF name, full tensor) stream into a `Transformer` in place."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megarl.models import Transformer
from megarl.models.state_dict_adapter import EMBED, LM_HEAD, hf_sort_key

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class WeightUpdateError(ValueError):
    """A weight stream does not match the engine's model (unknown name, shape, or missing)."""


@torch.no_grad()
def load_weight_stream(
    model: Transformer, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
) -> int:
    """Copy each (HF name, tensor) into the parameter of that name (cast to its dtype/device).

    Tied embeddings: ``lm_head.weight`` is the embedding Parameter; a stream that carries it too
    (besides ``model.embed_tokens.weight``) is ignored for it, as transformers does. A tensor
    that already is the parameter's storage (an engine wrapping the trainer's own model) is not
    copied. strict: every parameter must arrive once. Returns the number of bytes copied.

    Copies are queued without blocking on the current CUDA stream (the engine computes on it,
    so its kernels see them in order). A copy between a GPU and pinned host memory (an engine
    asleep with its weights offloaded takes the trainer's GPU tensors into pinned memory) is
    still running when ``copy_`` returns: the stream is synchronised before this returns, so
    the model's host tensors hold the new values and no source is still being read. The
    stream's tensors must not be changed in place until then (producers yield fresh ones).
    """
    params = dict(model.state_dict(keep_vars=True))
    tied = model.tied
    expected = {n for n in params if not (tied and n == LM_HEAD)}
    seen: set[str] = set()
    in_flight: set[torch.device] = set()  # CUDA devices with host <-> GPU copies queued
    try:
        copied = _copy_stream(model, params, weights, seen, in_flight)
    finally:
        for device in in_flight:
            torch.cuda.current_stream(device).synchronize()
    if strict:
        missing = sorted(expected - seen, key=hf_sort_key)
        if missing:
            raise WeightUpdateError(
                f"update_weights: the stream lacked {len(missing)} parameter(s): "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                f"(pass strict=False for a partial update)"
            )
    if tied and EMBED in seen:
        model.tie_weights()
    return copied


def _copy_stream(model: Transformer, params: dict[str, torch.Tensor],
                 weights: Iterable[tuple[str, torch.Tensor]], seen: set[str],
                 in_flight: set[torch.device]) -> int:
    """The copies of `load_weight_stream`: names into ``seen``, the CUDA devices of host <->
    GPU copies into ``in_flight``. Returns the bytes copied."""
    tied = model.tied
    copied = 0
    for name, tensor in weights:
        if _IGNORED.search(name) or (tied and name == LM_HEAD):
            continue
        param = params.get(name)
        if param is None:
            raise WeightUpdateError(
                f"update_weights: {name!r} is not a parameter of this {model.args.model_type} "
                f"model (head={model.head!r}); the stream must use HF names of the same "
                f"architecture (see megarl.models.state_dict_adapter)"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightUpdateError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                f"{tuple(param.shape)}; was the stream gathered over tensor-parallel ranks?"
            )
        if name in seen:
            raise WeightUpdateError(f"update_weights: {name!r} arrived twice in one stream")
        seen.add(name)
        if tensor.data_ptr() == param.data_ptr() and tensor.dtype == param.dtype:
            continue
        param.data.copy_(tensor, non_blocking=True)
        crossing = host_device_copy(param.device, tensor.device)
        if crossing is not None:
            in_flight.add(crossing)
        copied += param.numel() * param.element_size()
    return copied


def host_device_copy(dst: torch.device, src: torch.device) -> torch.device | None:
    """The CUDA device of a copy between host memory and a GPU (either way), else None: with
    ``non_blocking`` and pinned host memory such a copy runs after ``copy_`` returns, on that
    device's current stream."""
    kinds = {dst.type, src.type}
    if kinds != {"cpu", "cuda"}:
        return None
    return dst if dst.type == "cuda" else src
