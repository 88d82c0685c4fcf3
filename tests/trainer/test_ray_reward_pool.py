"""A trainer run scoring with ``reward_model.pool=ray`` gives the same metrics as with the local
pool. The Ray run happens inside a loopback-only network namespace (a local Ray binds
every interface); skipped, saying why, where Ray or namespaces are unavailable."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns_helpers import ray_netns_or_skip
from trainer_helpers import FAST, REPO, TIMING_PREFIXES, env, metrics, train

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ARGS = ["trainer.total_training_steps=2", "reward_model.num_workers=2"]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
            for r in rows]


def test_ray_pool_matches_local(tmp_path, demo_assets):
    prefix = ray_netns_or_skip()
    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    train(local_dir, "pure_prm_vr", *ARGS, "reward_model.pool=local")
    cmd = [sys.executable, "launch/train.py", "--config", "pure_prm_vr",
           f"trainer.default_local_dir={ray_dir}", *FAST, *ARGS, "reward_model.pool=ray"]
    inner = " ".join(f"'{c}'" for c in cmd)
    proc = subprocess.run([*prefix, "sh", "-c", f"ip link set lo up && exec {inner}"], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    local, remote = _comparable(metrics(local_dir)), _comparable(metrics(ray_dir))
    assert len(local) == 2 and local == remote
