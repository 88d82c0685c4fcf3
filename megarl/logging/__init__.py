"""Metric sinks: console progress, JSONL file, TensorBoard scalars, wandb, MLflow, end-of-run
curves, each a `Sink` (``log(step, metrics)``, ``close()``).

`MetricLogger` loops one `log(step, metrics)` call over the sinks named in ``trainer.logger``
plus the run's record (metrics.jsonl, curves.png); only rank 0 writes files.
"""

from megarl.logging.console import ConsoleProgress
from megarl.logging.jsonl import JsonlWriter, read_jsonl
from megarl.logging.logger import SINK_TYPES, SINKS, MetricLogger, SinkType, build_sinks
from megarl.logging.plots import CurvesSink, plot_curves
from megarl.logging.sink import RunInfo, Sink
from megarl.logging.tensorboard import TensorBoardSink

__all__ = ["SINKS", "SINK_TYPES", "ConsoleProgress", "CurvesSink", "JsonlWriter", "MetricLogger",
           "RunInfo", "Sink", "SinkType", "TensorBoardSink", "build_sinks", "plot_curves",
           "read_jsonl"]
