"""The RolloutEngine protocol: generation engines behind one interface (torch, vllm, sglang).

Engines take token ids (the prompt after the chat template) and return token ids plus the
logprob of each sampled token under the distribution it was actually sampled from (after
temperature / top-k / top-p). Weights arrive as a stream of (HF name, full tensor) pairs, the
same stream `megarl.rollout.reshard` produces from either training backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """Sampling settings (names as vLLM's). temperature 0 or greedy=True means argmax."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (needs a detokenizer)
    seed: int | None = None
    greedy: bool = False
    logprobs: bool = True
    ignore_eos: bool = False  # do not stop at the engine's EOS ids (stop_token_ids still stop)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


@dataclass
class Completion:
    """One sampled response.

    prompt_index: position of its prompt in the ``generate`` call's input list
    token_ids:    generated ids, the stop/EOS token included when it ended the sequence
    logprobs:     [len(token_ids)] float32 logprob of each token under the sampling distribution
    finish_reason: "stop" (EOS, stop token or stop string) or "length"
    policy_version: the version of the weights that sampled it, for engines that publish
                   versions (asynchronous rollout, `megarl.rollout.process`); else None. A
                   partial rollout's sample spans versions: this is its first token's
    token_versions: [len(token_ids)] the version that sampled each token, from a generation
                   session that tracks versions (a rollout worker's); else None
    routed_experts: [len(prompt) + len(token_ids), n_sparse, k] int16, the experts each prompt
                   and response token was routed to in each sparse (MoE) layer, -1 where the
                   engine did not run the token (the last response token); engines that record
                   routing (routing replay) fill it, else None
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: torch.Tensor | None
    finish_reason: str
    policy_version: int | None = None
    routed_experts: torch.Tensor | None = None
    token_versions: list[int] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        """``sampling.n`` completions per prompt, ordered prompt-major: the n completions of
        prompt 0 first, then prompt 1, ...

        prompt_keys: a stable integer per prompt (default: its position in ``prompts``). The
        sampling noise of a prompt is a function of (sampling.seed, its key, sample index) only,
        so with the same weights a prompt yields the same tokens whichever call, batch or rank
        it is given in (up to float reassociation): the trainer passes the prompt's position
        in the step's whole batch."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (HF name, full tensor) pairs into the engine's model."""

    def sleep(self) -> None:
        """Free the engine's memory (weights / KV cache) while training runs (colocated)."""

    def wake(self) -> None:
        """Take the memory back (the next `generate` wakes an asleep engine itself)."""

    @property
    def asleep(self) -> bool:
        """Between `sleep` and the next `wake` (or `generate`)."""

    def close(self) -> None:
        """Release the engine now (its processes, memory), not at interpreter exit; the
        engine takes no call after it."""


def resolve_prompt_keys(prompt_keys: Sequence[int] | None, num_prompts: int) -> list[int]:
    """The prompt keys of a `RolloutEngine.generate` call: one int per prompt, by default the
    prompt's position."""
    if prompt_keys is None:
        return list(range(num_prompts))
    if len(prompt_keys) != num_prompts:
        raise ValueError(f"prompt_keys has {len(prompt_keys)} entries for {num_prompts} "
                         "prompts; give one key per prompt")
    return [int(k) for k in prompt_keys]
