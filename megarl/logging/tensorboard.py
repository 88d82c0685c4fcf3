"""TensorBoard scalars: one event file series in run_dir/tensorboard/, verl's metric names."""

from __future__ import annotations

import os
from collections.abc import Mapping


class TensorBoardSink:
    """Every numeric metric as a scalar at its step, flushed after each step. A resumed run
    purges the events after ``resume_step`` (a run that died after logging but before its
    checkpoint logs those steps again)."""

    def __init__(self, log_dir: str | os.PathLike, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir),
                                    purge_step=(resume_step + 1) if resume_step else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
