"""Exact resume: 6 steps straight == 3 steps, a hard kill, resume, 3 more steps, bit for bit
(fp32, CPU, 2 ranks). And a kill while a checkpoint is being written leaves the previous one
usable, which trainer.resume=auto then picks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import FAST, REPO, env, strip_timing, train, train_rows

from megarl.trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.dist

COMMON = ["trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.export_hf=true",
          "trainer.test_freq=3", "actor_rollout_ref.model.dtype=fp32"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "hf_actor").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _train_killed_after_checkpoint(run_dir: Path, step: int, config: str,
                                  extra: list[str]) -> None:
    """Start the 6-step run and SIGKILL the whole torchrun group once checkpoint ``step`` is
    complete (the run is then somewhere in the following steps)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/train.py", "--config", config, f"trainer.default_local_dir={run_dir}",
           *FAST, *COMMON, *extra]
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
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"]


@pytest.mark.parametrize("config,extra", [
    pytest.param("grpo", [], id="grpo"),
    pytest.param("pure_prm_vr", [], id="pure_prm_vr"),
    # vLLM rollouts: the resumed engine is rebuilt from the folder and synced from the
    # checkpoint; seeded per prompt, its samples repeat bit for bit
    pytest.param("grpo", VLLM, id="grpo-vllm", marks=pytest.mark.vllm),
])
def test_kill_and_resume_is_bitwise_identical(tmp_path, demo_assets, config, extra):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, config, *COMMON, *extra, nproc=2)
    _train_killed_after_checkpoint(resumed, 3, config, extra)
    assert CheckpointManager(resumed / "checkpoints").complete_steps()[-1] >= 3
    train(resumed, config, *COMMON, *extra, "trainer.resume=auto", nproc=2)

    a, b = train_rows(straight), train_rows(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert strip_timing(ra) == strip_timing(rb), f"step {ra['step']} metrics differ"
    wa, wb = _weights(straight), _weights(resumed)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    # and training did change the weights (the comparison is not between two copies of the init)
    init = load_file(next(_policy_dir().glob("*.safetensors")))
    assert any(not torch.equal(init[k], wa[k]) for k in init if k in wa)


def _policy_dir() -> Path:
    from megarl.demo.assets import resolve_uri

    return Path(resolve_uri("embedded://policy"))


WRITER = r"""
import sys, time
from pathlib import Path
from megarl.trainer.checkpoint import CheckpointManager
from megarl.utils import dist as mdist
import torch
mdist.init_distributed(torch.device("cpu"))
root, step = Path(sys.argv[1]), int(sys.argv[2])
def slow_roles(tmp):
    (tmp / "actor").mkdir()
    for i in range(1000):                      # a long, file-by-file write: killed in here
        (tmp / "actor" / f"shard{i}").write_bytes(b"x" * 1000)
        print("writing", flush=True)
        time.sleep(0.01)
CheckpointManager(root).save(step, slow_roles, {"step": step})
"""


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root)
    mgr_env = env()
    # a complete checkpoint at step 3, written normally
    subprocess.run([sys.executable, "-c", WRITER.replace("range(1000)", "range(2)"), str(root), "3"],
                   cwd=REPO, env=mgr_env, check=True, capture_output=True, timeout=120)
    assert mgr.complete_steps() == [3]
    # step 6 is killed while its files are being written
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), "6"], cwd=REPO, env=mgr_env,
                            stdout=subprocess.PIPE, text=True)
    for _ in range(20):
        proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (root / ".tmp_global_step_6").exists()  # the partial write is there...
    assert mgr.complete_steps() == [3]  # ...but never counts
    assert mgr.latest() == root / "global_step_3"
    assert CheckpointManager.load_trainer_state(mgr.latest())["step"] == 3
