"""Benchmarks label their rows from what a run really ran (its config.yaml), and refuse a run
that ran something else: bench/step.py's "our engine" rows once ran vLLM, the recipe's
default engine, for weeks (planted: the override dropped -> the check raises)."""

from __future__ import annotations

import pytest

from bench.results import check_ran, resolved_run


def _run_dir(tmp_path, engine: str):
    from megarl.config import to_yaml
    from megarl.config.loader import resolve_config

    cfg = resolve_config("grpo", [f"actor_rollout_ref.rollout.name={engine}",
                                  "actor_rollout_ref.model.dtype=fp32"]).config
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    return tmp_path


def test_resolved_run_reads_the_run_config(tmp_path):
    ran = resolved_run(_run_dir(tmp_path, "torch"))
    assert ran == {"engine": "torch", "backend": "torch", "dtype": "fp32", "device": "auto"}


def test_a_run_of_another_engine_is_refused_naming_the_key(tmp_path):
    run = _run_dir(tmp_path, "vllm")  # what the recipe's default gives without an override
    with pytest.raises(RuntimeError, match=r"engine meant 'torch' but the run's config says "
                                           r"'vllm' \(actor_rollout_ref.rollout.name\)"):
        check_ran(run, engine="torch", backend="torch")
    assert check_ran(run, engine="vllm")["engine"] == "vllm"
