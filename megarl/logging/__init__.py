"""Metric sinks: JSONL file, TensorBoard scalars, a console progress line, end-of-run plots.

`MetricLogger` fans one `log(step, metrics)` call out to the sinks named in
``trainer.logger``; only rank 0 writes.
"""

from megarl.logging.console import ConsoleProgress
from megarl.logging.jsonl import JsonlWriter, read_jsonl
from megarl.logging.logger import MetricLogger
from megarl.logging.plots import plot_curves

__all__ = ["ConsoleProgress", "JsonlWriter", "MetricLogger", "plot_curves", "read_jsonl"]
