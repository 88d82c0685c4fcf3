"""The reference role of a LoRA run, shared by both backends: the actor's own model with its
adapters switched off.

With LoRA the frozen base weights are exactly the initial policy, so the reference needs no
second copy of the model. `AdapterOffReference` holds what every backend's reference does the
same way: the data-parallel coordinates of the actor, the swap of the actor's no-grad
micro-batch settings for the reference's own (``actor_rollout_ref.ref.log_prob_*``) around a
forward with the adapters off, and the refusal of everything a frozen reference has not
(values, scores, an optimizer, weights or a checkpoint of its own). The backends' subclasses
(`megarl.backends.torch.lora_reference`, `megarl.backends.megatron.lora`) build it from the config
and run ``logprobs``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NoReturn

import torch


class AdapterOffReference:
    """A `megarl.backends.protocol.Backend` of role ``ref`` over a LoRA actor (logprobs only:
    the reference is frozen and never exported or checkpointed).

    ``micro_settings`` names the actor's no-grad micro-batching attributes that the reference
    replaces by its own (same names on the reference) while it runs."""

    role = "ref"
    micro_settings: tuple[str, ...] = ()

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @property
    def dp_rank(self) -> int:
        return self.actor.dp_rank

    @property
    def dp_size(self) -> int:
        return self.actor.dp_size

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[Any]:
        """Inside: the actor (yielded) with the reference's micro-batch settings and its
        adapters off; both restored on the way out."""
        a = self.actor
        saved = {k: getattr(a, k) for k in self.micro_settings}
        for k in self.micro_settings:
            setattr(a, k, getattr(self, k))
        try:
            with a.adapters_off():
                yield a
        finally:
            for k, v in saved.items():
                setattr(a, k, v)

    def _frozen(self, what: str) -> NoReturn:
        raise TypeError(f"the LoRA reference (the actor with adapters off) has no {what}")

    def values(self, batch: Any) -> torch.Tensor:
        self._frozen("values")

    def token_scores(self, batch: Any) -> torch.Tensor:
        self._frozen("token scores")

    def train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._frozen("optimizer")

    def routing_metrics(self, batch: Any, rollout_logprob: torch.Tensor | None = None,
                        temperature: float = 1.0) -> dict[str, float]:
        return {}

    def export_weights(self) -> NoReturn:
        self._frozen("weights of its own (export the actor's)")

    def save(self, directory: str) -> None:
        self._frozen("checkpoint of its own (the actor's holds the adapters)")

    def load(self, directory: str) -> None:
        self._frozen("checkpoint of its own (the actor's holds the adapters)")
