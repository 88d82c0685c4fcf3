"""Fan-out of step metrics to the configured sinks (rank 0 only)."""

from __future__ import annotations

import os
from pathlib import Path

from megarl.logging.console import ConsoleProgress
from megarl.logging.jsonl import JsonlWriter, read_jsonl
from megarl.logging.plots import plot_curves
from megarl.logging.trackers import TRACKERS, make_tracker

SINKS = ("console", "tensorboard", "jsonl", *TRACKERS)


class MetricLogger:
    """``log(step, metrics)`` writes to every sink of ``sinks``.

    Files (written by global rank 0 only): run_dir/metrics.jsonl, run_dir/tensorboard/
    (TensorBoard event files, verl's metric names), and at ``close()`` run_dir/curves.png.
    The console shows on the first rank of every node (``local_rank == 0``), so each node's log
    carries the step metrics (every rank holds the same metrics).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        sinks: list[str],
        total_steps: int,
        *,
        rank: int = 0,
        local_rank: int = 0,
        resume_step: int | None = None,
        title: str = "",
        project: str = "megarl",
        experiment: str = "run",
        config: dict | None = None,
    ) -> None:
        unknown = [s for s in sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown sink(s) {unknown}; choose from {list(SINKS)}")
        self.active = rank == 0
        self.run_dir = Path(run_dir)
        self.title = title
        self.jsonl = self.tb = None
        self.trackers: list = []
        self.console = ConsoleProgress(total_steps, resume_step or 0,
                                       enabled=local_rank == 0 and "console" in sinks)
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # jsonl is always written: it is the run's record (plots, tests and resume checks read it)
        self.jsonl = JsonlWriter(self.run_dir / "metrics.jsonl", resume_step=resume_step)
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                    purge_step=(resume_step + 1) if resume_step else None)
        self.trackers = [make_tracker(name, project, experiment, config or {}, self.run_dir)
                         for name in sinks if name in TRACKERS]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.console.update(step, metrics)
        if not self.active:
            return
        self.jsonl.write(step, metrics)
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, global_step=step)
            self.tb.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def has_step(self, step: int) -> bool:
        """Whether the run's record already holds a row for ``step`` (always true off rank 0)."""
        return self.jsonl is None or step in self.jsonl.steps

    def print(self, text: str) -> None:
        if self.console.enabled:
            self.console.write(text)
        elif self.active:
            print(text, flush=True)

    def close(self, plot: bool = True) -> str | None:
        self.console.close()
        if not self.active:
            return None
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.jsonl.close()
        if plot:
            rows = read_jsonl(self.run_dir / "metrics.jsonl")
            if rows:
                return plot_curves(rows, self.run_dir / "curves.png", title=self.title)
        return None
