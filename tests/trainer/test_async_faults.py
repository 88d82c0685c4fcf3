"""Faults of an asynchronous run (``async_training.staleness_threshold=1``, 2 ranks under
torchrun, an engine process per rank): a hard kill of every process, a stop signal, the engine
process killed, a rank killed.
Each time the whole run ends within a bound, nothing of it stays alive, ``checkpoints/`` holds
only complete checkpoints, and where the run is resumed it continues bit for bit (6 steps =
3 + the fault + 3, against one straight run shared by the tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from process_helpers import alive, wait_gone
from test_resume import (
    RESUMED,
    _train_killed_after_checkpoint,
    assert_resumed,
    assert_same_runs,
    logged_before,
    schedule,
)
from trainer_helpers import FAST, REPO, env, train

from megarl.trainer.checkpoint import COMPLETE, CheckpointManager

# 6 steps, checkpoints at 3 and 6: the faults land in steps 4-5, between them
COMMON = schedule(6, 3)

# one worker runs the module (make test: --dist loadgroup), so the straight run is made once
pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.xdist_group("async_faults")]

ASYNC1 = ["async_training.staleness_threshold=1"]
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, demo_assets) -> Path:
    """The uninterrupted 6-step run the resumed ones are compared with."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(run, "grpo", *COMMON, *ASYNC1, nproc=2)
    return run


def _start(run: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """torchrun with 2 ranks, output to ``<run>.log``; returns (agent, log)."""
    log = run.with_suffix(".log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/train.py", "--config", "grpo", f"trainer.default_local_dir={run}", *FAST,
           *ASYNC1, *extra]
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return agent, log


def _wait_for(what: str, ready, agent: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert agent.poll() is None, f"the run exited {agent.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.01)


def _checkpoint_done(run: Path, step: int):
    return lambda: (run / "checkpoints" / f"global_step_{step}" / COMPLETE).is_file()


def _ranks(agent: subprocess.Popen) -> dict[int, psutil.Process]:
    out = {}
    for p in psutil.Process(agent.pid).children():
        rank = p.environ().get("RANK")
        if rank is not None:
            out[int(rank)] = p
    assert sorted(out) == [0, 1], out
    return out


def _engine(rank: psutil.Process) -> psutil.Process:
    """The rank's engine process: its spawned multiprocessing child (not the resource tracker)."""
    found = [c for c in rank.children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(found) == 1, [c.cmdline() for c in rank.children()]
    return found[0]


def _run_pids(agent: subprocess.Popen) -> dict[int, str]:
    return {p.pid: " ".join(p.cmdline()) for p in psutil.Process(agent.pid).children(recursive=True)}


def _ended(agent: subprocess.Popen, pids: dict[int, str], what: str, timeout_s: float) -> int:
    """The agent's exit status once it and every process of the run are gone (``timeout_s``
    for the agent, 10 s more for the rest)."""
    try:
        rc = agent.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run still running {timeout_s:g} s after {what}") from None
    left = wait_gone(pids, 10.0)
    assert not left, f"alive 10 s after the run ended ({what}): {[pids[p] for p in left]}"
    return rc


def _only_complete(run: Path) -> list[int]:
    """Every ``global_step_N`` in checkpoints/ is complete; returns their steps."""
    root = run / "checkpoints"
    steps = [d for d in root.iterdir() if d.name.startswith("global_step_")]
    assert all((d / COMPLETE).is_file() for d in steps), sorted(os.listdir(root))
    return CheckpointManager(root).complete_steps()


def _assert_bitwise(straight: Path, resumed: Path) -> None:
    assert_same_runs(straight, resumed, 6)


def _resume(run: Path) -> None:
    before = logged_before(run, 3)
    proc = train(run, "grpo", *COMMON, *ASYNC1, *RESUMED, nproc=2)
    assert_resumed(proc, run, before, 3, 6)
    names = os.listdir(run / "checkpoints")
    assert not [n for n in names if n.startswith(".")], names  # leftovers of the fault removed


def _fault_kill_after_checkpoint_3(run: Path, kill) -> tuple[int, str, float]:
    """Start the 6-step run, ``kill(agent)`` once checkpoint 3 is complete (step 4 under way,
    step 5's batch generating); returns (exit status, output, seconds from the kill to the
    end of every process of the run)."""
    agent, log = _start(run, *COMMON)
    try:
        _wait_for("checkpoint 3", _checkpoint_done(run, 3), agent)
        pids = _run_pids(agent)
        t0 = time.monotonic()
        what = kill(agent)
        rc = _ended(agent, pids, what, 60)
        return rc, log.read_text(), time.monotonic() - t0
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def test_async_kill_and_resume_is_bitwise_identical(tmp_path, straight):
    """Staleness 1, 2 ranks (an engine process each): 6 steps straight equal 3 steps, a hard
    kill of every process (engines included) after the step-3 checkpoint, and a resume for
    the last 3 (metrics but timings, exported weights). The checkpoint holds the batch of
    step 4, generated with version 2 while step 3 trained; the resumed process ran steps 4-6
    only (`assert_resumed`). Planted: not saving the batches in flight (the resumed run
    regenerates step 4's batch on version 3): step 4's metrics differ
    (async/policy_version_lag 0 instead of 1, other samples). The trainer ignoring
    trainer.resume=auto (maybe_resume returning None): the restart from step 0 matches the
    straight run bit for bit and fails only on the resume evidence."""
    resumed = tmp_path / "resumed"
    _train_killed_after_checkpoint(resumed, 3, "grpo", ASYNC1, COMMON)
    ckpt = CheckpointManager(resumed / "checkpoints")
    assert ckpt.complete_steps() == [3]
    assert (ckpt.step_dir(3) / "async" / "rank1.pt").is_file()
    before = logged_before(resumed, 3)
    proc = train(resumed, "grpo", *COMMON, *ASYNC1, *RESUMED, nproc=2)

    a = assert_same_runs(straight, resumed, 6)
    assert [r["async/policy_version_lag/max"] for r in a] == [0, 1, 1, 1, 1, 1]
    assert_resumed(proc, resumed, before, 3, 6)


def test_sigterm_to_a_rank_ends_the_run_and_resume_is_bitwise(tmp_path, straight):
    """SIGTERM to rank 1 during step 4: the run ends within 60 s with every process
    gone (ranks, engine processes, reward workers) 10 s later; each rank says it stopped and
    names the newest complete checkpoint; the run directory's lock is released; checkpoints/
    holds complete checkpoints only ([3]) and the resume continues bit for bit.
    Before the stop handler (megarl/utils/stop_signals.py; planted again by not installing it)
    the run ended as fast with the same checkpoints, but the ranks died by the signal without
    unwinding (engine and reward pool not closed, the run-dir lock left for the resume to take
    over, which another host does only after its 60 s lease): it failed on
    "assert 'rank 0: stopped by ' in ..." (the lock check comes after)."""
    run, sig = tmp_path / "run", "SIGTERM"  # SIGINT behaves the same (checked by hand: 1 run)

    def stop(agent):
        _ranks(agent)[1].send_signal(getattr(signal, sig))
        return f"{sig} to rank 1"

    rc, out, took = _fault_kill_after_checkpoint_3(run, stop)
    print(f"{sig}: the run ended {took:.1f} s after the signal")
    assert rc != 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: stopped by " in out, out[-3000:]
    assert f"rank 1: stopped by {sig}; newest complete checkpoint: {run / 'checkpoints'}" in out
    assert not (run / ".megarl.lock").exists(), "the run-dir lock was left behind"
    assert _only_complete(run) == [3]
    _resume(run)
    _assert_bitwise(straight, run)


def test_kill_9_of_an_engine_process_ends_the_run_with_its_name(tmp_path, straight):
    """kill -9 of rank 0's engine process while it generates step 5's batch: the run ends
    non-zero within 60 s, its output names the rollout engine process (EngineProcessError),
    nothing of it stays alive, and trainer.resume=auto continues bit for bit. Passed on the
    code as it was (ended ~1 s after the kill; rank 1 then stopped by torchrun's SIGTERM)."""
    run = tmp_path / "run"

    def kill(agent):
        _engine(_ranks(agent)[0]).kill()
        return "kill -9 of rank 0's engine process"

    rc, out, took = _fault_kill_after_checkpoint_3(run, kill)
    print(f"engine kill: the run ended {took:.1f} s after it")
    assert rc != 0
    # "EngineProcessError: the rollout engine process died (exit code -9) ..." or "... closed its
    # pipe (exit code -9) while the trainer waited for ..." (whichever the trainer notices first)
    line = next((ln for ln in out.splitlines() if "EngineProcessError: " in ln), out[-3000:])
    assert "the rollout engine process" in line and "exit code -9" in line, line
    assert _only_complete(run) == [3]
    _resume(run)
    _assert_bitwise(straight, run)


def _shm_of(pids) -> list[str]:
    """/dev/shm entries a process of the run created (megarl's named segments carry their
    creator's pid, ``megarl-ring-<pid>-...``; torch's ``torch_<pid>_...``)."""
    marks = [f"megarl-ring-{p}-" for p in pids] + [f"torch_{p}_" for p in pids]
    return sorted(n for n in os.listdir(SHM) if n.startswith(("megarl-", "torch_"))
                  and any(n.startswith(m) for m in marks))


def _ring_files(pid: int) -> set[str]:
    """The weight-ring files process ``pid`` maps (device:inode), from /proc/<pid>/maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {" ".join(line.split()[3:5]) for line in maps if "/megarl-ring-" in line}


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_kill_9_of_a_rank_leaves_no_engine_and_no_shared_memory(tmp_path, demo_assets):
    """kill -9 of rank 1 during step 2: the run ends within 60 s; 10 s later no process of the
    run is alive (the engine processes included) and /dev/shm holds no segment a process of
    the run created. Passed on the code as it was. Planted (the engine process without
    die_with_parent): still passes, the engine also ends on its pipe's EOF; it fails only
    where both give way. The weight ring is one file per node, mapped by both engine processes
    and rank 0 (its writer), not by rank 1; its name is gone from /dev/shm once mapped.
    Planted (the ring's name not unlinked after mapping): the /dev/shm check fails with the
    ``megarl-ring-<rank 0 pid>-...`` file."""
    run = tmp_path / "run"
    agent, log = _start(run, "trainer.total_training_steps=200", "trainer.save_freq=-1")
    try:
        metrics = run / "metrics.jsonl"
        _wait_for("step 1", lambda: metrics.exists() and metrics.read_text().count("\n") >= 1,
                  agent)
        ranks = _ranks(agent)
        engines = [_engine(r).pid for r in ranks.values()]
        rings = [_ring_files(p) for p in engines]
        assert len(rings[0]) == 1 and rings[0] == rings[1], rings  # one ring for the node
        assert _ring_files(ranks[0].pid) == rings[0] and not _ring_files(ranks[1].pid)
        pids = _run_pids(agent)
        ranks[1].kill()
        _ended(agent, pids, "kill -9 of rank 1", 60)
        assert not [p for p in engines if alive(p)]
        assert _shm_of([agent.pid, *pids]) == []
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
