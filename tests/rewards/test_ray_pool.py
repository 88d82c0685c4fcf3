"""The Ray pool against the local pool on the same hostile batch.

Ray binds the machine's external address, so the Ray half runs in a child process inside a
network namespace that has only a loopback interface (`unshare --net --map-root-user`, `ip
link set lo up`); the local pool scores the same batch in this process meanwhile. Skipped,
saying why, where Ray is not installed or namespaces are not permitted.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from netns_helpers import ray_netns_or_skip
from reward_cases import MIXED

from megarl.rewards import RewardFnSpec, RewardRequest, make_reward_pool

REPO = Path(__file__).resolve().parents[2]
# Seconds an item may take. Only the "sleep" item should reach it: the suite runs this test
# beside the other xdist worker, the Ray cluster's own processes and the local pool on 2 cores.
# Measured: with one busy loop beside the test every item but "sleep" passes at 10 s; with two
# busy loops the Ray side timed out a plain gsm8k item at 3 s and at 10 s alike (starved).
TIMEOUT_S = 10.0

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

EXPECTED = [(m[3], m[4]) for m in MIXED] + [(0.0, "ok"), (1.0, "ok"), (0.0, "ok"), (0.0, "ok"), (1.0, "ok"), (1.0, "ok")]


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


def _score_with_ray(hostile_path: str, out_path: str) -> None:
    """Child side, inside the namespace: a real local Ray, the Ray pool, results to JSON."""
    import ray

    # Ray's memory monitor off: it kills the newest worker when the node's memory runs above
    # 95% (the suite's other worker can hold vLLM beside it), which would take an innocent item
    # down twice; this test is about the pool's own rules (a run keeps Ray's default).
    ray.init(num_cpus=4, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False,
             _system_config={"memory_monitor_refresh_ms": 0})
    try:
        nodes = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
        pool = make_reward_pool("ray", num_workers=2, timeout_s=TIMEOUT_S, memory_mb=512)
        results = pool.score(_batch(hostile_path))
        again = pool.score(_batch(hostile_path)[:1])[0]  # replaced actors keep serving
        stats = dict(pool.stats)
        pool.close()
    finally:
        ray.shutdown()
    Path(out_path).write_text(json.dumps({
        "nodes": nodes, "results": [list(r) for r in results], "again": list(again), "stats": stats,
    }))


def test_ray_matches_local(hostile_path, tmp_path):
    prefix = ray_netns_or_skip()
    out = tmp_path / "ray.json"
    here = Path(__file__).parent
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(here)!r}, {str(here.parent)!r}]; "
            f"from test_ray_pool import _score_with_ray; _score_with_ray({hostile_path!r}, {str(out)!r})")
    child = subprocess.Popen([*prefix, "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"{code}\""],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with make_reward_pool("local", num_workers=2, timeout_s=TIMEOUT_S, memory_mb=512) as pool:
            local = pool.score(_batch(hostile_path))
            local_stats = dict(pool.stats)
        log, _ = child.communicate(timeout=200)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and out.exists(), log[-6000:]
    got = json.loads(out.read_text())
    assert got["nodes"] == ["127.0.0.1"]  # Ray saw only the loopback interface
    remote = [tuple(r) for r in got["results"]]
    assert [(r.score, r.status) for r in local] == EXPECTED
    assert [(s, st) for s, _, st in remote] == EXPECTED, [  # what each failed item said
        (i, e) for i, (_, e, st) in enumerate(remote) if st != "ok"]
    assert [e for _, e, st in remote if st == "ok"] == [r.extra for r in local if r.status == "ok"]
    assert tuple(got["again"]) == (1.0, {}, "ok")
    assert (local_stats["reward/timeouts"], local_stats["reward/errors"], local_stats["reward/crash_retries"]) == (1, 4, 3)
    stats = got["stats"]
    assert (stats["reward/timeouts"], stats["reward/errors"]) == (1, 4)
    # alloc, exit and segv each killed two actors; an actor lost to the system under heavy load
    # is retried too, so this is a lower bound.
    assert stats["reward/crash_retries"] >= 3


class _Handle:
    """An actor handle's call interface, recording what was sent (the scheduler's side only:
    `RayRewardPool._dispatch` calls ``handle.score.remote(request)``)."""

    def __init__(self):
        self.sent = []
        self.score = self

    def remote(self, request):
        self.sent.append(request)
        return object()


def test_a_retried_item_runs_alone_on_a_fresh_actor():
    """A death is charged to the head call, which can be an innocent item whose answer was lost
    with the actor the call behind it killed (CI saw a plain math item score "error" that way
    on a slow machine): its retry must run alone, so that a second death is its own. Before the
    fix the fresh actor got the retried item with a pending one queued behind it ([1, 4])."""
    from collections import deque

    from megarl.rewards.pool_policy import Batch
    from megarl.rewards.ray_pool import RayRewardPool, _Slot

    pool = object.__new__(RayRewardPool)  # the scheduler alone: no cluster
    pool.pipeline_depth = 2
    used, fresh = _Slot(_Handle(), None), _Slot(_Handle(), None)
    used.ready = fresh.ready = True
    used.fresh = False
    pool._slots = [used, fresh]
    batch = Batch([RewardRequest("math", f"\\boxed{{{i}}}", str(i)) for i in range(5)])
    batch.pending = deque([2, 3, 4])
    batch.retries.append(1)
    batch.crashes[1] = 1
    pool._dispatch(batch)
    assert fresh.indices() == [1] and used.indices() == [2, 3]
    assert list(batch.pending) == [4] and not batch.retries
    pool._dispatch(batch)  # nothing joins the retried item while it runs
    assert fresh.indices() == [1] and used.indices() == [2, 3]
