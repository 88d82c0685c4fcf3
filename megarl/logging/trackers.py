"""Experiment trackers beside the run's own files: Weights & Biases, MLflow and SwanLab, as
verl's ``trainer.logger`` names them (``['console','wandb']``): sinks
(`megarl.logging.sink.Sink`), rank 0 only, verl's metric names.

- ``wandb``: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name,
  config=<the resolved config>)``; each step ``wandb.log(metrics, step=step)``. Offline runs:
  ``WANDB_MODE=offline`` (the run lands in ``$WANDB_DIR/wandb/offline-run-*``, ``wandb sync``
  uploads it later). A resumed megarl run starts a new wandb run from the resumed step.
- ``mlflow``: tracking URI from ``MLFLOW_TRACKING_URI`` (default: a file store in
  ``run_dir/mlruns``, which MLflow 3 keeps behind MLFLOW_ALLOW_FILE_STORE=true), experiment =
  project name, run name = experiment name; the config as flattened params (``a/b/c``),
  metrics per step. MLflow accepts only ``[/\\w.\\- :]`` in metric names: ``@`` becomes
  ``_at_`` (``val-core/x/reward/mean@4`` -> ``mean_at_4``), runs of ``/`` collapse, any other
  character becomes ``_`` (verl's spelling of the same rule).
- ``swanlab``: ``swanlab.init(project=trainer.project_name, experiment_name=
  trainer.experiment_name, config=<the resolved config>, logdir=$SWANLAB_LOG_DIR or
  run_dir/swanlog)``; each step the numeric metrics, ``run.log(metrics, step=step)``. The mode is
  SwanLab's own ``SWANLAB_MODE`` (cloud by default, after ``swanlab login`` or with
  ``SWANLAB_API_KEY``; ``offline`` writes the run under the log folder for ``swanlab sync``;
  ``local``, ``disabled``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_EXTRA = "pip install 'megarl[loggers]'"


def _import(package: str):
    try:
        return __import__(package)
    except ImportError:
        raise ImportError(f"trainer.logger: {package!r} needs the {package} package: {_EXTRA} "
                          f"(or drop {package} from trainer.logger)") from None


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")


def mlflow_metric_name(name: str) -> str:
    """A metric name as MLflow accepts it (module doc)."""
    return _MLFLOW_BAD.sub("_", _SLASHES.sub("/", name.replace("@", "_at_")))


def flat_params(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a/b/c": str(value)}; list items as "a/0", "a/1" (MLflow params)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: str(tree)}
    out: dict[str, str] = {}
    for key, value in items:
        out.update(flat_params(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


class WandbTracker:
    def __init__(self, project: str, experiment: str, config: dict, run_dir: Path) -> None:
        wandb = _import("wandb")
        self.run = wandb.init(project=project, name=experiment, config=config,
                              dir=os.environ.get("WANDB_DIR", str(run_dir)))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, project: str, experiment: str, config: dict, run_dir: Path) -> None:
        mlflow = _import("mlflow")
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a file store in the run folder (no server, no database package needed)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        exp = mlflow.set_experiment(project)
        self.run = mlflow.start_run(experiment_id=exp.experiment_id, run_name=experiment)
        params = flat_params(config)
        keys = sorted(params)
        for i in range(0, len(keys), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params({k: params[k][:6000] for k in keys[i:i + 100]})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        numbers = {mlflow_metric_name(k): float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        self.mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class SwanlabTracker:
    def __init__(self, project: str, experiment: str, config: dict, run_dir: Path) -> None:
        swanlab = _import("swanlab")
        self.run = swanlab.init(project=project, experiment_name=experiment, config=config,
                                logdir=os.environ.get("SWANLAB_LOG_DIR",
                                                      str(run_dir / "swanlog")))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({k: v for k, v in metrics.items()
                      if isinstance(v, int | float) and not isinstance(v, bool)}, step=step)

    def close(self) -> None:
        self.run.finish()
