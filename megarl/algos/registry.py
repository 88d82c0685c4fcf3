"""Name -> function registries for advantage estimators and policy losses.

Users add their own with the decorators::

    @register_advantage_estimator("my_adv")
    def my_adv(*, token_rewards, response_mask, group_index, values, gamma, lam,
               norm_adv_by_std, eps, baselines):
        ...
        return advantages, returns            # both [B, L]

    @register_policy_loss("my_loss")
    def my_loss(*, logprob, old_logprob, advantages, response_mask, clip_ratio_low,
                clip_ratio_high, clip_ratio_c, agg_mode, rollout_is_weights, norm):
        ...
        return loss, {"pg_loss": ..., "pg_clipfrac": ..., "pg_clipfrac_lower": ..., "ppo_kl": ...}

Every registered function is called with all of the keyword arguments above (inputs already
validated: shapes match, masks are bool); `norm` is the dict of global-normalisation arguments
for `agg_loss` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def _register(registry: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        existing = registry.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"{kind} {name!r} is already registered ({existing.__module__}.{existing.__qualname__}); "
                "pick another name"
            )
        registry[name] = fn
        return fn

    return decorator


def register_advantage_estimator(name: str) -> Callable[[F], F]:
    """Decorator: register `fn` in ADVANTAGE_ESTIMATORS under `name`."""
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: register `fn` in POLICY_LOSSES under `name`."""
    return _register(POLICY_LOSSES, "policy loss", name)


def lookup(registry: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    """Return `registry[name]` or raise ValueError listing the valid names."""
    fn = registry.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {sorted(registry)}")
    return fn
