"""Atomic checkpoints and exact resume.

Layout under ``root`` (``<trainer.default_local_dir>/checkpoints``)::

    global_step_6/            a complete checkpoint (only complete ones carry this name)
        actor/ critic/ ...    each role's Backend.save() output (collective)
        actor/huggingface/    with "hf_model" in actor.checkpoint.save_contents: the actor as
                              a Hugging Face model folder (weights, config, tokenizer files)
        rng/rank{r}.pt        every rank's RNG states
        trainer_state.json    step, dataloader position, KL controller, ...
        config.yaml           the run directory's config.yaml when saved (what a resume compares)
        COMPLETE              written last, before the rename
    .tmp_global_step_9/       a checkpoint being written (ignored by resume; removed by the next save)
    .old_global_step_3/       a checkpoint being deleted (pruned or replaced; likewise)

A save writes everything into the temp directory, fsyncs it, marks it COMPLETE and renames it
into place (rename is atomic on POSIX), so a kill at any moment leaves the previous checkpoint
usable and ``latest()`` never returns a partial one. A checkpoint is deleted the same way round:
renamed out of the ``global_step_N`` names first, then removed, so a kill in the middle of the
removal never leaves a half-deleted ``global_step_N`` behind. Every save starts by removing the
temporary folders that a killed run left (one writer per run directory: megarl.trainer.run_lock).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl.utils import dist as mdist

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|old)_global_step_\d+$")
COMPLETE = "COMPLETE"
HF_MODEL = "hf_model"  # the save_contents entry that adds the HF folder (verl's name)
HF_FOLDER = "huggingface"  # under the actor's checkpoint folder, as in verl's checkpoints


def wants_hf_model(save_contents: list[str] | None) -> bool:
    """Whether ``actor_rollout_ref.actor.checkpoint.save_contents`` asks for the HF folder."""
    return HF_MODEL in (save_contents or [])


def write_hf_model(actor: Any, source_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Collective: the actor (a Backend) as a Hugging Face model folder at ``out``, the same
    export as the run's final ``hf_actor/`` (``save_hf_checkpoint`` of ``export_weights()``:
    merged weights under LoRA, config.json and the tokenizer files of ``source_dir``, the HF
    folder the actor started from). Rank 0 writes; every rank takes part in the gathers."""
    from megarl.models import read_hf_config, save_hf_checkpoint

    stream = actor.export_weights()
    if mdist.rank() == 0:
        save_hf_checkpoint(out, stream, read_hf_config(source_dir), source_dir=source_dir,
                           overwrite=True)
    else:
        for _ in stream:
            pass
    mdist.barrier()
    return Path(out)


def _megatron_parallel() -> Any:
    """megarl's megatron parallel module where this process built a megatron backend (never
    imported here: a torch-only run does not load megatron-core)."""
    return sys.modules.get("megarl.backends.megatron.parallel")


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU and CUDA, megatron's named states
    where a megatron backend seeded them: LoRA dropout draws from one) as weights_only-safe
    data."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    megatron = _megatron_parallel()
    tracker = megatron.rng_tracker_states() if megatron is not None else None
    if tracker is not None:
        state["megatron_tracker"] = tracker
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    megatron = _megatron_parallel()
    if "megatron_tracker" in state and megatron is not None and (
            megatron.rng_tracker_states() is not None):
        megatron.set_rng_tracker_states(state["megatron_tracker"])


def _fsync_tree(path: Path) -> None:
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CheckpointManager:
    """Save / find / load step checkpoints; keep the last ``keep_last`` (None or <= 0: all)."""

    def __init__(self, root: str | os.PathLike, keep_last: int | None = None) -> None:
        self.root = Path(root)
        self.keep_last = keep_last if keep_last and keep_last > 0 else None

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / COMPLETE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def save(
        self,
        step: int,
        write_roles: Callable[[Path], None],
        trainer_state: dict[str, Any],
    ) -> Path:
        """Collective: every rank calls it. ``write_roles(tmp_dir)`` saves each backend under
        tmp_dir (collective too); rank 0 writes trainer_state and publishes the directory."""
        rank = mdist.rank()
        tmp = self.root / f".tmp_global_step_{step}"
        final = self.step_dir(step)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self.remove_leftovers()
            tmp.mkdir()
            (tmp / "rng").mkdir()
        mdist.barrier()
        write_roles(tmp)
        torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")
        mdist.barrier()
        if rank == 0:
            config = self.root.parent / "config.yaml"  # the run's (megarl.trainer.resume_config)
            if config.is_file():
                shutil.copyfile(config, tmp / "config.yaml")
            with open(tmp / "trainer_state.json", "w") as f:
                json.dump(trainer_state, f, indent=1, sort_keys=True)
            _fsync_tree(tmp)
            with open(tmp / COMPLETE, "w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            old = None
            if final.exists():  # re-saving a step (e.g. after a resume): replace it
                old = self._set_aside(final)
            os.rename(tmp, final)
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune()
        mdist.barrier()
        return final

    def remove_leftovers(self) -> list[str]:
        """Remove the temporary folders (``.tmp_*`` being written, ``.old_*`` being deleted)
        that a killed save left; returns their names. Call it where no save is under way."""
        if not self.root.is_dir():
            return []
        gone = sorted(c.name for c in self.root.iterdir() if _LEFTOVER.match(c.name))
        for name in gone:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return gone

    def _set_aside(self, ckpt: Path) -> Path:
        """Rename ``ckpt`` out of the step names (atomic), so that deleting it, however far the
        deletion gets, never leaves a partial global_step_N."""
        aside = ckpt.with_name(f".old_{ckpt.name}")
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(ckpt, aside)
        return aside

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for old in self.complete_steps()[: -self.keep_last]:
            shutil.rmtree(self._set_aside(self.step_dir(old)), ignore_errors=True)

    @staticmethod
    def load_trainer_state(ckpt: Path) -> dict[str, Any]:
        with open(ckpt / "trainer_state.json") as f:
            return json.load(f)

    @staticmethod
    def load_rng(ckpt: Path, rank: int) -> None:
        path = ckpt / "rng" / f"rank{rank}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no RNG state for rank {rank}; the checkpoint was written by a run with "
                "fewer ranks. Resume with the same number of processes for an exact resume."
            )
        set_rng_state(torch.load(path, weights_only=True))
