"""PromptSampler: deterministic epochs of prompt indices whose position is checkpointed.

The order of epoch e is a permutation drawn from numpy's PCG64 seeded with (seed, e), so it is
a pure function of (seed, epoch, n) and needs no RNG state in the checkpoint: ``state_dict()``
holds only epoch, position and seed, and a sampler restored from it continues with exactly
the batches the original would have produced. The sampler yields GLOBAL batches; splitting a
batch over data-parallel ranks is the trainer's job.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megarl.errors import UserInputError


class PromptSampler:
    """Batches of dataset indices, epoch after epoch.

    Args:
        n: dataset size
        batch_size: prompts per batch (global, all ranks together)
        shuffle: a fresh permutation each epoch (else 0..n-1 in order)
        seed: base seed of the permutations
        drop_last: skip the incomplete tail of each epoch (else it is a short last batch)
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if n <= 0:
            raise ValueError(f"PromptSampler needs a non-empty dataset, got n={n}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > n:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({n} prompts) with "
                f"drop_last=True: no batch could ever be drawn; lower the batch size"
            )
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle
        self.seed, self.drop_last = int(seed), drop_last
        self.epoch = 0
        self.position = 0  # prompts of the current epoch already handed out
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index order of one epoch (int64 [n])."""
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(self.n).astype(np.int64)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _remaining_usable(self) -> int:
        rest = self.n - self.position
        return rest if not self.drop_last or rest >= self.batch_size else 0

    def next_batch(self) -> list[int]:
        """The next batch of indices; rolls over to the next epoch when this one is used up."""
        if self._remaining_usable() == 0:
            self.epoch += 1
            self.position = 0
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
        end = min(self.position + self.batch_size, self.n)
        batch = self._order[self.position : end].tolist()
        self.position = end
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the dataset size and shuffle mode must match the checkpoint."""
        if state.get("kind") == "extern":
            raise UserInputError("the checkpoint's prompts came from a user sampler "
                                 "(data.sampler.class_path); resume with the same data.sampler "
                                 "settings, or start a fresh run")
        for key in ("epoch", "position", "seed"):
            if key not in state:
                raise KeyError(f"sampler state is missing {key!r} (got keys {sorted(state)})")
        if "n" in state and int(state["n"]) != self.n:
            raise UserInputError(
                f"sampler checkpoint was taken on {state['n']} prompts but the dataset now has "
                f"{self.n}; resuming would not continue the same order (use the same data files "
                f"and filters, or start a fresh run)"
            )
        if "shuffle" in state and bool(state["shuffle"]) != self.shuffle:
            raise UserInputError(f"sampler checkpoint has shuffle={state['shuffle']}, config has "
                             f"shuffle={self.shuffle}")
        position = int(state["position"])
        if not 0 <= position <= self.n:
            raise ValueError(f"sampler position {position} is outside [0, {self.n}]")
        self.epoch, self.position, self.seed = int(state["epoch"]), position, int(state["seed"])
        self._order_epoch = -1
