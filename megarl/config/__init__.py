"""Typed configuration of megarl, verl-style.

    from megarl.config import load_config
    cfg = load_config("pure_prm_vr", ["actor_rollout_ref.actor.optim.lr=1e-6"])
    cfg.actor_rollout_ref.rollout.n

YAML recipes live in ``config_dir()`` (the repository's ``configs/``) and may ``extends:`` a base;
overrides are verl/Hydra ``key=value`` strings. ``python -m megarl.config show NAME [k=v ...]``
prints the resolved config.
"""

from megarl.config.errors import ConfigError
from megarl.config.loader import (
    available_configs,
    config_dir,
    load_config,
    parse_override,
    to_dict,
    to_yaml,
    validate,
)
from megarl.config.schema import *  # noqa: F403  (the section dataclasses)
from megarl.config.schema import __all__ as _sections
from megarl.config.validate import critic_enabled

__all__ = [
    "ConfigError",
    "available_configs",
    "config_dir",
    "critic_enabled",
    "load_config",
    "parse_override",
    "to_dict",
    "to_yaml",
    "validate",
    *_sections,
]
