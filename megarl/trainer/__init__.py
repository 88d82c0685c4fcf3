"""The RL loop (SPMD): rollout -> reward -> ref/old logprob -> advantage -> update -> sync."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.config.schema import Config


def run(cfg: Config) -> dict[str, Any]:
    """Train with a validated Config in this process (one rank of a torchrun job, or alone)."""
    from megarl.trainer.parts import pin_threads
    from megarl.trainer.resume_config import refuse_early
    from megarl.trainer.trainer import RLTrainer
    from megarl.utils import dist as mdist

    refuse_early(cfg)  # a resume that would change the run's meaning, before any model is built
    pin_threads()
    device = mdist.resolve_device(cfg.trainer.device)
    mdist.init_distributed(device, cfg.launch.backend)
    try:
        trainer = RLTrainer(cfg)
        # What start-up built (modules, models, the prompt set) lives for the whole run: later
        # full collections (megatron's optimizer runs one at every checkpoint) skip it. Thawed
        # at the end, so the interpreter's exit frees it as usual.
        gc.freeze()
        try:
            return trainer.fit()
        finally:
            gc.unfreeze()
            trainer.parts.close()
    finally:
        mdist.destroy()
