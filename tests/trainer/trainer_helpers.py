"""Run launch/train.py in a subprocess (1 process or torchrun) and read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from warm_runs import run_script  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Small, fast settings on top of any recipe: 4 prompts x 4 responses, no validation.
FAST = [
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=48",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "trainer.export_hf=false",
]

TIMING_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/time_s")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
             PYTHONPATH=str(REPO))
    e.pop("TRITON_INTERPRET", None)
    return e


def train(run_dir: Path, config: str, *overrides: str, nproc: int = 1, timeout: float = 600,
          check: bool = True, fast: bool = True,
          python_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python_args`` (one process only) go before ``launch/train.py`` on the interpreter's
    command line: e.g. ``("-c", code, arg)`` runs ``code`` with sys.argv = ["-c", arg,
    "launch/train.py", ...] (a wrapper that patches the trainer, then runs the script)."""
    args = [f"trainer.default_local_dir={run_dir}", *(FAST if fast else []), *overrides]
    if python_args and nproc != 1:
        raise ValueError("python_args needs nproc=1")
    script = ["launch/train.py", "--config", config, *args]
    if python_args:
        cmd = [sys.executable, *python_args, *script]
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=timeout)
    else:  # forked from a warm interpreter, each rank of a world too (tests/warm_runs.py)
        cmd = [sys.executable, *script] if nproc == 1 else [
            "torchrun", "--standalone", f"--nproc_per_node={nproc}", *script]  # what it stands for
        proc = run_script(script, REPO, env(), timeout, nproc if nproc > 1 else None)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> list[dict]:
    """Metric rows of training steps (the step-0 validation row excluded)."""
    return [r for r in metrics(run_dir) if r["step"] > 0]


def strip_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
