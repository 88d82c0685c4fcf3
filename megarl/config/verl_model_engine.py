"""verl 0.9's ``model_engine`` Hydra group (``model_engine=megatron`` on the command line, or
``model_engine: megatron`` in a config file), read as megarl's training strategy.

verl's trainer config composes its actor, reference and critic sections from the group
(``actor@actor_rollout_ref.actor: ${model_engine}_actor``, likewise ``_ref`` and ``_critic``),
so the one value picks the training engine of all three roles. In megarl the reference follows
the actor's strategy, so it sets ``actor_rollout_ref.actor.strategy`` and ``critic.strategy``:
``dp`` (verl's default: its FSDP workers) and ``fsdp`` / ``fsdp2`` -> ``torch``, ``megatron`` ->
``megatron``. verl's other engines are refused naming the two megarl has.

``actor_rollout_ref.actor.model_engine`` (verl 0.9's scripts write it beside
``actor_rollout_ref.actor.strategy``, and its examples README names it as the replacement of the
``ppo_megatron_trainer`` config) picks the actor's engine alone (and so the reference's), with
the same values and the same refusals.
"""

from __future__ import annotations

from megarl.config.errors import ConfigError

KEY = "model_engine"
STRATEGIES = {"dp": "torch", "fsdp": "torch", "fsdp2": "torch", "megatron": "megatron"}
_TARGETS = (("actor_rollout_ref", "actor"), ("critic",))


def read_model_engine(layer: dict, source: str) -> None:
    """In place: ``model_engine`` in this config ``layer`` (nested) becomes the strategy of the
    actor (and so the reference) and of the critic, ``actor_rollout_ref.actor.model_engine``
    the actor's; a strategy the layer sets to something else is an error naming both keys."""
    if KEY in layer:
        _set_strategies(layer, KEY, layer.pop(KEY), _TARGETS, source,
                        "the strategy of the actor, reference and critic")
    actor = layer.get("actor_rollout_ref", {})
    actor = actor.get("actor") if isinstance(actor, dict) else None
    if isinstance(actor, dict) and KEY in actor:
        _set_strategies(layer, f"actor_rollout_ref.actor.{KEY}", actor.pop(KEY),
                        (("actor_rollout_ref", "actor"),), source,
                        "the strategy of the actor and reference")


def _set_strategies(layer: dict, key: str, value: object, targets: tuple[tuple[str, ...], ...],
                    source: str, what: str) -> None:
    strategy = STRATEGIES.get(str(value))
    if strategy is None:
        raise ConfigError(
            f"{key}={value!r} (from {source}): megarl trains with {key}=dp (FSDP2: "
            f"strategy torch) or {key}=megatron (megatron-core); verl's {value!r} engine "
            "is not built here")
    for path in targets:
        node = layer
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(path)}: set as a value and as a section "
                                  f"(from {source})")
        current = node.get("strategy")
        if current is not None and STRATEGIES.get(str(current), str(current)) != strategy:
            raise ConfigError(
                f"{key}={value!r} and {'.'.join(path)}.strategy={current!r} (from {source}): "
                f"{key} picks {what}; set one of them")
        node["strategy"] = strategy
