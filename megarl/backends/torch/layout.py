"""The parallel layout of one backend: a DeviceMesh ("pp", "dp_shard", "tp") over the world.

Global rank = ``(pp_idx * dp_shard + dp_idx) * tp + tp_idx``: TP ranks are adjacent (one node's
fast links), then data parallel, then pipeline stages outermost. Ranks with the same ``dp_idx``
hold the same data (they differ in TP shard and pipeline stage).

Meshes are cached per (device type, shape): several backends (actor, ref, critic, prm) of one
process with the same layout share process groups instead of creating new ones each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_MESHES: dict[tuple[str, int, int, int], DeviceMesh] = {}


@dataclass(frozen=True)
class Layout:
    """Resolved sizes: ``pp * dp_shard * tp == world``."""

    pp: int
    dp_shard: int
    tp: int
    sp: bool

    @classmethod
    def resolve(cls, world: int, *, tp: int = 1, pp: int = 1, dp_shard: int = -1,
                sp: bool = False) -> Layout:
        for name, v in (("tp", tp), ("pp", pp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if world % (tp * pp):
            raise ValueError(
                f"world size {world} is not divisible by tp * pp = {tp} * {pp}; change "
                "parallel.tensor_model_parallel_size / pipeline_model_parallel_size"
            )
        rest = world // (tp * pp)
        if dp_shard in (-1, None):
            dp_shard = rest
        if dp_shard != rest:
            raise ValueError(
                f"parallel.data_parallel_shard={dp_shard} but world {world} / (tp {tp} * pp {pp}) "
                f"= {rest}; set it to {rest} or -1 (the rest of the world)"
            )
        if sp and tp == 1:
            sp = False  # sequence parallelism only exists inside a TP group
        return cls(pp=pp, dp_shard=dp_shard, tp=tp, sp=bool(sp))

    @property
    def parallel(self) -> bool:
        return self.pp * self.dp_shard * self.tp > 1


def world_size() -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            "TorchBackend needs an initialised process group (gloo on CPU, NCCL on GPU); a "
            "single process is a world of one: see megarl.utils.dist.init_distributed"
        )
    return dist.get_world_size()


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The ("pp", "dp_shard", "tp") mesh of ``layout`` on ``device``'s type (cached)."""
    key = (device.type, layout.pp, layout.dp_shard, layout.tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(
            device.type,
            (layout.pp, layout.dp_shard, layout.tp),
            mesh_dim_names=("pp", "dp_shard", "tp"),
        )
    return _MESHES[key]
