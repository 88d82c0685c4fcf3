"""The reference role of a LoRA run: the actor's own module with its adapters switched off.

With LoRA the frozen base weights are exactly the initial policy, so the reference needs no
second copy of the model: `AdapterOffReference.logprobs` runs the actor backend's forward inside
`TorchBackend.adapters_off`, with the reference's own micro-batching
(``actor_rollout_ref.ref.log_prob_*``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.backends import lora_reference
from megarl.backends.protocol import SequenceBatch
from megarl.backends.settings import RoleSettings
from megarl.backends.torch.backend import TorchBackend


class AdapterOffReference(lora_reference.AdapterOffReference):
    """A `megarl.backends.protocol.Backend` of role ``ref`` over a LoRA actor (logprobs only:
    the reference is frozen and never exported or checkpointed; the shared part is
    `megarl.backends.lora_reference.AdapterOffReference`)."""

    micro_settings = ("forward_max_tokens", "forward_micro_batch_size")

    def __init__(self, actor: TorchBackend, *, forward_max_tokens: int | None,
                 forward_micro_batch_size: int | None) -> None:
        if actor.lora is None:
            raise ValueError("AdapterOffReference needs an actor with LoRA adapters")
        super().__init__(actor)
        self.forward_max_tokens = forward_max_tokens
        self.forward_micro_batch_size = forward_micro_batch_size

    @classmethod
    def from_settings(cls, actor: TorchBackend, ref: RoleSettings) -> AdapterOffReference:
        """The reference of ``actor`` with the no-grad micro-batching of ``ref`` (the
        reference role's settings)."""
        from megarl.backends.torch.config import backend_kwargs

        _, kw = backend_kwargs(ref)
        return cls(actor, forward_max_tokens=kw["forward_max_tokens"],
                   forward_micro_batch_size=kw["forward_micro_batch_size"])

    def logprobs(
        self,
        batch: SequenceBatch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        micro_batches: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's no-grad (logprob [B, L], entropy [B, L] or None), float32 (see
        `TorchBackend.logprobs`)."""
        with self._as_reference() as a:
            return a.logprobs(batch, temperature, with_entropy, micro_batches)
