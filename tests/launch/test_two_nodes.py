"""Two torchrun "nodes" on this machine, started by the launcher (``--nnodes=2``, c10d
rendezvous on 127.0.0.1, gloo): the hello-world all_reduce job now, the real trainer once
launch/train.py exists. Also ssh mode through a stand-in ``ssh`` (checks the remote command's
quoting end to end) and that one failing node stops the other.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from free_ports import free_port

REPO = Path(__file__).resolve().parents[2]
HELLO = "tests/launch/hello_dist.py"
HELLO_CONFIG = "tests/launch/hello.yaml"
TRAIN = REPO / "launch/train.py"

pytestmark = pytest.mark.dist


def _launch(args: list[str], timeout: float, path_prefix: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
    env.update(OMP_NUM_THREADS="1", LOGLEVEL="INFO")  # LOGLEVEL: torchrun prints its rendezvous
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run([sys.executable, "launch/multinode.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def _group_ranks(log: str) -> tuple[int, int]:
    """(group_rank, group_world_size) from torchrun's 'Rendezvous complete' report."""
    values = {}
    for line in log.splitlines():
        for key in ("group_rank=", "group_world_size="):
            if line.rstrip().split("]")[-1].strip().startswith(key):
                values[key] = int(line.rsplit("=", 1)[1])
    return values["group_rank="], values["group_world_size="]


def _hello_lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.startswith("hello step=")]


def _check_two_node_hello(run_dir: Path, steps: int) -> None:
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["hello/world_size"] == 2 and r["hello/sum_ranks"] == 3.0 for r in rows)
    logs = [(run_dir / f"logs/node{i}.log").read_text() for i in (0, 1)]
    # Two agents met in one rendezvous: distinct group ranks, a group of 2.
    assert sorted(_group_ranks(log) for log in logs) == [(0, 2), (1, 2)]
    expected = [f"hello step={s} sum_ranks=3 world_size=2" for s in range(1, steps + 1)]
    assert _hello_lines(run_dir / "logs/node0.log") == _hello_lines(run_dir / "logs/node1.log") == expected


def test_two_local_nodes_run_hello(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = _launch(["--mode", "local", "--hosts", "127.0.0.1,127.0.0.1", "--nproc-per-node", "1",
                 "--backend", "gloo", "--rdzv-port", str(free_port()), "--config", HELLO_CONFIG,
                 "--script", HELLO, "--run-dir", str(run_dir), "trainer.total_training_steps=2"],
                timeout=240)
    print(f"two local nodes: {time.monotonic() - t0:.1f}s")
    assert r.returncode == 0, r.stderr
    _check_two_node_hello(run_dir, 2)
    assert "all 2 node(s) finished" in r.stderr


def test_ssh_mode_runs_the_quoted_remote_command(tmp_path):
    """A stand-in ssh runs the remote command with bash -c on this machine, as sshd would with
    the user's shell: a run dir and an override with spaces must arrive intact."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text('#!/bin/bash\n# stand-in for ssh: skip options and host, run the command\n'
                    'while [ "$#" -gt 1 ]; do case "$1" in -o) shift 2;; -*) shift;; '
                    '*) echo "fake-ssh $1" >&2; shift; break;; esac; done\nexec bash -c "$*"\n')
    fake.chmod(0o755)
    run_dir = tmp_path / "run dir"
    r = _launch(["--mode", "ssh", "--hosts", "localhost,127.0.0.1", "--rdzv-host", "127.0.0.1",
                 "--rdzv-port", str(free_port()), "--backend", "gloo", "--config", HELLO_CONFIG,
                 "--script", HELLO, "--run-dir", str(run_dir), "trainer.total_training_steps=2",
                 "trainer.experiment_name=it's a test"], timeout=240, path_prefix=str(bin_dir))
    assert r.returncode == 0, r.stderr
    _check_two_node_hello(run_dir, 2)
    node0 = (run_dir / "logs/node0.log").read_text()
    assert "fake-ssh localhost" in node0
    line = next(ln for ln in node0.splitlines() if ln.startswith("hello cwd="))
    cwd, _, overrides = line[len("hello cwd="):].partition(" overrides=")
    assert cwd == str(REPO)
    assert "trainer.experiment_name=it's a test" in json.loads(overrides)
    assert f"trainer.default_local_dir={run_dir}" in json.loads(overrides)


def test_a_failing_node_stops_the_other(tmp_path):
    """node0 cannot host the rendezvous (its port is taken; preflight off), so it exits at once;
    node1 would wait for it for 15 minutes. The launcher must stop node1 and fail fast."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        t0 = time.monotonic()
        r = _launch(["--mode", "local", "--nnodes", "2", "--rdzv-port", str(port), "--no-preflight",
                     "--config", HELLO_CONFIG, "--script", HELLO, "--run-dir", str(tmp_path / "run")],
                    timeout=180)
        took = time.monotonic() - t0
    assert r.returncode != 0
    assert "node0 (127.0.0.1) exited with" in r.stderr and "stopping the other nodes" in r.stderr
    assert took < 120, took


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def test_killing_the_launcher_stops_every_node(tmp_path):
    """Even SIGKILL (no chance to clean up): the nodes get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and torchrun stops its ranks."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
    env.update(OMP_NUM_THREADS="1", HELLO_STEP_SECONDS="60")
    launcher = subprocess.Popen(
        [sys.executable, "launch/multinode.py", "--mode", "local", "--nnodes", "2", "--rdzv-port",
         str(free_port()), "--config", HELLO_CONFIG, "--script", HELLO, "--run-dir", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        logs = [run_dir / f"logs/node{i}.log" for i in (0, 1)]
        while not all(p.exists() and "hello step=1" in p.read_text() for p in logs):
            assert time.monotonic() < deadline and launcher.poll() is None, "nodes did not start"
            time.sleep(0.3)
        assert len(_processes_mentioning(str(run_dir))) >= 4  # 2 torchrun agents + 2 ranks
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 60
        while _processes_mentioning(str(run_dir)):
            assert time.monotonic() < deadline, _processes_mentioning(str(run_dir))
            time.sleep(0.3)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _processes_mentioning(str(run_dir)):  # on failure: what this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_preflight_refuses_a_taken_rendezvous_port(tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        r = _launch(["--mode", "local", "--nnodes", "2", "--rdzv-port", str(port), "--config",
                     HELLO_CONFIG, "--script", HELLO, "--run-dir", str(tmp_path / "run")], timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"megarl-launch: error: rendezvous port {port} on 127.0.0.1 is already in use "
        f"(another run?); pick a free one with --rdzv-port")
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.slow
@pytest.mark.skipif(not TRAIN.exists(), reason="launch/train.py not present yet")
def test_two_local_nodes_run_the_demo_trainer(tmp_path):
    run_dir = tmp_path / "run"
    r = _launch(["--mode", "local", "--hosts", "127.0.0.1,127.0.0.1", "--nproc-per-node", "1",
                 "--backend", "gloo", "--rdzv-port", str(free_port()), "--config", "grpo",
                 "--run-dir", str(run_dir), "trainer.total_training_steps=2"], timeout=1100)
    assert r.returncode == 0, r.stderr + "\n".join(
        (run_dir / f"logs/node{i}.log").read_text()[-3000:] for i in (0, 1))
    rows = _metrics(run_dir)  # training rows carry actor/* metrics; validation-only rows do not
    assert [row["step"] for row in rows if any(k.startswith("actor/") for k in row)] == [1, 2], rows
    logs = [(run_dir / f"logs/node{i}.log").read_text() for i in (0, 1)]
    assert sorted(_group_ranks(log) for log in logs) == [(0, 2), (1, 2)]
