"""The sbatch templates on a REAL SLURM: slurmctld + two slurmd ("nodes" n1, n2) started on this
machine by tests/launch/slurm_cluster.py (apt-get installs slurm + munge when missing and we are
root). Jobs go through the unmodified templates; the sbatch command line only adds a log path
and a CPU count that fits this machine.

- one-node template: srun + torchrun --standalone, 2 ranks of the hello-world all_reduce job;
- multi-node template: one srun step per node, c10d rendezvous, 1 rank per node, so the job's
  metrics name both nodes;
- requeue: USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit) makes
  the trap requeue the job; the second run resumes after the last checkpointed step;
- the real trainer (launch/train.py, config grpo, 2 steps) once that file exists.

Skips only when SLURM cannot be installed/started here (not root, no apt); as root a daemon
that does not start is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import LocalSlurm, SlurmUnavailable, ensure_installed, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ONE_NODE = REPO / "launch/slurm/train_1node.sbatch"
MULTI_NODE = REPO / "launch/slurm/train_multinode.sbatch"
HELLO = "tests/launch/hello_dist.py"
HELLO_CONFIG = str(REPO / "tests/launch/hello.yaml")
TRAIN = REPO / "launch/train.py"

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        apt_s = ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(f"SLURM unavailable: {e}")
    if apt_s:
        print(f"\napt-get install of SLURM/munge took {apt_s:.1f}s")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    t0 = time.monotonic()
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        if os.geteuid() == 0:
            pytest.fail(f"SLURM daemons did not start as root: {e}")
        pytest.skip(f"SLURM daemons cannot start as a non-root user here: {e}")
    print(f"SLURM up in {time.monotonic() - t0:.1f}s")
    yield cluster
    cluster.stop()


def _job_env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {"RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    if sys.prefix != sys.base_prefix:
        env["VENV"] = sys.prefix  # the venv running the tests (the template's default is .venv)
    env.update(extra)
    return env


def _submit(slurm: LocalSlurm, template: Path, tmp_path: Path, env: dict[str, str],
            cpus: int = 1, args: tuple[str, ...] = ()) -> tuple[str, Path]:
    out = tmp_path / "slurm-%j.out"
    job = slurm.sbatch(template, [f"--output={out}", f"--cpus-per-task={cpus}"], env, cwd=REPO,
                       args=list(args))
    return job, Path(str(out).replace("%j", job))


def _finish(slurm: LocalSlurm, job: str, out: Path, timeout: float) -> dict[str, str]:
    info = slurm.wait(job, timeout)
    log = out.read_text() if out.exists() else "(no job log)"
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{log}"
    return info


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def test_one_node_template_runs_hello(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = _job_env(run_dir, CONFIG=HELLO_CONFIG, SCRIPT=HELLO, NPROC_PER_NODE="2",
                   OVERRIDES="trainer.total_training_steps=2")
    t0 = time.monotonic()
    job, out = _submit(slurm, ONE_NODE, tmp_path, env, cpus=2)
    _finish(slurm, job, out, timeout=180)
    print(f"one-node hello job: {time.monotonic() - t0:.1f}s")
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 2 ranks all-reduce rank + 1: 1 + 2
        assert r["hello/world_size"] == 2 and r["hello/sum_ranks"] == 3.0
        assert r["hello/nodes"] == ["n1"] and r["hello/restart"] == 0
    node_log = (run_dir / "logs/node0.log").read_text()
    assert node_log.count("hello step=2 sum_ranks=3 world_size=2") == 2  # printed by both ranks
    assert (run_dir / "slurm.out").resolve() == out.resolve()


def test_multinode_template_runs_hello_on_two_nodes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    # The test nodes are named n1/n2 but all live on 127.0.0.1: name the rendezvous address.
    env = _job_env(run_dir, CONFIG=HELLO_CONFIG, SCRIPT=HELLO, NPROC_PER_NODE="1",
                   RDZV_HOST="127.0.0.1", RDZV_PORT=str(free_port()))
    t0 = time.monotonic()
    job, out = _submit(slurm, MULTI_NODE, tmp_path, env, args=("trainer.total_training_steps=3",))
    info = _finish(slurm, job, out, timeout=180)
    print(f"two-node hello job: {time.monotonic() - t0:.1f}s")
    assert info["NodeList"] == "n[1-2]"
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["hello/world_size"] == 2 and r["hello/sum_ranks"] == 3.0
        assert r["hello/nodes"] == ["n1", "n2"]  # one rank ran on each SLURM node
    lines = [[ln for ln in (run_dir / f"logs/node{i}.log").read_text().splitlines()
              if ln.startswith("hello step=")] for i in (0, 1)]
    assert lines[0] == lines[1] == [f"hello step={s} sum_ranks=3 world_size=2" for s in (1, 2, 3)]


def test_usr1_requeues_and_the_job_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = _job_env(run_dir, CONFIG=HELLO_CONFIG, SCRIPT=HELLO, NPROC_PER_NODE="1",
                   OVERRIDES="trainer.total_training_steps=6", HELLO_STEP_SECONDS="1")
    job, out = _submit(slurm, ONE_NODE, tmp_path, env)
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(_metrics(run_dir)) >= 2):
        assert time.monotonic() < deadline, f"no progress: {slurm.show(job)}"
        assert slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.show(job)
        time.sleep(0.3)
    # What --signal=B:USR1@120 delivers before the time limit, sent now.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm.env(), check=True, timeout=15)
    info = _finish(slurm, job, out, timeout=180)
    assert info["Restarts"] == "1", info
    log = out.read_text()
    assert "USR1: requeueing job" in log and "restart 1" in log, log
    rows = _metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 7)), steps  # resumed after the checkpoint: no gap, no repeat
    first = [r["step"] for r in rows if r["hello/restart"] == 0]
    assert first and max(first) < 6 and all(r["hello/restart"] == 1 for r in rows[len(first):])


@pytest.mark.slow
@pytest.mark.skipif(not TRAIN.exists(), reason="launch/train.py not present yet")
def test_one_node_template_runs_the_demo_trainer(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = _job_env(run_dir, CONFIG="grpo", NPROC_PER_NODE="1",
                   OVERRIDES="trainer.total_training_steps=2")
    job, out = _submit(slurm, ONE_NODE, tmp_path, env, cpus=2)
    _finish(slurm, job, out, timeout=1100)
    rows = _metrics(run_dir)  # training rows carry actor/* metrics; validation-only rows do not
    assert [r["step"] for r in rows if any(k.startswith("actor/") for k in r)] == [1, 2], rows
