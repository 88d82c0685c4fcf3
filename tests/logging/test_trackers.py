"""wandb, mlflow and swanlab as trainer.logger sinks, offline, read back with each package's own
reader: the offline wandb run file (wandb's protobuf records), MLflow's client on its file store
and SwanLab's record store (its LevelDB-format reader and protobuf records).

Planted while writing: logging at step + 1 fails both history checks; dropping the "@" rule
fails test_mlflow_metrics_params_and_names (MLflow refuses "mean@4"); logging the metrics of
step 2 twice shows as a wrong value at step 3.
"""

from __future__ import annotations

import builtins

import pytest
from wandb_records import read_offline_run

from megarl.logging import MetricLogger
from megarl.logging.trackers import mlflow_metric_name

CONFIG = {"trainer": {"project_name": "proj", "experiment_name": "exp"},
          "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}}}}
ROWS = {1: {"actor/loss": 0.5, "val-core/arith/reward/mean@4": 0.25, "timing_s/gen": 1.0},
        2: {"actor/loss": 0.25, "val-core/arith/reward/mean@4": 0.5, "timing_s/gen": 2.0},
        3: {"actor/loss": -0.125, "perf/total_num_tokens": 64}}


def _log(run_dir, sinks):
    logger = MetricLogger(run_dir, sinks, total_steps=3, project="proj", experiment="exp",
                          config=CONFIG)
    for step, row in ROWS.items():
        logger.log(step, row)
    logger.close(plot=False)


def test_wandb_offline_run_holds_config_and_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _log(tmp_path / "run", ["jsonl", "wandb"])
    run = read_offline_run(tmp_path)
    assert (run["project"], run["name"]) == ("proj", "exp")
    assert run["config"]["actor_rollout_ref"] == CONFIG["actor_rollout_ref"]
    assert run["history"] == ROWS


def test_mlflow_metrics_params_and_names(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    _log(tmp_path / "run", ["jsonl", "mlflow"])
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["mlflow.runName"] == "exp"
    assert run.data.params["actor_rollout_ref/actor/optim/lr"] == "1e-06"
    assert run.data.params["actor_rollout_ref/actor/optim/betas/1"] == "0.999"
    names = {k for row in ROWS.values() for k in row}
    for name in names:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id,
                                                                  mlflow_metric_name(name))}
        want = {s: float(r[name]) for s, r in ROWS.items() if name in r}
        assert got == want, name
    assert mlflow_metric_name("val-core/arith/reward/mean@4") == "val-core/arith/reward/mean_at_4"
    assert mlflow_metric_name("a//b (x)!") == "a/b _x__"


def read_swanlab_run(log_dir) -> dict:
    """The offline SwanLab run under ``log_dir``: project, name, config (its config.yaml) and
    {step: {key: value}} of its scalar records, read with swanlab's own reader."""
    import yaml
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (run_dir,) = log_dir.glob("run-*")
    (records,) = run_dir.glob("run-*.swanlab")
    reader = DataStoreReader()
    reader.open(str(records))
    out: dict = {"history": {}}
    try:
        while (data := reader.scan()) is not None:
            rec = record_pb2.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "start":
                out["project"], out["name"] = rec.start.project, rec.start.name
            elif kind == "scalar":
                out["history"].setdefault(rec.scalar.step, {})[rec.scalar.key] = (
                    rec.scalar.value.number)
    finally:
        reader.close()
    config = yaml.safe_load((run_dir / "files" / "config.yaml").read_text())
    out["config"] = {k: v["value"] for k, v in config.items()}
    return out


def test_swanlab_offline_run_holds_config_and_every_step(tmp_path, monkeypatch):
    """verl's trainer.logger=[console,swanlab] (before: an unknown sink). SWANLAB_MODE=offline
    (SwanLab's own variable) writes the run under <run>/swanlog, read back record by record."""
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    _log(tmp_path / "run", ["jsonl", "swanlab"])
    run = read_swanlab_run(tmp_path / "run" / "swanlog")
    assert (run["project"], run["name"]) == ("proj", "exp")
    assert run["config"]["actor_rollout_ref"] == CONFIG["actor_rollout_ref"]
    assert run["history"] == {s: {k: float(v) for k, v in r.items()} for s, r in ROWS.items()}


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"megarl\[loggers\].*drop wandb from trainer.logger"):
        MetricLogger(tmp_path, ["wandb"], total_steps=1)
