"""No process of a run outlives it: ``kill -9`` of the torchrun agent takes the ranks, the reward
pools' zygotes and workers and the asynchronous engine processes with it
(`megarl.utils.lifetime.die_with_parent`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from process_helpers import alive, wait_gone

REPO = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.dist
@pytest.mark.e2e
@pytest.mark.parametrize("extra,needs", [
    ([], "megarl.rewards._worker"),
    (["async_training.staleness_threshold=1"], "multiprocessing"),
], ids=["torch", "async1"])
def test_kill_9_of_the_torchrun_agent_leaves_nothing_of_the_run(tmp_path, demo_assets, extra,
                                                                needs):
    """A 2-rank GRPO run on the demo, ``kill -9`` of the torchrun agent during step 2: 5 s later
    no process the run started is alive (ranks, the reward pools' zygotes and workers, the
    asynchronous engine processes). Planted (the ranks without die_with_parent): both ranks
    and the reward pools' zygote and workers are alive 5 s later, training on."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "launch/train.py", "--config", "grpo", f"trainer.default_local_dir={run}",
         "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.rollout.n=4", "data.max_response_length=48",
         "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
         "trainer.export_hf=false", "trainer.total_training_steps=200",
         "trainer.save_freq=-1", *extra],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while _rows(run / "metrics.jsonl") < 1:  # step 1 logged: step 2 is under way
            assert agent.poll() is None, f"the run exited {agent.returncode} before step 1"
            assert time.monotonic() < deadline, "no step logged in 300 s"
            time.sleep(0.1)
        time.sleep(1.0)  # the asynchronous engine has started its next batch
        tree = psutil.Process(agent.pid).children(recursive=True)
        pids = {p.pid for p in tree}
        cmdlines = [" ".join(p.cmdline()) for p in tree if alive(p.pid)]
        assert sum("launch/train.py" in c for c in cmdlines) == 2, cmdlines
        assert any(needs in c for c in cmdlines), (needs, cmdlines)
        agent.kill()
        agent.wait(timeout=10)
        left = wait_gone(pids, 5.0)
        survivors = {p: " ".join(psutil.Process(p).cmdline()) for p in left if alive(p)}
        assert not survivors, (
            f"alive 5 s after kill -9 of the agent: {json.dumps(survivors, indent=1)}")
    finally:
        agent.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)
