"""The reference role of a LoRA run: the actor's own module with its adapters switched off.

With LoRA the frozen base weights are exactly the initial policy, so the reference needs no
second copy of the model: `AdapterOffReference.logprobs` runs the actor backend's forward inside
`TorchBackend.adapters_off`, with the reference's own micro-batching
(``actor_rollout_ref.ref.log_prob_*``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch.backend import TorchBackend


class AdapterOffReference:
    """A `megarl.backends.protocol.Backend` of role ``ref`` over a LoRA actor (logprobs only:
    the reference is frozen and never exported or checkpointed)."""

    role = "ref"

    def __init__(self, actor: TorchBackend, *, forward_max_tokens: int | None,
                 forward_micro_batch_size: int | None) -> None:
        if actor.lora is None:
            raise ValueError("AdapterOffReference needs an actor with LoRA adapters")
        self.actor = actor
        self.forward_max_tokens = forward_max_tokens
        self.forward_micro_batch_size = forward_micro_batch_size

    @classmethod
    def from_config(cls, actor: TorchBackend, cfg: Any) -> AdapterOffReference:
        from megarl.backends.torch.config import backend_kwargs

        _, kw = backend_kwargs("ref", cfg, actor.model_path)
        return cls(actor, forward_max_tokens=kw["forward_max_tokens"],
                   forward_micro_batch_size=kw["forward_micro_batch_size"])

    @property
    def dp_rank(self) -> int:
        return self.actor.dp_rank

    @property
    def dp_size(self) -> int:
        return self.actor.dp_size

    def logprobs(
        self,
        batch: SequenceBatch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        micro_batches: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's no-grad (logprob [B, L], entropy [B, L] or None), float32 (see
        `TorchBackend.logprobs`)."""
        a = self.actor
        saved = a.forward_max_tokens, a.forward_micro_batch_size
        a.forward_max_tokens, a.forward_micro_batch_size = (self.forward_max_tokens,
                                                            self.forward_micro_batch_size)
        try:
            with a.adapters_off():
                return a.logprobs(batch, temperature, with_entropy, micro_batches)
        finally:
            a.forward_max_tokens, a.forward_micro_batch_size = saved

    def _frozen(self, what: str):
        raise TypeError(f"the LoRA reference (the actor with adapters off) has no {what}")

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        self._frozen("values")

    def token_scores(self, batch: SequenceBatch) -> torch.Tensor:
        self._frozen("token scores")

    def train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._frozen("optimizer")

    def routing_metrics(self, batch: SequenceBatch, rollout_logprob: torch.Tensor | None = None,
                        temperature: float = 1.0) -> dict[str, float]:
        return {}

    def export_weights(self):
        self._frozen("weights of its own (export the actor's)")

    def save(self, directory: str) -> None:
        self._frozen("checkpoint of its own (the actor's holds the adapters)")

    def load(self, directory: str) -> None:
        self._frozen("checkpoint of its own (the actor's holds the adapters)")
