"""verl 0.9's ``model_engine`` Hydra group (``model_engine=megatron`` on the command line, or
``model_engine: megatron`` in a config file), read as megarl's training strategy.

verl's trainer config composes its actor, reference and critic sections from the group
(``actor@actor_rollout_ref.actor: ${model_engine}_actor``, likewise ``_ref`` and ``_critic``),
so the one value picks the training engine of all three roles. In megarl the reference follows
the actor's strategy, so it sets ``actor_rollout_ref.actor.strategy`` and ``critic.strategy``:
``dp`` (verl's default: its FSDP workers) and ``fsdp`` / ``fsdp2`` -> ``torch``, ``megatron`` ->
``megatron``. verl's other engines are refused naming the two megarl has.
"""

from __future__ import annotations

from megarl.config.errors import ConfigError

KEY = "model_engine"
STRATEGIES = {"dp": "torch", "fsdp": "torch", "fsdp2": "torch", "megatron": "megatron"}
_TARGETS = (("actor_rollout_ref", "actor"), ("critic",))


def read_model_engine(layer: dict, source: str) -> None:
    """In place: ``model_engine`` in this config ``layer`` (nested) becomes the strategy of the
    actor (and so the reference) and of the critic; a strategy the layer sets to something else
    is an error naming both keys."""
    if KEY not in layer:
        return
    value = layer.pop(KEY)
    strategy = STRATEGIES.get(str(value))
    if strategy is None:
        raise ConfigError(
            f"{KEY}={value!r} (from {source}): megarl trains with model_engine=dp (FSDP2: "
            f"strategy torch) or model_engine=megatron (megatron-core); verl's {value!r} engine "
            "is not built here")
    for path in _TARGETS:
        node = layer
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(path)}: set as a value and as a section "
                                  f"(from {source})")
        current = node.get("strategy")
        if current is not None and STRATEGIES.get(str(current), str(current)) != strategy:
            raise ConfigError(
                f"{KEY}={value!r} and {'.'.join(path)}.strategy={current!r} (from {source}): "
                f"{KEY} picks the strategy of the actor, reference and critic; set one of them")
        node["strategy"] = strategy
