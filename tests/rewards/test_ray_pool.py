"""The Ray pool (issue 9) against the local pool on the same hostile batch.

Ray binds the machine's external address, so the test re-executes itself inside a network
namespace that has only a loopback interface (`unshare --net --map-root-user`, `ip link set lo
up`). It is skipped, saying why, where Ray is not installed or namespaces are not permitted.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MIXED

from megarl.rewards import RewardFnSpec, RewardRequest, make_reward_pool

IN_NETNS = os.environ.get("MEGARL_RAY_NETNS") == "1"
REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _unshare_prefix() -> list[str] | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    candidates = [["unshare", "--net", "--map-root-user"]]
    if os.geteuid() == 0:
        candidates.append(["unshare", "--net"])
    for prefix in candidates:
        r = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
        if r.returncode == 0:
            return prefix
    return None


def _batch(hostile_path: str) -> list[RewardRequest]:
    spec = RewardFnSpec(kind="custom", path=hostile_path, name="compute")
    reqs = [RewardRequest("math", resp, gt, {"mode": mode}, spec) for mode, resp, gt, _, _ in MIXED]
    reqs += [
        RewardRequest("countdown", "<answer>9**9**9**9</answer>", {"target": 1, "numbers": [9, 9, 9, 9]}),
        RewardRequest("countdown", "<answer>(1+2)*8</answer>", {"target": 24, "numbers": [8, 2, 1]}),
        RewardRequest("math", "\\boxed{__import__('os').system('echo pwned')}", "0"),
        RewardRequest("math", "\\boxed{" + "(" * 10000 + "1" + ")" * 10000 + "}", "1"),
        RewardRequest("math", "y" * 2**20 + "\\boxed{(x+1)^2}", "x^2+2x+1"),
        RewardRequest("gsm8k", "#### 18", "18"),
    ]
    return reqs


def test_ray_matches_local(hostile_path):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'megarl[ray]'")
    if not IN_NETNS:
        prefix = _unshare_prefix()
        if prefix is None:
            pytest.skip("network namespaces are not permitted here (unshare --net failed or no `ip`); "
                        "a local Ray would bind the machine's external address")
        inner = f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider -p no:randomly " \
                f"'{Path(__file__)}::test_ray_matches_local'"
        r = subprocess.run([*prefix, "sh", "-c", inner], cwd=REPO, env={**os.environ, "MEGARL_RAY_NETNS": "1"},
                           capture_output=True, text=True, timeout=200)
        assert r.returncode == 0, (r.stdout[-6000:], r.stderr[-3000:])
        assert "1 passed" in r.stdout, r.stdout[-3000:]
        return

    import ray

    reqs = _batch(hostile_path)
    with make_reward_pool("local", num_workers=2, timeout_s=3.0, memory_mb=512) as pool:
        local = pool.score(reqs)
        local_stats = dict(pool.stats)
    ray.init(num_cpus=4, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback only
        pool = make_reward_pool("ray", num_workers=2, timeout_s=3.0, memory_mb=512)
        remote = pool.score(reqs)
        assert pool.score(reqs[:1])[0] == (1.0, {}, "ok")  # replaced actors keep serving
        ray_stats = dict(pool.stats)
        pool.close()
    finally:
        ray.shutdown()
    expected = [(m[3], m[4]) for m in MIXED] + [(0.0, "ok"), (1.0, "ok"), (0.0, "ok"), (0.0, "ok"), (1.0, "ok"), (1.0, "ok")]
    assert [(r.score, r.status) for r in local] == expected
    assert [(r.score, r.status) for r in remote] == expected
    assert [r.extra for r in remote if r.status == "ok"] == [r.extra for r in local if r.status == "ok"]
    for key in ("reward/timeouts", "reward/errors", "reward/crash_retries"):
        assert ray_stats[key] == local_stats[key], key
    assert (ray_stats["reward/timeouts"], ray_stats["reward/errors"], ray_stats["reward/crash_retries"]) == (1, 4, 3)
