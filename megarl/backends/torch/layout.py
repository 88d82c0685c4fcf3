"""The parallel layout of one backend: a DeviceMesh ("pp", "dp_shard", "ulysses", "tp") over
the world.

Global rank = ``((pp_idx * dp_shard + dp_idx) * ulysses + sp_idx) * tp + tp_idx``: TP ranks are
adjacent (one node's fast links), then the Ulysses sequence-parallel group, then data parallel,
then pipeline stages outermost. Ranks with the same ``dp_idx`` hold the same data (they differ
in TP shard, token shard and pipeline stage).

Meshes are cached per (device type, shape): several backends (actor, ref, critic, prm) of one
process with the same layout share process groups instead of creating new ones each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megarl.errors import UserInputError

_MESHES: dict[tuple[str, int, int, int, int], DeviceMesh] = {}
_ULYSSES_KEY = "parallel.ulysses_sequence_parallel_size"


@dataclass(frozen=True)
class Layout:
    """Resolved sizes: ``pp * dp_shard * ulysses * tp == world``. ``sp``: Megatron-style
    sequence parallelism inside TP; ``ulysses``: the Ulysses sequence-parallel size."""

    pp: int
    dp_shard: int
    tp: int
    sp: bool
    ulysses: int = 1

    @classmethod
    def resolve(cls, world: int, *, tp: int = 1, pp: int = 1, dp_shard: int = -1,
                sp: bool = False, ulysses: int = 1) -> Layout:
        for name, v in (("tp", tp), ("pp", pp), ("ulysses", ulysses)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if ulysses > 1 and (tp > 1 or pp > 1):
            raise UserInputError(
                f"{_ULYSSES_KEY}={ulysses} with tensor_model_parallel_size={tp} and "
                f"pipeline_model_parallel_size={pp}: the torch backend combines Ulysses sequence "
                "parallelism with FSDP only; set TP and PP to 1 (or the Ulysses size to 1)"
            )
        if world % (tp * pp * ulysses):
            raise ValueError(
                f"world size {world} is not divisible by tp * pp * ulysses = {tp} * {pp} * "
                f"{ulysses}; change parallel.tensor_model_parallel_size / "
                f"pipeline_model_parallel_size / ulysses_sequence_parallel_size"
            )
        rest = world // (tp * pp * ulysses)
        if dp_shard in (-1, None):
            dp_shard = rest
        if dp_shard != rest:
            raise ValueError(
                f"parallel.data_parallel_shard={dp_shard} but world {world} / (tp {tp} * pp {pp} "
                f"* ulysses {ulysses}) = {rest}; set it to {rest} or -1 (the rest of the world)"
            )
        if sp and tp == 1:
            sp = False  # sequence parallelism only exists inside a TP group
        return cls(pp=pp, dp_shard=dp_shard, tp=tp, sp=bool(sp), ulysses=ulysses)

    @property
    def parallel(self) -> bool:
        return self.pp * self.dp_shard * self.ulysses * self.tp > 1


def world_size() -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            "TorchBackend needs an initialised process group (gloo on CPU, NCCL on GPU); a "
            "single process is a world of one: see megarl.utils.dist.init_distributed"
        )
    return dist.get_world_size()


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The ("pp", "dp_shard", "ulysses", "tp") mesh of ``layout`` on ``device``'s type
    (cached)."""
    key = (device.type, layout.pp, layout.dp_shard, layout.ulysses, layout.tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(
            device.type,
            (layout.pp, layout.dp_shard, layout.ulysses, layout.tp),
            mesh_dim_names=("pp", "dp_shard", "ulysses", "tp"),
        )
    return _MESHES[key]


def fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP2 shards over: "dp_shard", or under Ulysses the flattened ("dp_shard",
    "ulysses") mesh (parameters are sharded over every rank of the data and sequence groups)."""
    if layout.ulysses == 1:
        return mesh["dp_shard"]
    return mesh["dp_shard", "ulysses"]._flatten("dp_shard_ulysses")
