"""One writer per run directory (`megarl.trainer.run_lock`): the lock names its holder, a live
holder refuses a second run, a gone one (dead pid, reused pid, another host's expired lease,
a half-written file) is taken over, the lease is renewed, and two runs starting at once get one
lock between them. End to end: a second `launch/train.py` on a live run's directory exits 2
within its start-up naming the holder; after a kill -9 the directory is taken over (the bitwise
resume through that takeover: tests/trainer/test_resume.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from megarl.errors import UserInputError
from megarl.trainer.run_lock import LOCK_NAME, Holder, RunDirLock

REPO = Path(__file__).resolve().parents[2]


def _plant(run_dir: Path, **fields) -> Path:
    """A lock file held by ``fields`` over this process's own holder data."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({**asdict(Holder.me()), **fields}))
    return path


@pytest.fixture
def other_process():
    """A live process on this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path):
    lock = RunDirLock(tmp_path / "run").acquire()
    held = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert held["pid"] == os.getpid() and held["host"] == Holder.me().host
    assert abs(held["pid_started"] - psutil.Process().create_time()) < 1e-6
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_live_holder_refuses_naming_it(tmp_path, other_process):
    _plant(tmp_path, pid=other_process.pid, pid_started=other_process.create_time())
    with pytest.raises(UserInputError) as err:
        RunDirLock(tmp_path).acquire()
    msg = str(err.value)
    for part in (f"pid {other_process.pid}", f"host {Holder.me().host}",
                 f"trainer.default_local_dir={tmp_path}", "Stop that run"):
        assert part in msg, (part, msg)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == other_process.pid


@pytest.mark.parametrize("case", ["dead_pid", "reused_pid", "half_written"])
def test_a_gone_holder_is_taken_over_with_a_warning(tmp_path, other_process, caplog, case):
    if case == "dead_pid":
        proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True)
        _plant(tmp_path, pid=int(proc.stdout), pid_started=time.time() - 5)
    elif case == "reused_pid":  # the pid is alive, but it is another process than the holder
        _plant(tmp_path, pid=other_process.pid, pid_started=other_process.create_time() - 100)
    else:
        (tmp_path / LOCK_NAME).write_text('{"host": "a", "pi')
    with caplog.at_level(logging.WARNING, logger="megarl.trainer.run_lock"):
        lock = RunDirLock(tmp_path).acquire()
    assert "taking the run directory's lock over" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_another_hosts_lease_holds_until_it_expires(tmp_path):
    _plant(tmp_path, host="elsewhere-node", pid=1, renewed=time.time() - 10)
    with pytest.raises(UserInputError, match="pid 1 on host elsewhere-node"):
        RunDirLock(tmp_path, lease_s=60).acquire()
    _plant(tmp_path, host="elsewhere-node", pid=1, renewed=time.time() - 61)
    lock = RunDirLock(tmp_path, lease_s=60).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == Holder.me().host
    lock.release()


def test_the_holder_renews_its_lease(tmp_path):
    lock = RunDirLock(tmp_path, lease_s=0.4).acquire()
    first = json.loads((tmp_path / LOCK_NAME).read_text())["renewed"]
    time.sleep(0.5)
    later = json.loads((tmp_path / LOCK_NAME).read_text())["renewed"]
    lock.release()
    assert later > first + 0.05


RACER = """
import sys, time
from megarl.errors import UserInputError
from megarl.trainer.run_lock import RunDirLock
while time.time() < float(sys.argv[2]):
    time.sleep(0.001)
try:
    RunDirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(3)
except UserInputError:
    print("refused", flush=True)
"""


@pytest.mark.e2e  # starts competing processes
def test_two_runs_starting_at_once_get_one_lock(tmp_path):
    """Planted (the lock created empty, then written): a racer that reads it in between takes
    it for a dead writer's and holds it too (6 racers: two held it in 3 of 4 tries)."""
    start = time.time() + 3
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(start)],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(6)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["held"] + ["refused"] * 5, outs


FAST = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "data.max_response_length=48", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false"]


def _train(run: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, "launch/train.py", "--config", "grpo",
                             f"trainer.default_local_dir={run}", *FAST, *extra], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.e2e
def test_a_second_run_on_a_live_runs_directory_is_refused(tmp_path, demo_assets):
    run = tmp_path / "run"
    first = _train(run, "trainer.total_training_steps=500", "trainer.save_freq=1")
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step logged in 300 s"
            time.sleep(0.1)
        second = _train(run, "trainer.total_training_steps=2")
        out, err = second.communicate(timeout=300)
        assert second.returncode == 2, (second.returncode, err[-3000:])
        assert f"pid {first.pid} on host" in err and "Traceback" not in err, err[-3000:]
        first.kill()
        first.wait(timeout=30)
        # kill -9 leaves the lock behind: the next run takes it over and resumes
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == first.pid
        third = _train(run, "trainer.total_training_steps=3", "trainer.resume=auto")
        out, err = third.communicate(timeout=300)
        assert third.returncode == 0, err[-3000:]
        assert "taking the run directory's lock over" in out + err
        assert "resumed from step" in out + err
        assert not (run / LOCK_NAME).exists()
    finally:
        if first.poll() is None:
            first.kill()
