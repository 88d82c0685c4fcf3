"""Key spellings of verl / PURE / PACS that megarl reads into its own keys.

Applied to every layer (each YAML file, and the override list) before layers are merged, so
``actor_rollout_ref.pacs.beta=2`` on the command line overrides ``pacs.beta`` from a file.
Value spellings (``strategy: fsdp``, ``rollout.name: hf``, ``credit_assignment: gamma-decay``)
are handled by the schema fields' ``aliases`` metadata instead.

| written (alias)                                  | read as                                  |
|--------------------------------------------------|------------------------------------------|
| actor_rollout_ref.pacs.*                         | pacs.* (PACS)                            |
| reward_model.custom_reward_function.*            | custom_reward_function.*                 |
| algorithm.kl_ctl.* (older verl)                  | algorithm.kl_ctrl.*                      |
| algorithm.kl_ctrl.init_kl_coef (older verl)      | algorithm.kl_ctrl.kl_coef                |
| {actor,critic}.optim.warmup_style                | ...optim.lr_scheduler_type               |
| {actor,critic}.megatron.{tensor,pipeline,virtual_pipeline}_model_parallel_size, sequence_parallel | ...parallel.* |
| actor_rollout_ref.rollout.enable_sleep           | actor_rollout_ref.rollout.free_cache_engine |
| trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep | trainer.max_ckpt_to_keep         |
| trainer.resume_mode + trainer.resume_from_path   | trainer.resume (see ``_resume``)         |
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from megarl.config.errors import ConfigError

log = logging.getLogger("megarl.config")

_ACTOR = "actor_rollout_ref.actor"
_MEGATRON_PARALLEL = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "sequence_parallel",
)

KEY_ALIASES: list[tuple[str, str]] = [
    ("actor_rollout_ref.pacs", "pacs"),
    ("reward_model.custom_reward_function", "custom_reward_function"),
    ("algorithm.kl_ctl", "algorithm.kl_ctrl"),
    ("algorithm.kl_ctrl.init_kl_coef", "algorithm.kl_ctrl.kl_coef"),
    (f"{_ACTOR}.optim.warmup_style", f"{_ACTOR}.optim.lr_scheduler_type"),
    ("critic.optim.warmup_style", "critic.optim.lr_scheduler_type"),
    *[(f"{r}.megatron.{k}", f"{r}.parallel.{k}") for r in (_ACTOR, "critic") for k in _MEGATRON_PARALLEL],
    ("actor_rollout_ref.rollout.enable_sleep", "actor_rollout_ref.rollout.free_cache_engine"),
    ("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    ("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
]

_ABSENT = object()


def _get(tree: dict, path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _pop(tree: dict, path: str) -> Any:
    *parents, last = path.split(".")
    node: Any = tree
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    if not isinstance(node, dict) or last not in node:
        return _ABSENT
    return node.pop(last)


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _merge_alias(existing: Any, value: Any, src: str, dst: str, source: str) -> Any:
    """Both the alias and the canonical key are in one layer: fine if they agree."""
    if isinstance(existing, dict) and isinstance(value, dict):
        out = dict(existing)
        for k, v in value.items():
            out[k] = _merge_alias(existing[k], v, f"{src}.{k}", f"{dst}.{k}", source) if k in existing else v
        return out
    if existing != value:
        raise ConfigError(
            f"{dst}: also given as {src} (read as {dst}) with a different value "
            f"({existing!r} vs {value!r}) in {source}; keep one of them"
        )
    return existing


def _resume(layer: dict, source: str) -> None:
    """verl's ``resume_mode`` (auto | disable | resume_path) + ``resume_from_path`` -> ``resume``.
    A ``resume_from_path`` given without ``resume_mode`` is read as a path to resume from (verl
    would ignore it under its default mode auto)."""
    trainer = layer.get("trainer")
    if not isinstance(trainer, dict) or not ({"resume_mode", "resume_from_path"} & trainer.keys()):
        return
    mode = trainer.pop("resume_mode", None)
    path = trainer.pop("resume_from_path", None)
    if mode not in (None, "auto", "disable", "resume_path"):
        raise ConfigError(
            f"trainer.resume_mode: invalid choice {mode!r}; expected one of 'auto', 'disable', "
            f"'resume_path' (or set trainer.resume=auto|disable|<path>) in {source}"
        )
    if mode == "resume_path" or (mode is None and path is not None):
        if path is None:
            raise ConfigError(
                f"trainer.resume_mode: 'resume_path' needs trainer.resume_from_path in the same "
                f"place ({source}); or set trainer.resume=<checkpoint path>"
            )
        value = path
    else:
        value = mode if mode is not None else "auto"
    if "resume" in trainer and trainer["resume"] != value:
        raise ConfigError(
            f"trainer.resume: also given as trainer.resume_mode/resume_from_path with a different "
            f"value ({trainer['resume']!r} vs {value!r}) in {source}; keep one of them"
        )
    trainer["resume"] = value


def canonical_keys(layer: dict, source: str) -> dict:
    """A copy of one config layer with alias keys moved to their megarl keys."""
    layer = copy.deepcopy(layer)
    for src, dst in KEY_ALIASES:
        value = _pop(layer, src)
        if value is _ABSENT:
            continue
        log.info("%s: read as %s (%s)", src, dst, source)
        existing = _get(layer, dst)
        _set(layer, dst, value if existing is _ABSENT else _merge_alias(existing, value, src, dst, source))
    _resume(layer, source)
    return layer
