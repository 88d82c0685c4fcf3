"""Backend checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint directory holds DCP's files (``.metadata``, ``__*_*.distcp``) with three entries:
``model`` and ``optim`` (``get_state_dict``: fully-qualified HF-style names, DTensor shards of any
layout) and ``extra`` (``step``: optimizer updates applied, which is all the LR schedule needs),
plus ``megarl_meta.json`` (role, layout it was written from, step, whether the optimizer state is
inside). DCP reshards on load, so a checkpoint written at one TP / PP / FSDP layout loads at
another (or in a single process).

``trainable_only`` (LoRA): ``model`` holds only the parameters that require gradients (the
adapters; the frozen base is read again from the model folder) and ``megarl_meta.json`` says so.
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
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from megarl.backends import checkpoint_meta
from megarl.backends.torch.precision import check_resume_dtype, dtype_name, param_dtype_key
from megarl.errors import UserInputError
from megarl.models.lora import settings_meta

FORMAT = "megarl-torch-dcp-v1"


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    return checkpoint_meta.read_meta(directory, FORMAT, "torch-backend",
                                     how_to_write="TorchBackend.save")


def _options(trainable_only: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None,
            trainable_only: bool = False) -> dict[str, Any]:
    opts = _options(trainable_only)
    if optimizer is None:
        msd, osd = get_model_state_dict(model, options=opts), None
    else:
        msd, osd = get_state_dict(model, optimizer, options=opts)
    if trainable_only:  # torch keeps a frozen parameter's tied alias (lm_head = embedding)
        keep = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in keep}
    return {"model": msd} if osd is None else {"model": msd, "optim": osd}


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    meta: dict[str, Any],
    *,
    trainable_only: bool = False,
) -> None:
    """Collective over the world: write model (+ optimizer) state, the step counter and
    ``meta`` (rank 0) to ``directory`` (must be empty or absent)."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if any(directory.iterdir()):
            raise FileExistsError(f"checkpoint directory {directory} is not empty")
    dist.barrier()
    state = _states(model, optimizer, trainable_only)
    state["extra"] = {"step": torch.tensor(step, dtype=torch.int64)}
    dcp.save(state, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        meta = {"format": FORMAT, **meta, "step": step, "has_optimizer": optimizer is not None,
                "trainable_only": trainable_only}
        checkpoint_meta.write_meta(directory, meta)
    dist.barrier()


def load(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trainable_only: bool = False,
) -> tuple[dict[str, Any], int | None]:
    """Collective: load model state, and optimizer state + step when the checkpoint has them
    and ``optimizer`` is given. Returns (meta, step or None). ``trainable_only`` must match
    the checkpoint's (a LoRA checkpoint holds the adapters only)."""
    meta = read_meta(directory)
    if bool(meta.get("trainable_only", False)) != trainable_only:
        held = "only LoRA adapters" if meta.get("trainable_only") else "a full model"
        mine = "trains LoRA adapters" if trainable_only else "trains the full model"
        raise UserInputError(
            f"checkpoint {directory} holds {held} and this run {mine}: resume with the "
            "actor_rollout_ref.model.lora_rank the checkpoint was written with")
    with_optim = optimizer is not None and meta.get("has_optimizer", False)
    state = _states(model, optimizer if with_optim else None, trainable_only)
    state["extra"] = {"step": torch.tensor(0, dtype=torch.int64)}
    dcp.load(state, checkpoint_id=str(directory))
    opts = _options(trainable_only)
    if with_optim:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=opts,
        )
        _fill_group_settings(optimizer, settings)
        return meta, int(state["extra"]["step"])
    set_model_state_dict(model, state["model"], options=opts)
    return meta, None


def _fill_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Give each param group back the settings (lr, betas, eps, ...) the load left out. DCP
    stores one copy of the replicated param-group entries, whose parameter list is one
    pipeline stage's: on the other stages the loader matches no saved group and keeps only
    the defaults torch fills in. The settings are the run's own (the LR is set every step;
    a resume with changed optimizer settings is refused before this)."""
    for group, own in zip(optimizer.param_groups, settings):
        for key, value in own.items():
            group.setdefault(key, value)


def save_backend(backend: Any, directory: str) -> None:
    """`TorchBackend.save`: ``backend``'s model (+ optimizer, step) with its role, layout,
    source folder, parameter dtype and LoRA settings in the meta. Collective."""
    backend._reshard()
    lay = backend.layout
    meta = {"role": backend.role, "tp": lay.tp, "pp": lay.pp, "dp_shard": lay.dp_shard,
            "sp": lay.sp, "ulysses": lay.ulysses, "source": backend.model_path,
            "param_dtype": dtype_name(backend.param_dtype)}
    if backend.lora is not None:
        meta["lora"] = settings_meta(backend.lora)
    save(directory, backend.model, backend.optimizer, backend.step, meta,
         trainable_only=backend.lora is not None)


def load_backend(backend: Any, directory: str) -> None:
    """`TorchBackend.load`: refuse a checkpoint of another role, other LoRA adapters or
    another parameter dtype, then load it (and its step, when it has the optimizer's state)
    into ``backend``. Collective."""
    meta = read_meta(directory)
    mine = settings_meta(backend.lora)
    checkpoint_meta.check_role_and_adapters(directory, meta, backend.role, mine,
                                            meta.get("lora", mine))
    check_resume_dtype(meta, backend.role, backend.param_dtype, directory,
                       param_dtype_key(backend.role))
    backend._reshard()
    _, step = load(directory, backend.model, backend.optimizer,
                   trainable_only=backend.lora is not None)
    if step is not None:
        backend.step = step
