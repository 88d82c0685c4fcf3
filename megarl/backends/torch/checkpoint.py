"""Backend checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint directory holds DCP's files (``.metadata``, ``__*_*.distcp``) with three entries:
``model`` and ``optim`` (``get_state_dict``: fully-qualified HF-style names, DTensor shards of any
layout) and ``extra`` (``step``: optimizer updates applied, which is all the LR schedule needs),
plus ``megarl_meta.json`` (role, layout it was written from, step, whether the optimizer state is
inside). DCP reshards on load, so a checkpoint written at one TP / PP / FSDP layout loads at
another (or in a single process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from megarl.backends import checkpoint_meta

FORMAT = "megarl-torch-dcp-v1"


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    return checkpoint_meta.read_meta(directory, FORMAT, "torch-backend",
                                     how_to_write="TorchBackend.save")


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    meta: dict[str, Any],
) -> None:
    """Collective over the world: write model (+ optimizer) state, the step counter and
    ``meta`` (rank 0) to ``directory`` (must be empty or absent)."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if any(directory.iterdir()):
            raise FileExistsError(f"checkpoint directory {directory} is not empty")
    dist.barrier()
    state = _states(model, optimizer)
    state["extra"] = {"step": torch.tensor(step, dtype=torch.int64)}
    dcp.save(state, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        meta = {"format": FORMAT, **meta, "step": step, "has_optimizer": optimizer is not None}
        checkpoint_meta.write_meta(directory, meta)
    dist.barrier()


def load(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[dict[str, Any], int | None]:
    """Collective: load model state, and optimizer state + step when the checkpoint has them
    and ``optimizer`` is given. Returns (meta, step or None)."""
    meta = read_meta(directory)
    with_optim = optimizer is not None and meta.get("has_optimizer", False)
    state = _states(model, optimizer if with_optim else None)
    state["extra"] = {"step": torch.tensor(0, dtype=torch.int64)}
    dcp.load(state, checkpoint_id=str(directory))
    if with_optim:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        return meta, int(state["extra"]["step"])
    set_model_state_dict(model, state["model"])
    return meta, None
