"""Initial weights from a megatron-core dist checkpoint (verl's ``megatron.use_dist_checkpointing``
with ``dist_checkpointing_path`` and ``dist_checkpointing_prefix``).

The checkpoint is one model's ``sharded_state_dict()`` saved with
``megatron.core.dist_checkpointing.save`` (what verl's ``scripts/converter_hf_to_mcore.py``
writes: no wrapping key, the prefix verl calls ``dist_checkpointing_prefix``). Loading follows
verl's ``load_mcore_dist_weights``: each pipeline chunk's sharded state dict is filled from the
checkpoint with ``StrictHandling.ASSUME_OK_UNEXPECTED`` (entries of the checkpoint the model
does not have are ignored; every entry the model has must be there), value models (critic,
PRM) skipping the LM output layer. megatron-core reshards on load, so the checkpoint's tensor
and pipeline layout need not be this run's. The HF folder (``model.path``) still gives the
architecture (config.json) and the tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserInputError


def dist_checkpoint_keys(role: str) -> tuple[str, str]:
    """(use_dist_checkpointing key, dist_checkpointing_path key) of ``role``'s megatron block
    (actor, ref and PRM read the actor's)."""
    m = "critic.megatron" if role == "critic" else "actor_rollout_ref.actor.megatron"
    return f"{m}.use_dist_checkpointing", f"{m}.dist_checkpointing_path"


@torch.no_grad()
def load_dist_checkpoint(chunks: list[torch.nn.Module], path: str | os.PathLike, *,
                         prefix: str = "", value_model: bool = False,
                         role: str = "actor") -> None:
    """Collective over the ranks holding ``chunks`` (this rank's unwrapped `MegarlGPTModel`
    pipeline chunks, built and before DDP wrapping): load their weights from the megatron-core
    dist checkpoint at ``path`` (keys under ``prefix``). ``value_model`` (critic, PRM): the LM
    output layer is not read, and a ``score`` head the checkpoint lacks stays as the model
    has it. ``role`` names the config keys in errors."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from megarl.backends.megatron import cpu_compat

    use_key, path_key = dist_checkpoint_keys(role)
    if not path:
        raise UserInputError(f"{use_key}=true needs {path_key}: the folder of a megatron-core "
                             "dist checkpoint (e.g. written by verl's "
                             "scripts/converter_hf_to_mcore.py)")
    folder = Path(path)
    if not (folder / "metadata.json").is_file():
        raise UserInputError(f"{path_key}={str(path)!r}: no megatron-core dist checkpoint "
                             "there (its metadata.json is missing)")
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        stored = set(dist_checkpointing.load_tensors_metadata(str(folder))) if value_model else ()
        for chunk in chunks:
            state = chunk.sharded_state_dict(prefix=prefix)
            if value_model:  # no LM output layer; a score head only if the checkpoint has one
                state = {k: v for k, v in state.items() if "output_layer" not in k and not (
                    k.startswith(prefix + "score.") and getattr(v, "key", k) not in stored)}
            try:
                loaded = dist_checkpointing.load(state, str(folder),
                                                 strict=StrictHandling.ASSUME_OK_UNEXPECTED)
            except (Exception, CheckpointException) as e:  # also megatron-core's own
                said = (str(e).strip().splitlines() or [""])[-1][:600]  # not the traceback
                raise UserInputError(
                    f"{path_key}={str(path)!r}: the dist checkpoint does not fit this model "
                    f"(dist_checkpointing_prefix {prefix!r}): {type(e).__name__}: {said}"
                ) from e
            _assign(chunk, loaded, prefix, value_model)


def _assign(chunk: torch.nn.Module, loaded: dict[str, Any], prefix: str,
            value_model: bool) -> None:
    """Copy the loaded tensors into ``chunk`` (megatron-core fills the sharded tensors in
    place for some strategies only; this makes the result independent of that). A value
    model's ``score`` head missing from the checkpoint (one converted from an LM) keeps the
    head the model has (verl keeps its freshly initialised value head the same way)."""
    own = chunk.state_dict()
    state = {k[len(prefix):]: v for k, v in loaded.items()
             if k.startswith(prefix) and torch.is_tensor(v) and k[len(prefix):] in own}
    missing = [k for k in own if not k.endswith("_extra_state") and k not in state
               and "output_layer" not in k and not (value_model and k.startswith("score."))]
    if missing:
        raise UserInputError(f"the dist checkpoint lacks model tensors: {missing[:4]}")
    chunk.load_state_dict(state, strict=False)
