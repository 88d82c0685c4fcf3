"""The Backend protocol: what the trainer may ask of a training backend.

Two implementations exist (`megarl.backends.torch`, `megarl.backends.megatron`) and the trainer
never branches on which one it holds. One Backend object serves one role:

- ``actor``: LM head; logprobs/entropy and policy updates
- ``ref``:   LM head, frozen; logprobs only
- ``critic``: value head (HF ``*ForTokenClassification`` with ``num_labels=1``); values and updates
- ``prm``:   token-classification head with 2 labels (label 1 = correct step), frozen; token scores

Data layout (same as verl). A :class:`SequenceBatch` holds B sequences of prompt + response:
``input_ids [B, P+L]`` with the prompt **left**-padded into the first P columns and the response
**right**-padded into the last L columns, ``attention_mask [B, P+L]`` marking real tokens. Every
per-token output is returned for the response columns only, shape ``[B, L]``: entry ``[i, j]``
belongs to response token ``input_ids[i, P + j]`` (its logprob comes from the hidden state at
column ``P + j - 1``). Backends are free to remove padding and pack sequences internally; the
layout above is only the contract at the boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

ROLES = ("actor", "ref", "critic", "prm")
LM_ROLES = ("actor", "ref")  # an LM head: logprobs / entropy (the policy and its reference)
VALUE_ROLES = ("critic", "prm")  # a token-classification head: values / token scores
TRAINABLE_ROLES = ("actor", "critic")  # built with an optimizer; ref and prm are frozen


@dataclass
class SequenceBatch:
    """B sequences (prompt left-padded, response right-padded) plus per-sample tensors for losses.

    input_ids:      [B, P+L] int64
    attention_mask: [B, P+L] int64/bool, 1 on real tokens
    response_length: L, the number of trailing response columns
    tensors:        extra per-sample tensors a loss function needs, each with leading dim B
                    (e.g. ``old_logprob [B, L]``, ``advantages [B, L]``, ``response_mask [B, L]``).
                    Backends move and split them with the batch but never read them.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_length: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, L] the response columns of input_ids."""
        return self.input_ids[:, -self.response_length :]

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, L] attention mask of the response columns."""
        return self.attention_mask[:, -self.response_length :]

    def select(self, index: torch.Tensor | slice | list[int]) -> SequenceBatch:
        """Rows ``index`` of every tensor (a view for slices, a copy for index tensors)."""
        return SequenceBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            response_length=self.response_length,
            tensors={k: v[index] for k, v in self.tensors.items()},
        )

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_length=self.response_length,
            tensors={k: v.to(device) for k, v in self.tensors.items()},
        )


class HeadOutputs(Protocol):
    """What a backend hands to a loss function for one micro-batch (on the last pipeline stage).

    ``logprob``/``entropy`` are [b, L] in the padded response layout (0 outside the mask) and
    differentiable; they are computed lazily by ``megarl_kernels`` from the final hidden states
    and the (possibly vocab-parallel) LM-head weight, so full [T, V] logits never exist.
    For fused losses the raw pieces are exposed too: ``hidden [N, H]`` (the N valid response
    positions, packed), ``weight [V or V/tp, H]``, ``labels [N]``, ``flat_index`` (row, col) of
    each of the N positions in [b, L], and ``tp_group``. ``values`` [b, L] is set for critics.
    """

    temperature: float

    @property
    def logprob(self) -> torch.Tensor: ...

    @property
    def entropy(self) -> torch.Tensor: ...


LossFn = Callable[[Any, SequenceBatch], "tuple[torch.Tensor, dict[str, float]]"]
"""loss_fn(outputs: HeadOutputs, micro_batch) -> (scalar loss to backpropagate, metrics).

The loss must already carry its global normalisation (see ``megarl.algos.agg_loss``'s
``**norm``): the backend sums gradients over micro-batches and averages over data-parallel
ranks, and applies no other scaling. Metrics are treated the same way: each value is this
micro-batch's contribution, the backend SUMS them over micro-batches and AVERAGES them over
data-parallel ranks (the loss function weights ratios such as clip fractions accordingly).
"""


@runtime_checkable
class Backend(Protocol):
    """One role's model, its parallel layout, optimizer and checkpoints.

    The no-grad methods (logprobs, values, token_scores) take the same full batch on every
    rank; the backend splits it over its data-parallel replicas (micro-batching as it sees fit)
    and returns the full result on every rank.
    """

    role: str

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (ranks with equal dp_rank hold
        the same data: they differ only in tensor/pipeline shards)."""

    @property
    def dp_size(self) -> int: ...

    def logprobs(
        self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad (logprob [B, L], entropy [B, L] or None) of the response tokens under
        logits / temperature. Zero outside the response mask. Every rank passes the same full
        batch; the backend computes its data-parallel share and every rank gets the result."""

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """Critic only: no-grad values [B, L] at the response columns (value of the state
        before emitting token j is read at column P + j - 1, as verl)."""

    def token_scores(self, batch: SequenceBatch) -> torch.Tensor:
        """PRM only: no-grad token-classification logits [B, L, num_labels] at response columns
        (the PRM reads the label of step k at the column of its step-end token)."""

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, float]:
        """Forward/backward every micro-batch, accumulate, clip, one optimizer + LR-scheduler
        step. A non-finite grad norm skips the step. Returns the loss metrics (summed over
        micro-batches, averaged over DP ranks, see LossFn) plus ``grad_norm``, ``lr`` and
        ``skipped`` (0/1). Every micro-batch list has the same length on every DP rank (the
        trainer pads with fully masked micro-batches), so collectives stay matched."""

    def logprob_stats(self, batch: SequenceBatch, temperature: float = 1.0
                      ) -> dict[str, torch.Tensor]:
        """No-grad ``logprob``, ``entropy`` and ``sum_pi_squared`` [B, L] float32 of the
        response tokens in one forward (``sum_pi_squared``: sum_v pi_v^2 at each position,
        what ``optimal_token_baseline`` reads). Collective like ``logprobs``."""

    def recording_routing(self, batch: SequenceBatch) -> AbstractContextManager:
        """Mixture-of-experts actor (routing replay R2): a context manager recording the
        routing of a no-grad pass over ``batch``: ``with backend.recording_routing(seq) as
        (tagged, out): backend.logprobs(tagged)`` leaves ``out["routed_experts"]``
        [B, P + L, n_sparse, k]."""

    def routing_metrics(self, batch: SequenceBatch, rollout_logprob: torch.Tensor | None = None,
                        temperature: float = 1.0) -> dict[str, float]:
        """Mixture-of-experts actor, on a check step: ``moe/*`` routing metrics of ``batch``
        (expert load, router entropy, load-balancing loss) and, with routing replay, what
        replay changes against ``rollout_logprob`` [B, L]. ``{}`` for a dense model or where
        the layout cannot measure them. Collective."""

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (HF name, full tensor) pairs of the current weights, in HF naming and dtype
        of the training params. Collective: every rank of the backend must iterate it."""

    def save(self, directory: str) -> None:
        """Collective. Model, optimizer and LR-schedule state, loadable at another layout."""

    def load(self, directory: str) -> None:
        """Collective. Inverse of save()."""
