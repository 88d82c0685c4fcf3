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
| algorithm.adv_norm (PURE)                        | algorithm.pure.normalize                 |
| reward_model.split_step_char (PURE)              | reward_model.step_separator              |
| reward_model.step_separator (PURE, see below)    | reward_model.prm_step_token              |
| reward_model.reward_kwargs.overlong_buffer_cfg.* (verl main_ppo / DAPO) | reward_model.overlong_buffer.* |
| reward_model.reward_kwargs.max_resp_len (DAPO)   | reward_model.overlong_buffer.max_resp_len |
| trainer.nnodes / trainer.n_gpus_per_node (verl)  | launch.nnodes / launch.nproc_per_node    |
| reward_model.type: prm (PURE / verl)             | checked, then dropped (the reward model is a PRM) |

PURE's ``reward_model.step_separator`` is the text put at each step end of the PRM input
(megarl's ``prm_step_token``); megarl's own ``step_separator`` is the text that ends a step
(PURE's ``split_step_char``). A layer (one file, or the overrides) that writes
``step_separator`` without ``prm_step_token`` is read with PURE's meaning; one that writes both
(megarl's recipes and the ``config.yaml`` a run saves) keeps megarl's (see ``_pure_steps``).
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
    "context_parallel_size",
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
    ("algorithm.adv_norm", "algorithm.pure.normalize"),
    ("reward_model.split_step_char", "reward_model.step_separator"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg", "reward_model.overlong_buffer"),
    ("reward_model.reward_kwargs.max_resp_len", "reward_model.overlong_buffer.max_resp_len"),
    # verl's names for the world torchrun starts (one setting, whichever spelling wrote it last)
    ("trainer.nnodes", "launch.nnodes"),
    ("trainer.n_gpus_per_node", "launch.nproc_per_node"),
]

_ABSENT = object()


def get_path(tree: dict, path: str, default: Any = None) -> Any:
    """``tree[a][b][c]`` for ``path`` = "a.b.c"; ``default`` where a level is missing."""
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _get(tree: dict, path: str) -> Any:
    return get_path(tree, path, _ABSENT)


def _pop(tree: dict, path: str) -> Any:
    """Remove ``path`` and the mappings it leaves empty; its value, or _ABSENT."""
    *parents, last = path.split(".")
    chain: list[Any] = [tree]
    for part in parents:
        if not isinstance(chain[-1], dict) or part not in chain[-1]:
            return _ABSENT
        chain.append(chain[-1][part])
    if not isinstance(chain[-1], dict) or last not in chain[-1]:
        return _ABSENT
    value = chain[-1].pop(last)
    for node, part in zip(reversed(chain[:-1]), reversed(parents)):
        if node[part]:
            break
        del node[part]
    return value


def set_path(tree: dict, path: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``path`` = "a.b.c", making (or replacing with) a
    mapping at every level that is not one."""
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
    """verl's ``resume_mode`` (auto | disable | resume_path) + ``resume_from_path`` -> ``resume``
(and megarl's ``force``: auto, accepting changed settings; megarl.trainer.resume_config).
    A ``resume_from_path`` given without ``resume_mode`` is read as a path to resume from (verl
    would ignore it under its default mode auto)."""
    trainer = layer.get("trainer")
    if not isinstance(trainer, dict) or not ({"resume_mode", "resume_from_path"} & trainer.keys()):
        return
    mode = trainer.pop("resume_mode", None)
    path = trainer.pop("resume_from_path", None)
    if mode not in (None, "auto", "disable", "resume_path", "force"):
        raise ConfigError(
            f"trainer.resume_mode: invalid choice {mode!r}; expected one of 'auto', 'disable', "
            f"'resume_path', 'force' (or set trainer.resume=auto|force|disable|<path>) in {source}"
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


def _pure_steps(layer: dict, source: str) -> None:
    """PURE's ``reward_model.step_separator`` (the PRM-input token) -> ``prm_step_token``,
    unless the layer also writes ``prm_step_token`` (megarl's meaning: the text ending a step);
    ``reward_model.type`` must be ``prm``."""
    rm = layer.get("reward_model")
    if not isinstance(rm, dict):
        return
    if "type" in rm:
        kind = rm.pop("type")
        if kind != "prm":
            raise ConfigError(
                f"reward_model.type: {kind!r} is not supported; megarl's reward model is a "
                f"process reward model (type prm, token classification with 2 labels); set "
                f"reward_model.type=prm or drop it ({source})"
            )
    if "step_separator" in rm and "prm_step_token" not in rm:
        rm["prm_step_token"] = rm.pop("step_separator")
        log.info("reward_model.step_separator: read as reward_model.prm_step_token (PURE's "
                 "meaning: the text at each step end of the PRM input; the text that ends a "
                 "step is reward_model.split_step_char) (%s)", source)


def _drop_empty(layer: dict, path: str) -> None:
    """Remove the mapping at ``path`` when aliasing left it empty."""
    value = _get(layer, path)
    if isinstance(value, dict) and not value:
        _pop(layer, path)


def canonical_keys(layer: dict, source: str) -> dict:
    """A copy of one config layer with alias keys moved to their megarl keys."""
    layer = copy.deepcopy(layer)
    _pure_steps(layer, source)
    for src, dst in KEY_ALIASES:
        value = _pop(layer, src)
        if value is _ABSENT:
            continue
        log.info("%s: read as %s (%s)", src, dst, source)
        existing = _get(layer, dst)
        if existing is not _ABSENT and value is None:
            continue  # an unset alias beside its key (a saved config lists both)
        set_path(layer, dst, value if existing is _ABSENT else _merge_alias(existing, value, src, dst, source))
    _drop_empty(layer, "reward_model.reward_kwargs")
    _resume(layer, source)
    return layer
