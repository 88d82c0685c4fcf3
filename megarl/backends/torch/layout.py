"""The parallel layout of one backend: a DeviceMesh ("pp", "dp_shard", "ulysses", "tp") over
the world.

Global rank = ``((pp_idx * dp_shard + dp_idx) * ulysses + sp_idx) * tp + tp_idx``: TP ranks are
adjacent (one node's fast links), then the Ulysses sequence-parallel group, then data parallel,
then pipeline stages outermost. Ranks with the same ``dp_idx`` hold the same data (they differ
in TP shard, token shard and pipeline stage).

FSDP2 shards the parameters over the data-parallel ranks and, under Ulysses, over the
sequence-parallel ranks too (verl's FSDP mesh spans its SP groups the same way). With
``parallel.data_parallel_shard`` below the data-parallel size (hybrid sharding), the
data-parallel dimension is split into ("dp_replicate", "dp_shard_in"), ``dp_idx = rep_idx *
shard_group + shard_idx``: parameters are sharded over ``shard_group x ulysses`` consecutive ranks
and replicated over ``dp_replicate`` such groups; "dp_shard" stays the whole data-parallel group
(the flattened pair).

Meshes are cached per (device type, shape): several backends (actor, ref, critic, prm) of one
process with the same layout share process groups instead of creating new ones each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megarl.errors import UserInputError

_MESHES: dict[tuple[str, int, int, int, int, int], DeviceMesh] = {}
_ULYSSES_KEY = "parallel.ulysses_sequence_parallel_size"
_SHARD_KEY = "parallel.data_parallel_shard"


@dataclass(frozen=True)
class Layout:
    """Resolved sizes: ``pp * dp_shard * ulysses * tp == world``. ``dp_shard``: all
    data-parallel ranks; ``sp``: Megatron-style sequence parallelism inside TP; ``ulysses``:
    the Ulysses sequence-parallel size; ``dp_replicate``: replicas of the FSDP shard group
    (1: parameters sharded over all ``dp_shard * ulysses`` ranks of a TP/PP position)."""

    pp: int
    dp_shard: int
    tp: int
    sp: bool
    ulysses: int = 1
    dp_replicate: int = 1

    @property
    def shard_group(self) -> int:
        """Data-parallel ranks in one FSDP shard group (``parallel.data_parallel_shard``)."""
        return self.dp_shard // self.dp_replicate

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
        if not isinstance(dp_shard, int) or dp_shard < 1 or rest % dp_shard:
            raise UserInputError(
                f"{_SHARD_KEY}={dp_shard!r}: world {world} / (tp {tp} * pp {pp} * ulysses "
                f"{ulysses}) = {rest} data-parallel ranks; set it to a divisor of {rest} (the "
                "data-parallel ranks per FSDP shard group) or -1 (all of them)"
            )
        if sp and tp == 1:
            sp = False  # sequence parallelism only exists inside a TP group
        return cls(pp=pp, dp_shard=rest, tp=tp, sp=bool(sp), ulysses=ulysses,
                   dp_replicate=rest // dp_shard)

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
    (cached). Under hybrid sharding the mesh is ("pp", "dp_replicate", "dp_shard_in",
    "ulysses", "tp") with "dp_shard" the flattened data-parallel pair."""
    lay = layout
    key = (device.type, lay.pp, lay.dp_replicate, lay.shard_group, lay.ulysses, lay.tp)
    if key not in _MESHES:
        if lay.dp_replicate == 1:
            _MESHES[key] = init_device_mesh(
                device.type, (lay.pp, lay.dp_shard, lay.ulysses, lay.tp),
                mesh_dim_names=("pp", "dp_shard", "ulysses", "tp"),
            )
        else:
            mesh = init_device_mesh(
                device.type, (lay.pp, lay.dp_replicate, lay.shard_group, lay.ulysses, lay.tp),
                mesh_dim_names=("pp", "dp_replicate", "dp_shard_in", "ulysses", "tp"),
            )
            mesh["dp_replicate", "dp_shard_in"]._flatten("dp_shard")
            _MESHES[key] = mesh
    return _MESHES[key]


def fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP2 shards over: "dp_shard", or under Ulysses the flattened ("dp_shard",
    "ulysses") mesh (parameters are sharded over every rank of the data and sequence groups).
    Under hybrid sharding a 2-D mesh (replicate, shard): FSDP2 shards over the shard group's
    "dp_shard_in" (x "ulysses") ranks and all-reduces the gradients over "dp_replicate"."""
    if layout.dp_replicate == 1:
        if layout.ulysses == 1:
            return mesh["dp_shard"]
        return mesh["dp_shard", "ulysses"]._flatten("dp_shard_ulysses")
    if layout.ulysses == 1:
        return mesh["dp_replicate", "dp_shard_in"]
    mesh["dp_shard_in", "ulysses"]._flatten("dp_shard_in_ulysses")
    return mesh["dp_replicate", "dp_shard_in_ulysses"]
