"""The interface every metric sink implements, and what a sink may know of the run.

A sink receives each step's metrics row once (``log``) and is closed once at the end of the run
(``close``). `megarl.logging.logger.MetricLogger` builds the sinks ``trainer.logger`` names (and
the run's record, always) and loops over them; a new sink is a class with these two methods and
an entry in ``megarl.logging.logger.SINK_TYPES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of ``step`` ({verl name: number}; validation rows are step 0)."""

    def close(self) -> str | None:
        """Flush and release; the path of a file written on closing (the curves), else None."""


@dataclass(frozen=True)
class RunInfo:
    """What a sink may be built from."""

    run_dir: Path  # the run's folder (trainer.default_local_dir)
    total_steps: int
    resume_step: int | None = None  # the step the run resumed from, None for a fresh run
    title: str = ""  # "project/experiment", shown on plots
    project: str = "megarl"  # trainer.project_name
    experiment: str = "run"  # trainer.experiment_name
    config: dict = field(default_factory=dict)  # the resolved config, for the trackers
