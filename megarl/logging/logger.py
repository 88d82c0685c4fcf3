"""`MetricLogger`: one ``log(step, metrics)`` call looped over the run's sinks.

The sinks (`megarl.logging.sink.Sink`: ``log`` and ``close``) are those ``trainer.logger``
names, plus the run's record, always: ``jsonl`` (run_dir/metrics.jsonl) and ``curves``
(run_dir/curves.png at the end). Each is built where its `SinkType` says: the console on the
first rank of every node (``local_rank == 0``; every rank holds the same metrics, so each node's
log carries them), every other sink on global rank 0 only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from megarl.logging.console import ConsoleProgress
from megarl.logging.jsonl import JsonlWriter
from megarl.logging.plots import CurvesSink
from megarl.logging.sink import RunInfo, Sink
from megarl.logging.tensorboard import TensorBoardSink
from megarl.logging.trackers import MlflowTracker, SwanlabTracker, WandbTracker


@dataclass(frozen=True)
class SinkType:
    build: Callable[[RunInfo], Sink]
    every_node: bool = False  # built on each node's first rank, else on global rank 0 only
    always: bool = False  # the run's record: built whatever trainer.logger names


SINK_TYPES: dict[str, SinkType] = {
    "console": SinkType(lambda run: ConsoleProgress(run.total_steps, run.resume_step or 0),
                        every_node=True),
    "jsonl": SinkType(lambda run: JsonlWriter(run.run_dir / "metrics.jsonl",
                                              resume_step=run.resume_step), always=True),
    "tensorboard": SinkType(lambda run: TensorBoardSink(run.run_dir / "tensorboard",
                                                        run.resume_step)),
    "wandb": SinkType(lambda run: WandbTracker(run.project, run.experiment, run.config,
                                               run.run_dir)),
    "mlflow": SinkType(lambda run: MlflowTracker(run.project, run.experiment, run.config,
                                                 run.run_dir)),
    "swanlab": SinkType(lambda run: SwanlabTracker(run.project, run.experiment, run.config,
                                                   run.run_dir)),
    "curves": SinkType(lambda run: CurvesSink(run.run_dir / "metrics.jsonl",
                                              run.run_dir / "curves.png", run.title),
                       always=True),
}
# the names trainer.logger accepts (curves are always drawn)
SINKS = ("console", "tensorboard", "jsonl", "wandb", "mlflow", "swanlab")


def build_sinks(names: list[str], run: RunInfo, rank: int = 0,
                local_rank: int = 0) -> list[Sink]:
    """The sinks of ``names`` (trainer.logger) and the record's that this rank writes, in
    `SINK_TYPES` order."""
    unknown = [s for s in names if s not in SINKS]
    if unknown:
        raise ValueError(f"trainer.logger: unknown sink(s) {unknown}; choose from {list(SINKS)}")
    here = [name for name, t in SINK_TYPES.items()
            if (name in names or t.always) and (local_rank if t.every_node else rank) == 0]
    if rank == 0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
    return [SINK_TYPES[name].build(run) for name in here]


class MetricLogger:
    """``log(step, metrics)`` writes to every sink of this rank (module docstring).

    Files (global rank 0): run_dir/metrics.jsonl, run_dir/tensorboard/ (TensorBoard event
    files), the trackers' runs, and at ``close()`` run_dir/curves.png.
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
        run = RunInfo(Path(run_dir), total_steps, resume_step, title, project, experiment,
                      config or {})
        self.rank = rank
        self.sinks = build_sinks(list(sinks), run, rank, local_rank)
        self.console = _first(self.sinks, ConsoleProgress)
        self.record = _first(self.sinks, JsonlWriter)
        self.curves = _first(self.sinks, CurvesSink)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def has_step(self, step: int) -> bool:
        """Whether the run's record already holds a row for ``step`` (always true off rank 0)."""
        return self.record is None or step in self.record.steps

    def print(self, text: str) -> None:
        """A line of the run's log: through the console sink where there is one (above its
        progress bar), else printed on rank 0."""
        if self.console is not None:
            self.console.write(text)
        elif self.rank == 0:
            print(text, flush=True)

    def close(self, plot: bool = True) -> str | None:
        """Close every sink (``plot=False``: without drawing the curves); the curves' path, or
        None."""
        written = None
        for sink in self.sinks:
            if sink is self.curves and not plot:
                continue
            written = sink.close() or written
        return written


def _first(sinks: list[Sink], kind: type):
    return next((s for s in sinks if isinstance(s, kind)), None)
