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
    """
    params = dict(model.state_dict(keep_vars=True))
    tied = model.tied
    expected = {n for n in params if not (tied and n == LM_HEAD)}
    seen: set[str] = set()
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
        copied += param.numel() * param.element_size()
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
