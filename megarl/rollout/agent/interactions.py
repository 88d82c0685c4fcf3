"""Interactions: a simulated user who answers the model's turns (verl's ``BaseInteraction``).

    interactions = load_interactions("interaction_config.yaml")  # verl's YAML, verl's names

After an assistant turn without a tool call, the agent loop asks the trajectory's interaction
for the next user turn: ``generate_response(instance_id, messages, **interaction_kwargs)`` ->
(should_terminate_sequence, response_content, current_turn_score, additional_data). The user
turn is appended as the chat template renders it (response_mask 0) unless the interaction ends
the conversation. ``interaction_kwargs`` is the row's ``extra_info.interaction_kwargs``; its
``name`` picks the interaction (verl's rule).

verl's file format (verl/interactions/utils/interaction_registry.py)::

    interaction:
      - name: gsm8k             # optional: default the class name without "Interaction", lowercased
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

verl's own classes that megarl has built in (`VERL_BUILTINS`: the gsm8k interaction) are read
as megarl's, with a notice; any other class is imported by its dotted path and must subclass
`BaseInteraction` (a verl interaction ports by importing it from here instead of verl).
"""

from __future__ import annotations

import logging
import os
from typing import Any
from uuid import uuid4

from megarl.errors import UserInputError

logger = logging.getLogger(__name__)


class BaseInteraction:
    """verl's interaction protocol (same methods, same arguments, same defaults)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return str(uuid4()) if instance_id is None else instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, *args, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, *args, **kwargs) -> None:
        return None


class Gsm8kInteraction(BaseInteraction):
    """verl's gsm8k interaction: the last assistant message's ``#### <number>`` (strict) against
    ``ground_truth`` (from interaction_kwargs): 1.0 and "Your response is correct!" (the
    conversation ends), else 0.0 and a request to try again."""

    CORRECT = "Your response is correct!"
    INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(dict(config or {}))
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None,
                                ground_truth: str | None = None, **kwargs) -> str:
        instance_id = str(uuid4()) if instance_id is None else instance_id
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth,
                                        "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        content = next((m.get("content") or "" for m in reversed(messages)
                        if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, self.CORRECT, reward, {}
        return False, self.INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        from megarl.rewards.gsm8k import gsm8k_score

        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k_score(state["response"], state["ground_truth"], method="strict",
                           format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


# verl's dotted class names that megarl reads as its own built-ins
VERL_BUILTINS = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
}


def default_name(class_name: str) -> str:
    """verl's default interaction name: the class name without "Interaction", lowercased."""
    simple = class_name.rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def load_interactions(path: str | os.PathLike) -> dict[str, BaseInteraction]:
    """The interactions of verl's interaction config YAML at ``path``, by name (a
    UserInputError names the file and the entry on bad input)."""
    from megarl.rollout.agent.tools import _import_class, config_entries

    out: dict[str, BaseInteraction] = {}
    for where, entry, config in config_entries(path, "interaction", "interaction",
                                               ("name", "class_name", "config")):
        class_name = entry["class_name"]
        name = entry.get("name") or default_name(class_name)
        if name in out:
            raise UserInputError(f"{where}: a second interaction named {name!r}")
        config = {**config, "name": name}  # verl injects the name
        try:
            cls = VERL_BUILTINS.get(class_name)
            if cls is not None:
                logger.warning("interaction %r: verl's %s runs as megarl's built-in %s.%s",
                               name, class_name, cls.__module__, cls.__qualname__)
            else:
                cls = _import_class(class_name)
                if not issubclass(cls, BaseInteraction):
                    raise ValueError(f"{class_name} is not a subclass of "
                                     "megarl.rollout.agent.interactions.BaseInteraction")
            out[name] = cls(config=config)
        except UserInputError:
            raise
        except Exception as e:  # noqa: BLE001 - a user class failing in any way
            raise UserInputError(f"{where}: {type(e).__name__}: {e}") from None
    return out
