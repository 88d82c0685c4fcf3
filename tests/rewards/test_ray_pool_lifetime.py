"""No process of a local Ray cluster that the Ray reward pool started outlives the process that
started it (the training rank), and a cluster it joined is left alone.

``kill -9`` of the driver takes Ray's gcs_server, raylet, monitor, log monitor, dashboard, the
raylet's two agents, the pool's reaper and the reward actor with it; measured here all gone
within about 0.2 s. Ray does most of it itself: on Linux ``ray.init`` starts every process of a
local cluster with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (its "kernel fate-sharing",
``ray._private.services.start_ray_process``) and the workers die with their raylet. Not the
raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``): they notice the raylet's
death within 0.2 s but then try to report it to the dead GCS (``publish_error_to_driver``, a
60 s timeout) and exit only 61 s after the kill. Before the pool's reaper (planted back:
``MEGARL_PLANT_RAY_LIFETIME=no_reaper``) this test failed naming those two agents. Planted
``no_fate_sharing`` (Ray's kernel fate-sharing and its own reaper off as well): gcs_server,
raylet, monitor, log monitor, dashboard and both agents alive 15 s after the kill.

Processes are collected three ways, so that one daemonised or renamed (``ray::...`` overwrites
its command line and environment) is not missed: the driver's process tree before the kill,
every process in the test's own network namespace (the driver runs in a fresh loopback-only
one; nothing else lives there), and any process whose command line names the driver's Ray
session directory or whose environment carries this test's tag. Zombies are not counted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from netns_helpers import ray_netns_or_skip

psutil = pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parents[2]
TAG_ENV = "MEGARL_RAY_LIFETIME_TAG"
# Test-only plants, read by the driver below: "no_reaper" (the pool as it was before its reaper),
# "no_fate_sharing" (Ray's kernel fate-sharing and its own reaper off as well).
PLANT_ENV = "MEGARL_PLANT_RAY_LIFETIME"

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

DRIVER = f"""
import os, sys, time
plant = os.environ.get({PLANT_ENV!r}, "")
if plant:
    import megarl.rewards.ray_pool
    megarl.rewards.ray_pool._start_reaper = lambda ray: None
if plant == "no_fate_sharing":
    import ray._private.node, ray._private.utils
    ray._private.utils.detect_fate_sharing_support = lambda: False
    ray._private.node.Node.start_reaper_process = lambda self: None
import ray
from megarl.rewards import RewardRequest, make_reward_pool
address = sys.argv[1] or None
init = None if address else {{"num_cpus": 1, "log_to_driver": False}}
pool = make_reward_pool("ray", num_workers=1, timeout_s=60.0, memory_mb=512, ray_address=address,
                        init_kwargs=init)
assert pool._owns_ray and (pool._reaper is None) == bool(plant or address)
result = pool.score([RewardRequest("gsm8k", "#### 18", "18")])[0]
assert result.status == "ok", result
session = ray._private.worker._global_node.get_session_dir_path()
print("READY", os.getpid(), session, flush=True)
time.sleep(600)
"""


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return str(p.pid)


def _run_processes(driver: psutil.Process, netns: str | None, session: str,
                   tag: str) -> set[psutil.Process]:
    """Every live process of the run, found by tree, network namespace (None: not by it), session
    dir or tag; the driver itself left out."""
    found = set()
    try:
        found.update(driver.children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if (netns and _netns(p.pid) == netns) or session in " ".join(p.cmdline()) \
                    or p.environ().get(TAG_ENV) == tag:
                found.add(p)
        except psutil.Error:  # another user's process, or gone meanwhile
            continue
    return {p for p in found if _alive(p) and p.pid != driver.pid}


def _kill_all(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _start_driver(prefix: list[str], tag: str, before_driver: str = "", address: str = ""):
    """The driver in a fresh network namespace, after ``before_driver`` (shell) there; returns
    (Popen, driver, its netns, its Ray session dir) once it has scored one request."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), TAG_ENV: tag}
    # `unshare` and `sh` exec: the Popen pid is the driver's.
    script = f'ip link set lo up && {before_driver} exec {sys.executable} -c "$0" "$1"'
    child = subprocess.Popen([*prefix, "sh", "-c", script, DRIVER, address], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in child.stdout:
        log.append(line)
        if line.startswith("READY"):
            break
    if not (log and log[-1].startswith("READY")):
        child.kill()
        child.wait()
        pytest.fail("driver did not start:\n" + "".join(log)[-6000:])
    _, pid, session = log[-1].split()
    assert int(pid) == child.pid
    netns = _netns(child.pid)
    assert netns is not None and netns != _netns(os.getpid())
    return child, psutil.Process(child.pid), netns, session


def test_kill_9_of_the_driver_takes_the_local_ray_cluster():
    prefix = ray_netns_or_skip()
    tag = uuid.uuid4().hex
    child, driver, netns, session = _start_driver(prefix, tag)
    survivors: set[psutil.Process] = set()
    try:
        before = _run_processes(driver, netns, session, tag)
        names = {p.name() for p in before}
        # The cluster and the actor exist before the kill (else the test would prove nothing).
        assert {"gcs_server", "raylet", "ray::_RewardActor", "ray::DashboardAgent"} <= names, names

        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            survivors = {p for p in before if _alive(p)}
            if not survivors:
                break
            time.sleep(0.2)
        # Nothing new started meanwhile either (a restarted worker, a respawned daemon). Not by
        # namespace now: a freed namespace's inode number is soon reused by another.
        survivors |= _run_processes(driver, None, session, tag)
        assert not survivors, "alive 15 s after kill -9 of the driver:\n" + "\n".join(
            sorted(_describe(p) for p in survivors))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        _kill_all(survivors)


def test_kill_9_of_a_driver_that_joined_a_cluster_leaves_the_cluster():
    """A cluster given by address (here `ray start --head` in the same namespace) is only joined:
    the pool starts no reaper, and the cluster's gcs_server and raylet outlive the driver."""
    prefix = ray_netns_or_skip()
    tag = uuid.uuid4().hex
    # short: Ray's socket paths live under it (a Unix socket path holds 107 bytes at most)
    temp = Path(tempfile.gettempdir()) / f"rlt{tag[:8]}"
    ray_cli = Path(sys.executable).with_name("ray")
    # Token authentication off (head and driver): the driver would not find the head's token.
    head = (f"export RAY_AUTH_MODE=disabled && {ray_cli} start --head --port=6379 --num-cpus=1 "
            f"--include-dashboard=false --object-store-memory={80 * 2**20} --disable-usage-stats "
            f"--temp-dir={temp} >/dev/null 2>&1 &&")
    try:
        child, driver, netns, session = _start_driver(prefix, tag, head, "127.0.0.1:6379")
        try:
            cluster = _run_processes(driver, netns, session, tag)
            heads = {p for p in cluster if p.name() in ("gcs_server", "raylet")}
            assert len(heads) == 2 and not driver.children(), [_describe(p) for p in cluster]
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            time.sleep(3)
            assert all(_alive(p) for p in heads), [_describe(p) for p in heads]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:  # the head, by pid: `ray stop` would stop every Ray on the machine
        mine = set()
        for p in psutil.process_iter():
            try:
                if str(temp) in " ".join(p.cmdline()):
                    mine |= {p, *p.children(recursive=True)}  # the agents rename themselves
            except psutil.Error:
                continue
        _kill_all(mine)
        psutil.wait_procs(list(mine), timeout=10)
        shutil.rmtree(temp, ignore_errors=True)
