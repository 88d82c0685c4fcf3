"""Streaming the weights of a (sharded, pipelined) model as full HF tensors.

Every rank of the backend iterates the same list of HF names (built from a meta-device copy of
the full model, so pipeline stages agree without communication). For each name the owning
stage gathers the full tensor from its DTensor shards (``full_tensor()``: over FSDP and TP), then
broadcasts it over the pipeline group, so no rank holds more than one full tensor beyond its
own shards at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megarl.models.model import Transformer
from megarl.models.state_dict_adapter import hf_sort_key, to_hf


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int  # pipeline stage that owns it


def _owner(name: str, layer_stage: dict[int, int], num_stages: int) -> int:
    if name.startswith("model.layers."):
        return layer_stage[int(name.split(".")[2])]
    if name.startswith("model.embed_tokens."):
        return 0
    return num_stages - 1  # final norm and heads


def weight_specs(
    full: Transformer, layer_stage: dict[int, int], num_stages: int, dtype: torch.dtype
) -> list[WeightSpec]:
    """HF export list of ``full`` (a meta-device model of the whole network) in HF order."""
    state = full.state_dict()
    names = [n for n, _ in to_hf(((n, state[n]) for n in sorted(state, key=hf_sort_key)), full.args)]
    return [
        WeightSpec(n, tuple(state[n].shape), dtype, _owner(n, layer_stage, num_stages))
        for n in names
    ]


def _full(t: torch.Tensor | None, spec: WeightSpec, device: torch.device) -> torch.Tensor:
    if t is None:  # a parameter without gradient
        return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    t = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return t.to(device=device, dtype=spec.dtype)


@torch.no_grad()
def iter_full_weights(
    module: nn.Module,
    specs: list[WeightSpec],
    *,
    stage: int,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on ``device``) for every spec (``grads``: the parameters'
    gradients instead, zeros where there is none); collective over the backend."""
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers()))
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else None
    for spec in specs:
        if spec.stage == stage:
            t = own[spec.name]
            t = _full(t.grad if grads else t, spec, device)
        else:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        if pp_ranks is not None and len(pp_ranks) > 1:
            dist.broadcast(t, src=pp_ranks[spec.stage], group=pp_group)
        yield spec.name, t
