"""What a resume continues, said out loud; and the resumes that would change a run's meaning,
refused.

Every checkpoint carries the ``config.yaml`` of the run that wrote it
(`megarl.trainer.checkpoint.CheckpointManager.save` copies the run directory's). A resume
compares the config it starts with against that one:

- keys that change what the run is (``MEANING``: the model, the training data, the algorithm,
  the batch sizes, the optimizer and the loss) refuse the resume, one line naming the keys,
  unless ``trainer.resume=force`` (verl spelling: ``trainer.resume_mode=force``);
- every other differing key (the run's length, logging, validation, ...) is listed after
  ``resumed from step N`` with the checkpoint's path;
- a checkpoint at or past the run's last step says "nothing left to train".

``trainer.resume`` values: ``auto`` (the newest complete checkpoint of the run directory, if
any), ``force`` (the same, accepting changed settings), ``disable``, or a checkpoint path.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from megarl.config.provenance import leaves
from megarl.config.schema import Config
from megarl.errors import UserInputError

SAVED_CONFIG = "config.yaml"  # in the run directory, and copied into every checkpoint
FORCE = "force"
LATEST = ("auto", FORCE)  # the modes that take the newest complete checkpoint

# Dotted keys (a trailing "." = every key below) whose change makes a continued run a different
# run: refused on resume unless trainer.resume=force.
MEANING = (
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path",
    "data.train_files", "data.train_batch_size", "data.gen_batch_size",
    "algorithm.",
    "actor_rollout_ref.actor.optim.", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.policy_loss.",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.rollout.n",
    "critic.enable", "critic.model.path", "critic.optim.", "critic.ppo_mini_batch_size",
    "critic.ppo_epochs",
    "reward_model.enable", "reward_model.model.path", "reward_model.use_reward_loop",
    *(f"reward_model.rollout.{k}" for k in (  # what the judge's verdicts depend on
        "template", "apply_chat_template", "score_parse", "score_min", "score_max",
        "temperature", "do_sample", "top_p", "top_k", "response_length")),
    "custom_reward_function.",
    "pacs.",
)
# never compared: the resume setting itself, and the schedules' length that the trainer fills
# from the run's length (-1 = the run's length; trainer.total_training_steps is reported)
IGNORED = ("trainer.resume",)
RUN_LENGTH = (".optim.total_training_steps",)
_SHOWN = 12  # differing keys named in one line, then "and N more"


def is_meaning(key: str) -> bool:
    return any(key.startswith(m) if m.endswith(".") else key == m or key.startswith(m + ".")
               for m in MEANING)


def checkpoint_for(mode: str, latest: Path | None) -> Path | None:
    """The checkpoint ``trainer.resume=mode`` continues (``latest``: the run directory's
    newest complete one); None: start from step 0."""
    if mode == "disable":
        return None
    if mode in LATEST:
        return latest
    return Path(mode)


def _as_dict(cfg: Config | dict) -> dict:
    return cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)


def differences(saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value now) of every leaf both configs hold that differs."""
    a, b = leaves(saved), leaves(now)
    return [(k, a[k], b[k]) for k in b
            if k in a and a[k] != b[k] and not k.startswith(IGNORED)
            and not k.endswith(RUN_LENGTH)]


def _fmt(diffs: list[tuple[str, Any, Any]]) -> str:
    shown = [f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:_SHOWN]]
    more = f" and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else ""
    return ", ".join(shown) + more


def _saved_step(ckpt: Path) -> int | None:
    import json

    try:
        return int(json.loads((ckpt / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(cfg: Config, ckpt: Path, total_steps: int | None = None) -> list[str]:
    """The lines to print after ``resumed from step N`` for continuing checkpoint ``ckpt``
    with config ``cfg`` (a Config or its dict); raises UserInputError (one line) when a
    ``MEANING`` key differs from the checkpoint's config and trainer.resume is not ``force``.
    ``total_steps``: the run's length, for "nothing left to train"."""
    now = _as_dict(cfg)
    mode = now["trainer"]["resume"]
    if not (ckpt / "COMPLETE").is_file():
        raise UserInputError(
            f"trainer.resume={mode}: {ckpt} is not a complete checkpoint (no COMPLETE marker); "
            f"give a global_step_N folder of a run's checkpoints/, trainer.resume=auto or "
            f"trainer.resume=disable")
    lines = [f"  checkpoint: {ckpt} (trainer.resume={mode}; trainer.resume=disable starts "
             f"from step 0)"]
    saved_path = ckpt / SAVED_CONFIG
    if not saved_path.is_file():
        lines.append(f"  the checkpoint holds no {SAVED_CONFIG} (written by an older megarl): "
                     "settings not compared")
        diffs = []
    else:
        saved = yaml.safe_load(saved_path.read_text()) or {}
        diffs = differences(saved, now)
    meaning = [d for d in diffs if is_meaning(d[0])]
    if meaning and mode != FORCE:
        raise UserInputError(
            f"trainer.resume={mode}: the checkpoint {ckpt} was trained with other settings "
            f"(saved -> now): {_fmt(meaning)}; continuing it would change the run's meaning. "
            f"Set trainer.resume=force to continue it with the new settings, "
            f"trainer.resume=disable to train from step 0 (its checkpoints replace these), or "
            f"another trainer.default_local_dir for a new run")
    if diffs:
        lines.append(f"  settings that differ from the checkpoint's {SAVED_CONFIG} "
                     f"(saved -> now): {_fmt(diffs)}")
    elif saved_path.is_file():
        lines.append(f"  settings: as in the checkpoint's {SAVED_CONFIG}")
    step = _saved_step(ckpt)
    if total_steps is not None and step is not None and step >= total_steps:
        lines.append(
            f"nothing left to train: the checkpoint is at step {step} and the run has "
            f"{total_steps} steps; raise trainer.total_training_steps (or trainer.total_epochs) "
            f"to train further, or set trainer.resume=disable or another "
            f"trainer.default_local_dir to start a new run")
    return lines


def refuse_early(cfg: Config) -> None:
    """`check` before any model is built (and before the run directory's config.yaml is
    replaced): raises UserInputError for a refused resume; nothing otherwise."""
    from megarl.trainer.checkpoint import CheckpointManager

    t = cfg.trainer
    latest = CheckpointManager(Path(t.default_local_dir) / "checkpoints").latest() \
        if t.resume in LATEST else None
    ckpt = checkpoint_for(t.resume, latest)
    if ckpt is not None:
        check(cfg, ckpt)
