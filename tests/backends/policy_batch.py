"""The small policy-gradient batch and loss the backend tests train with: B rows of a P-token
prompt and L response tokens (ids in [3, 128), one row left-padded by 2, one with its last
token masked), a random advantage per response token, and loss = -mean(logprob * adv) over the
unmasked response tokens."""

from __future__ import annotations

import torch

from megarl.backends.protocol import SequenceBatch


def make_batch(seed: int = 0, B: int = 4, P: int = 5, L: int = 4) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, P + L), generator=g)
    mask = torch.ones(B, P + L, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, -1] = 0
    return SequenceBatch(ids * mask, mask, L, {"adv": torch.randn(B, L, generator=g),
                                               "mask": mask[:, P:].float()})


def loss_fn(out, mb) -> tuple[torch.Tensor, dict]:
    m = mb.tensors["mask"]
    return -(out.logprob * mb.tensors["adv"] * m).sum() / max(float(m.sum()), 1.0), {}


def seed_megatron_dropout(seed: int) -> None:
    """torch's default generator and megatron's data-parallel RNG state (what megatron's LoRA
    dropout draws from) both at the state of ``torch.manual_seed(seed)``."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.set_states({**tracker.get_states(),
                        mrandom.get_data_parallel_rng_tracker_name(): torch.get_rng_state()})
