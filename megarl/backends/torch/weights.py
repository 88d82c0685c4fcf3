"""Streaming the weights of a (sharded, pipelined) model as full HF tensors.

Every rank of the backend iterates the same list of HF names (built from a meta-device copy of
the full model, so pipeline stages agree without communication). For each name the owning
stage gathers the full tensor from its DTensor shards (``full_tensor()``: over FSDP and TP), then
broadcasts it over the pipeline group, so no rank holds more than one full tensor beyond its
own shards at a time.

With LoRA adapters (`megarl.models.lora`), ``merge`` names the adapted weights: each is sent as
``W + (alpha / r) B A`` (A and B gathered like W), under the base weight's HF name, so an engine
or an HF folder receives a plain model of the same names and shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megarl.models.lora import LoRALinear, is_adapter_param
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


def adapter_specs(
    full: Transformer, layer_stage: dict[int, int], num_stages: int, dtype: torch.dtype
) -> list[WeightSpec]:
    """The LoRA adapter tensors of ``full`` (a meta-device model with `apply_lora` applied),
    in module order, under their own names (``<module>.lora_{A,B}.weight``)."""
    return [
        WeightSpec(n, tuple(p.shape), dtype, _owner(n, layer_stage, num_stages))
        for n, p in full.named_parameters() if is_adapter_param(n)
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
    merge: dict[str, LoRALinear] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on ``device``) for every spec (``grads``: the parameters'
    gradients instead, zeros where there is none); collective over the backend. ``merge``:
    {weight name: its LoRALinear} whose enabled adapter is folded into the weight (not with
    ``grads``)."""
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers()))
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else None
    merge = {} if grads or merge is None else merge
    for spec in specs:
        if spec.stage == stage:
            t = own[spec.name]
            t = _full(t.grad if grads else t, spec, device)
            lora = merge.get(spec.name)
            if lora is not None and lora.adapter_enabled:
                t = t + _merged_delta(lora, device).to(spec.dtype)
        else:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        if pp_ranks is not None and len(pp_ranks) > 1:
            dist.broadcast(t, src=pp_ranks[spec.stage], group=pp_group)
        yield spec.name, t


def _merged_delta(lora: LoRALinear, device: torch.device) -> torch.Tensor:
    """(alpha / r) B A [out, in] in float32 from the full (gathered) A and B."""
    a, b = (w.full_tensor() if isinstance(w, DTensor) else w.detach()
            for w in (lora.lora_A.weight, lora.lora_B.weight))
    return (b.to(device, torch.float32) @ a.to(device, torch.float32)) * lora.scaling
