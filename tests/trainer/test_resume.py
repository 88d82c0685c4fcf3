"""Exact resume: 4 steps straight == 2 steps, a hard kill, resume, 2 more steps, bit for bit
(fp32, CPU, 2 ranks). And a kill of launch/train.py while it writes a checkpoint: the partial
one is ignored, trainer.resume=auto picks the previous one, and the run still ends bit for bit
equal to an uninterrupted one."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import FAST, REPO, env, metrics, strip_timing, train, train_rows

from megarl.trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.dist

def schedule(steps: int, every: int) -> list[str]:
    """Overrides for a run of ``steps`` steps that checkpoints and validates every ``every``
    steps, in fp32, exporting its HF weights."""
    return [f"trainer.total_training_steps={steps}", f"trainer.save_freq={every}",
            "trainer.export_hf=true", f"trainer.test_freq={every}",
            "actor_rollout_ref.model.dtype=fp32"]


COMMON = schedule(4, 2)


def _untimed(row: dict) -> dict:
    """A metrics row without its wall-clock entries (every ``timing*`` key included)."""
    return {k: v for k, v in strip_timing(row).items() if not k.startswith("timing")}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "hf_actor").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _train_killed_after_checkpoint(run_dir: Path, step: int, config: str,
                                  extra: list[str], common: list[str] = COMMON) -> None:
    """Start the run (``common``: `schedule`'s overrides) and SIGKILL torchrun and all its
    processes (`_hard_kill`) once checkpoint ``step`` is complete (the run is then somewhere
    in the following steps). The killed run leaves its run-directory lock behind, so the
    resume that follows goes through the lock's takeover (megarl.trainer.run_lock)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/train.py", "--config", config, f"trainer.default_local_dir={run_dir}",
           *FAST, *common, *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = run_dir / "checkpoints" / f"global_step_{step}" / "COMPLETE"
    deadline = time.time() + 600
    try:
        while not marker.exists():
            assert proc.poll() is None, "training exited before the checkpoint appeared"
            assert time.time() < deadline, "no checkpoint within 600 s"
            time.sleep(0.02)
    finally:
        _hard_kill(proc)
    assert (run_dir / ".megarl.lock").exists()


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop(0))
        todo.extend(children.get(out[-1], []))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _hard_kill(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process under it, as a machine failure would. torchrun
    starts each worker in a session of its own (so do the reward workers), so killing
    torchrun's process group would leave the ranks running on (and finishing the checkpoint).
    The tree is frozen with SIGSTOP until no new process appears (a stopped process cannot
    fork), then each process is SIGKILLed; returns once all of them are gone."""
    frozen: list[int] = []
    while new := [p for p in _descendants(proc.pid) if p not in frozen]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60  # a hang guard
    while alive := [p for p in frozen if _alive(p)]:
        assert time.time() < deadline, f"processes {alive} outlived SIGKILL"
        time.sleep(0.01)


# The resumed run prints its steps (the console sink: "step 3/4 | ..."), so its output shows
# which steps that process ran
RESUMED = ["trainer.logger=[console,jsonl]", "trainer.resume=auto"]


def assert_same_runs(straight: Path, resumed: Path, steps: int) -> list[dict]:
    """Both runs logged steps 1..``steps`` with equal metrics (wall-clock entries aside) and
    exported equal weights, which training changed from the initial ones (so the comparison is
    not between two copies of the init). Returns the straight run's rows."""
    a, b = train_rows(straight), train_rows(resumed)
    assert [r["step"] for r in a] == list(range(1, steps + 1)) == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert _untimed(ra) == _untimed(rb), f"step {ra['step']} metrics differ"
    wa, wb = _weights(straight), _weights(resumed)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    init = load_file(next(_policy_dir().glob("*.safetensors")))
    assert any(not torch.equal(init[k], wa[k]) for k in init if k in wa)
    return a


def logged_before(run_dir: Path, step: int) -> list[dict]:
    """The record's rows up to ``step`` as the interrupted run left them (timings included)."""
    return [r for r in metrics(run_dir) if r["step"] <= step]


def assert_resumed(proc: subprocess.CompletedProcess, run_dir: Path, before: list[dict],
                   step: int, total: int) -> None:
    """The resumed run's own evidence that it resumed from checkpoint ``step`` instead of
    training again from the start (a deterministic restart logs the same metrics and exports
    the same weights): it says so, the steps it ran are ``step + 1 .. total`` only, and the
    rows of the interrupted run up to ``step`` are still in the record unchanged, wall-clock
    timings included (a step run again logs new timings)."""
    assert f"resumed from step {step}" in proc.stdout, proc.stdout[-2000:]
    ran = [int(s) for s in re.findall(rf"^step (\d+)/{total} \|", proc.stdout, re.MULTILINE)]
    assert ran == list(range(step + 1, total + 1)), (ran, proc.stdout[-2000:])
    kept = {r["step"]: r for r in metrics(run_dir)}
    for row in before:
        assert kept.get(row["step"]) == row, f"step {row['step']}'s row was logged again"


VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"]


@pytest.mark.parametrize("config,extra", [
    pytest.param("grpo", [], id="grpo"),
    pytest.param("pure_prm_vr", [], id="pure_prm_vr"),
    # vLLM rollouts: the resumed engine is rebuilt from the folder and synced from the
    # checkpoint; seeded per prompt, its samples repeat bit for bit
    pytest.param("grpo", VLLM, id="grpo-vllm", marks=pytest.mark.vllm),
])
def test_kill_and_resume_is_bitwise_identical(tmp_path, demo_assets, config, extra):
    """4 steps straight equal 2 steps, a hard kill after the step-2 checkpoint and a resume
    (metrics but timings, exported weights), and the resumed process ran steps 3-4 only
    (`assert_resumed`). Planted: the trainer ignoring trainer.resume=auto (maybe_resume
    returning None): the restart from step 0 matches the straight run bit for bit (the run is
    deterministic) and fails only on the resume evidence (no "resumed from step 2"), with
    either recipe and with vLLM."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, config, *COMMON, *extra, nproc=2)
    _train_killed_after_checkpoint(resumed, 2, config, extra)
    assert CheckpointManager(resumed / "checkpoints").complete_steps() == [2]
    before = logged_before(resumed, 2)
    proc = train(resumed, config, *COMMON, *extra, *RESUMED, nproc=2)

    assert_same_runs(straight, resumed, 4)
    assert_resumed(proc, resumed, before, 2, 4)


def _policy_dir() -> Path:
    from megarl.demo.assets import resolve_uri

    return Path(resolve_uri("embedded://policy"))


KILL_RUN = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.export_hf=true",
            "actor_rollout_ref.model.dtype=fp32"]


def _train_killed_in_write(run_dir: Path, step: int,
                           config: str) -> tuple[str, list[str]] | None:
    """Start the run and SIGKILL all its processes (`_hard_kill`) as soon as the first DCP
    shard file of checkpoint ``step``'s actor appears on disk (its state is being written).
    Returns (the directory that held the write, the files in it after the kill), or None when
    the checkpoint was complete before the kill landed (a miss)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/train.py", "--config", config, f"trainer.default_local_dir={run_dir}",
           *FAST, *KILL_RUN]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    root = run_dir / "checkpoints"
    deadline = time.time() + 600  # a hang guard, not a speed requirement
    try:
        while not (shards := list(root.glob(f"*global_step_{step}/actor/*.distcp"))):
            assert proc.poll() is None, "training exited before the checkpoint write began"
            assert time.time() < deadline, "no checkpoint write within 600 s"
            time.sleep(0.002)
    finally:
        _hard_kill(proc)
    if (root / f"global_step_{step}" / "COMPLETE").exists():
        return None
    written = shards[0].parents[1]
    return written.name, sorted(str(f.relative_to(written)) for f in written.rglob("*")
                                if f.is_file())


def test_kill_during_checkpoint_write_resumes_from_previous_bitwise(tmp_path, demo_assets):
    """The demo recipe (pure_prm_vr, 2 ranks, torchrun) is SIGKILLed, every process of it,
    while it writes its step-4 checkpoint; resume=auto then ignores the partial directory,
    resumes from global_step_2, and the 4-step run ends bitwise equal to an uninterrupted one
    (metrics but timings, exported HF weights).

    The write takes ~0.2 s here (11 MB: the actor with its Adam state). The kill goes out as
    soon as the first ``actor/*.distcp`` file exists (polled every 2 ms); a kill landing after
    the checkpoint is complete would be retried (3 runs at most). Measured: 10 of 10 kills
    inside the write, leaving .tmp_global_step_4 with one or both DCP shard files and none of
    .metadata, the RNG states, trainer_state.json or COMPLETE.
    Planted: the kill of the whole torchrun process group only (its ranks run in sessions of
    their own and survive): they publish global_step_4 and the resume reports "resumed from
    step 4". The checkpoint written in place (no temporary name): "the write went to
    global_step_4". A rerun with trainer.resume=disable also ends bitwise equal (the run is
    deterministic), hence the check of where the run resumed (`assert_resumed`: the resume
    line, steps 3-4 run, rows 1-2 as the killed run logged them).
    """
    config = "pure_prm_vr"
    straight = tmp_path / "straight"
    train(straight, config, *KILL_RUN, nproc=2)

    found = None
    for attempt in range(3):
        killed = tmp_path / f"killed{attempt}"
        found = _train_killed_in_write(killed, 4, config)
        if found is not None:
            break
    assert found is not None, "three kills all landed after the checkpoint was complete"
    where, partial = found
    root = killed / "checkpoints"
    mgr = CheckpointManager(root)
    assert where == ".tmp_global_step_4", f"the write went to {where}, not a temporary name"
    assert any(f.startswith("actor/") and f.endswith(".distcp") for f in partial), partial
    assert "COMPLETE" not in partial and "trainer_state.json" not in partial, partial
    assert mgr.complete_steps() == [2] and mgr.latest() == root / "global_step_2"

    before = logged_before(killed, 2)
    proc = train(killed, config, *KILL_RUN, *RESUMED, nproc=2)
    assert_resumed(proc, killed, before, 2, 4)
    assert mgr.complete_steps() == [2, 4] and not (root / ".tmp_global_step_4").exists()

    assert_same_runs(straight, killed, 4)


def test_a_step_saved_but_not_logged_is_logged_on_resume(tmp_path, demo_assets):
    """The checkpoint holds its step's metrics row: a run that died after writing checkpoint 2
    and before logging step 2 logs that row on resume (the row equals the uninterrupted run's,
    wall-clock entries aside), and the resumed process ran step 3 only (`assert_resumed`).
    Planted: without the row in the checkpoint, step 2 is missing from the resumed record.
    The trainer ignoring trainer.resume=auto: a restart logs steps 1-3 afresh, its step-2 row
    equals the uninterrupted run's too (the run is deterministic), and only the resume
    evidence fails."""
    run = tmp_path / "run"
    quick = ["trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
             "actor_rollout_ref.model.dtype=fp32"]
    train(run, "grpo", *quick)
    full = train_rows(run)
    assert [r["step"] for r in full] == [1, 2]
    record = run / "metrics.jsonl"
    record.write_text("".join(line + "\n" for line in record.read_text().splitlines()[:-1]))
    assert [r["step"] for r in train_rows(run)] == [1]  # the kill landed between save and log
    before = logged_before(run, 2)
    proc = train(run, "grpo", *quick, "trainer.total_training_steps=3", *RESUMED)
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert _untimed(rows[1]) == _untimed(full[1])
    assert_resumed(proc, run, before, 2, 3)
