"""Name -> function registries for advantage estimators and policy losses.

Users add their own with the decorators::

    @register_advantage_estimator("my_adv", needs=("groups",))
    def my_adv(*, token_rewards, response_mask, group_index, values, gamma, lam,
               norm_adv_by_std, eps, baselines):
        ...
        return advantages, returns            # both [B, L]

    @register_policy_loss("my_loss")
    def my_loss(*, logprob, old_logprob, advantages, response_mask, clip_ratio_low,
                clip_ratio_high, clip_ratio_c, agg_mode, rollout_is_weights, norm):
        ...
        return loss, {"pg_loss": ..., "pg_clipfrac": ..., "pg_clipfrac_lower": ..., "ppo_kl": ...}

A loss without an importance ratio (its gradient does not read ``old_logprob``: REINFORCE's
`-A logp`) is registered with ``ratio=False`` (`RATIO_FREE_LOSSES`): with asynchronous rollout
its samples of an older policy version are corrected by the truncated importance weights alone
(`megarl.trainer.correction`), which such a run must then enable.

A loss with settings of its own declares them with their defaults,
``register_policy_loss("my_loss", options={"tau": 1.0})``: it is then also called with
``tau=...`` (`POLICY_LOSS_OPTIONS`), and no other loss is.

Every registered function is called with all of the keyword arguments above (inputs already
validated: shapes match, masks are bool); `norm` is the dict of global-normalisation arguments
for `agg_loss` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor).

`needs` declares what an estimator cannot do without (`NEEDS`); the config checks and the
trainer read it (`algorithm.adv_estimator` with `rollout.n = 1` is refused for "groups", a critic
is built for "values", a greedy response per prompt is generated and scored for "baselines").
An estimator whose inputs are not the ones above (PURE's pipeline reads PRM step scores and
verifiable rewards separately) is registered with `register_advantage_pipeline`: its name may
be chosen in a config like any other, and a trainer algorithm of the same name calls it
(`megarl.trainer.algorithm`); `compute_advantages` does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {}
ADVANTAGE_PIPELINES: dict[str, Callable[..., Any]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}
RATIO_FREE_LOSSES: set[str] = set()  # policy losses registered with ratio=False
# policy loss name -> its own options and their defaults (register_policy_loss(options=...))
POLICY_LOSS_OPTIONS: dict[str, dict[str, float]] = {}
ESTIMATOR_NEEDS: dict[str, frozenset[str]] = {}  # estimator or pipeline name -> its needs
ESTIMATOR_TRAITS: dict[str, frozenset[str]] = {}  # estimator or pipeline name -> its traits
# estimator or pipeline name -> the config block only it reads (e.g. "algorithm.pure")
ESTIMATOR_CONFIG_BLOCKS: dict[str, str] = {}

NEEDS = {
    "groups": "compares the responses of one prompt (group_index; rollout.n >= 2)",
    "values": "[B, L] values of a critic (gae)",
    "baselines": "[B] score of a greedy response to each prompt (remax)",
}

# what the config checks and the trainer ask of an estimator besides its inputs
TRAITS = {
    "singleton_groups": "a group of one response is defined: its advantage is its own score "
                        "(verl's GRPO rule: mean 0, std 1), so rollout.n = 1 is allowed",
    "step_scores": "reads a process reward model's step scores when reward_model.enable "
                   "(PURE's PRM modes)",
}


def _register(registry: dict[str, Callable[..., Any]], kind: str, name: str,
              others: tuple[dict[str, Callable[..., Any]], ...] = ()) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        existing = registry.get(name)
        for other in others:
            existing = existing or other.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"{kind} {name!r} is already registered ({existing.__module__}.{existing.__qualname__}); "
                "pick another name"
            )
        registry[name] = fn
        return fn

    return decorator


def _needs(kind: str, name: str, needs: Iterable[str]) -> frozenset[str]:
    if isinstance(needs, str):
        needs = (needs,)
    out = frozenset(needs)
    unknown = sorted(out - set(NEEDS))
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown needs {unknown}; valid: {sorted(NEEDS)}")
    return out


def _estimator(registry: dict[str, Callable[..., Any]], kind: str, name: str,
               needs: Iterable[str], traits: Iterable[str],
               config_block: str | None) -> Callable[[F], F]:
    others = (ADVANTAGE_PIPELINES,) if registry is ADVANTAGE_ESTIMATORS else (ADVANTAGE_ESTIMATORS,)
    register = _register(registry, kind, name, others)
    declared = _needs(kind, name, needs)
    traits = frozenset((traits,) if isinstance(traits, str) else traits)
    unknown = sorted(traits - set(TRAITS))
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown traits {unknown}; valid: {sorted(TRAITS)}")

    def decorator(fn: F) -> F:
        register(fn)
        ESTIMATOR_NEEDS[name] = declared
        ESTIMATOR_TRAITS[name] = traits
        if config_block is not None:
            ESTIMATOR_CONFIG_BLOCKS[name] = config_block
        return fn

    return decorator


def register_advantage_estimator(name: str, *, needs: Iterable[str] = (),
                                 traits: Iterable[str] = (),
                                 config_block: str | None = None) -> Callable[[F], F]:
    """Decorator: register `fn` in ADVANTAGE_ESTIMATORS under `name`, needing `needs` (NEEDS),
    with `traits` (TRAITS); `config_block`: a config block only this estimator reads."""
    return _estimator(ADVANTAGE_ESTIMATORS, "advantage estimator", name, needs, traits,
                      config_block)


def register_advantage_pipeline(name: str, *, needs: Iterable[str] = (),
                                traits: Iterable[str] = (),
                                config_block: str | None = None) -> Callable[[F], F]:
    """Decorator: register `fn` in ADVANTAGE_PIPELINES under `name`: an estimator with inputs
    of its own, called by the trainer algorithm of the same name (not by compute_advantages);
    `needs`, `traits` and `config_block` as `register_advantage_estimator`'s."""
    return _estimator(ADVANTAGE_PIPELINES, "advantage pipeline", name, needs, traits,
                      config_block)


def register_policy_loss(name: str, *, ratio: bool = True,
                         options: dict[str, float] | None = None) -> Callable[[F], F]:
    """Decorator: register `fn` in POLICY_LOSSES under `name`; ``ratio=False`` for a loss
    that takes no ratio against ``old_logprob`` (module doc). ``options``: keyword arguments of
    this loss alone with their defaults (SAPO's ``tau_pos``/``tau_neg``); `policy_loss` passes
    them, taken from its ``options`` argument where given, to this loss only."""
    register = _register(POLICY_LOSSES, "policy loss", name)
    declared = dict(options or {})

    def decorator(fn: F) -> F:
        register(fn)
        POLICY_LOSS_OPTIONS[name] = declared
        if ratio:
            RATIO_FREE_LOSSES.discard(name)
        else:
            RATIO_FREE_LOSSES.add(name)
        return fn

    return decorator


def policy_loss_has_ratio(name: str) -> bool:
    """Whether the policy loss ``name`` takes an importance ratio against ``old_logprob``
    (every loss but those registered with ``ratio=False``)."""
    return name not in RATIO_FREE_LOSSES


def estimator_names() -> list[str]:
    """Every name `algorithm.adv_estimator` may take: the estimators, then the pipelines, each
    in the order registered."""
    return [*ADVANTAGE_ESTIMATORS, *(n for n in ADVANTAGE_PIPELINES if n not in ADVANTAGE_ESTIMATORS)]


def estimator_needs(name: str) -> frozenset[str]:
    """What the estimator or pipeline `name` needs (a subset of NEEDS); ValueError listing the
    valid names if there is none."""
    if name not in ADVANTAGE_ESTIMATORS and name not in ADVANTAGE_PIPELINES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {estimator_names()}")
    return ESTIMATOR_NEEDS.get(name, frozenset())


def estimator_traits(name: str) -> frozenset[str]:
    """The traits (TRAITS) the estimator or pipeline `name` was registered with; ValueError
    listing the valid names if there is none."""
    estimator_needs(name)
    return ESTIMATOR_TRAITS.get(name, frozenset())


def estimators_reading(block: str) -> list[str]:
    """The estimators and pipelines registered as the readers of config block ``block``."""
    return [n for n, b in ESTIMATOR_CONFIG_BLOCKS.items() if b == block]


def lookup(registry: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    """Return `registry[name]` or raise ValueError listing the valid names."""
    fn = registry.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {sorted(registry)}")
    return fn
