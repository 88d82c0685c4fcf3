"""`ray` reward pool: one Ray actor per worker, on any node of the cluster.

Same contract as the local pool: results in request order; an item past `timeout_s` kills its
actor (`ray.kill`), scores 0 with status "timeout" and the actor is replaced; an actor that
dies (segfault, os._exit, MemoryError under its RLIMIT_AS) has its item retried once, alone, on a
fresh actor, then it scores 0 with status "error". Each actor runs at most `pipeline_depth` calls
queued, so the parent knows when the head call started (when the one before it finished).

A retried item runs alone because a death is charged to the head call, and the head can be an
innocent item whose answer was lost with the actor that the call behind it killed; run alone,
its retry is its own.

memory_mb: an idle Ray worker already maps ~1.3 GB of address space (mostly reserved, not
resident), so inside an actor RLIMIT_AS is set to that idle size plus memory_mb.

Lifetime: a local cluster the pool starts dies with the process that started it (the training
rank), however it dies. Ray starts its gcs_server, raylet, monitor, log monitor and dashboard
with ``PR_SET_PDEATHSIG`` (its "kernel fate-sharing"), and the actors die with their raylet
within seconds; but the raylet's two agents (dashboard agent, runtime-env agent), after they see
the raylet die, first try to report it to the dead GCS and linger 60 s. So on Linux the pool
also starts a tiny reaper (`_reaper_main`): it gets ``SIGTERM`` when the rank dies and kills
the processes the raylet had started (checked by start time, so never a reused pid). Both
signals follow the thread that built the pool (see `megarl.utils.lifetime`): build it from the
main thread, as the trainer does. A cluster the pool joined (an address, ``RAY_ADDRESS``) is
only connected to: no process is started, none reaped, and ``close()`` only disconnects.

Ray is optional: this module imports it only when a pool is built.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from megarl.rewards.pool import RewardRequest, RewardResult
from megarl.rewards.pool_policy import Batch, PoolSlot, SupervisedRewardPool


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of the processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append((int(d), int(fields[19])))
    return out


def _reaper_main() -> None:
    """Reaper process: argv = parent pid, then pid:start_time of each process to kill when the
    parent dies (SIGTERM, from the kernel at its death or from `close`)."""
    from megarl.utils.lifetime import _set_parent_death_signal

    parent = int(sys.argv[1])
    targets = [tuple(int(x) for x in a.split(":")) for a in sys.argv[2:]]

    def reap(*_):
        for pid, start in targets:
            if _start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        os._exit(0)

    signal.signal(signal.SIGTERM, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _set_parent_death_signal(signal.SIGTERM):
        if os.getppid() != parent:  # died before the call
            reap()
        while True:
            signal.pause()
    while os.getppid() == parent:  # no kernel signal (a seccomp filter): poll
        time.sleep(0.5)
    reap()


def _start_reaper(ray) -> subprocess.Popen | None:
    """The reaper of the raylet's children (its agents, prestarted workers), if this process
    started the local cluster (Linux only: elsewhere Ray's own process-group reaper runs)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        node = ray._private.worker._global_node
        raylets = node.all_processes.get("raylet") or []
        if not raylets:  # joined a running cluster: nothing of ours to reap
            return None
        targets = _children(raylets[0].process.pid)
    except Exception:  # noqa: BLE001 - Ray internals moved: Ray's own fate-sharing remains
        return None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import sys; sys.path.insert(0, {root!r}); "
            "from megarl.rewards.ray_pool import _reaper_main; _reaper_main()")
    return subprocess.Popen([sys.executable, "-c", code, str(os.getpid()),
                             *(f"{p}:{t}" for p, t in targets)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True)


class _RewardActor:
    """Runs `execute.run_request` in a Ray worker process."""

    def ready(self, memory_mb: int) -> int:
        from megarl.rewards.execute import limit_address_space, warm_up

        limit_address_space(_vm_size_bytes() + memory_mb * 2**20)
        warm_up()
        return os.getpid()

    def score(self, request: RewardRequest):
        from megarl.rewards.execute import WorkerCrash, run_request

        try:
            return run_request(request)
        except WorkerCrash:
            os._exit(3)  # the pool sees the actor die and retries the item on a fresh one


class _Slot(PoolSlot):
    """One actor: its handle and warm-up call; inflight holds (index, ObjectRef) in call order."""

    def __init__(self, handle, ready_ref):
        super().__init__()
        self.handle, self.ready_ref = handle, ready_ref

    def indices(self) -> list[int]:
        return [i for i, _ in self.inflight]


class RayRewardPool(SupervisedRewardPool):
    """Ray actors with a per-item wall-clock bound and an address-space bound per actor.

    address: a running cluster ("auto", "ray://...", host:port) or None to start a local Ray
    (or reuse the one this process already initialised). init_kwargs: extra `ray.init`
    arguments for a local start (default: 256 MiB object store, no dashboard).
    actor_num_cpus: CPUs each actor reserves. pipeline_depth: calls queued per actor.
    start_timeout_s: seconds a new actor may take to start and warm up. max_start_failures:
    start failures in a row that close the pool and raise. Crash / timeout policy:
    `megarl.rewards.pool_policy`.
    """

    worker_noun = "actor"
    start_fix = "install megarl and math-verify on every Ray node."

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        address: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        actor_num_cpus: float = 1.0,
        pipeline_depth: int = 2,
        start_timeout_s: float = 300.0,
        max_start_failures: int = 3,
    ):
        super().__init__(num_workers, timeout_s, memory_mb, start_timeout_s, max_start_failures)
        try:
            import ray
        except ImportError as e:
            raise ImportError(
                "reward_model.pool=ray needs Ray: pip install 'megarl[ray]' (or pool=local)"
            ) from e
        self._ray = ray
        self.pipeline_depth = max(1, pipeline_depth)
        self._owns_ray = False
        self._reaper: subprocess.Popen | None = None
        if not ray.is_initialized():
            kw: dict[str, Any] = {"address": address} if address else {
                "object_store_memory": 256 * 2**20,
                "include_dashboard": False,
            }
            kw.update(init_kwargs or {})
            ray.init(**kw)
            self._owns_ray = True
            self._reaper = _start_reaper(ray)
        self._actor_cls = ray.remote(num_cpus=actor_num_cpus, max_restarts=0, max_task_retries=0)(_RewardActor)
        self._closed = False
        self._slots = [self._new_slot() for _ in range(num_workers)]

    # -- public -----------------------------------------------------------------------------

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        if self._closed:
            raise RuntimeError("RayRewardPool.score() after close()")
        with self._lock:
            try:
                return self._score(Batch(list(requests)))
            except BaseException:
                # Interrupted: replace actors that still hold calls of this batch.
                if not self._closed:
                    for s in list(self._slots):
                        if s.inflight:
                            self._replace(s)
                raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._slots:
            self._kill(s)
        self._slots = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()  # a joined cluster: only disconnects
        if self._reaper is not None:  # kill what the shutdown left (agents exit late)
            self._reaper.terminate()
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None

    # -- scheduling -------------------------------------------------------------------------

    def _new_slot(self) -> _Slot:
        handle = self._actor_cls.options(scheduling_strategy="SPREAD").remote()
        return _Slot(handle, handle.ready.remote(self.memory_mb))

    def _kill(self, s: _Slot) -> None:
        try:
            self._ray.kill(s.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _score(self, batch: Batch) -> list[RewardResult]:
        ray = self._ray
        while batch.remaining:
            self._dispatch(batch)
            watched: dict[Any, _Slot] = {}
            for s in self._slots:
                if not s.ready:
                    watched[s.ready_ref] = s
                elif s.inflight:
                    watched[s.inflight[0][1]] = s
            if not watched:
                raise RuntimeError("RayRewardPool: items left but no actor is busy (scheduler bug)")
            now = time.monotonic()
            timeout = max(0.0, min(self._deadline(s) for s in watched.values()) - now)
            done, _ = ray.wait(list(watched), num_returns=1, timeout=timeout)
            if done:
                done, _ = ray.wait(list(watched), num_returns=len(watched), timeout=0)
            for ref in done:
                s = watched[ref]
                if s not in self._slots:
                    continue
                if not s.ready:
                    self._on_ready(s)
                else:
                    self._on_result(s, batch)
            now = time.monotonic()
            for s in list(self._slots):
                if (s.inflight or not s.ready) and now > self._deadline(s):
                    self._expire(batch, s)
        return batch.results  # type: ignore[return-value]

    def _dispatch(self, batch: Batch) -> None:
        """Keep each ready actor `pipeline_depth` calls deep with pending items; a retried item
        goes to an idle actor and nothing is queued behind it (module doc)."""
        fresh_available = any(s.fresh for s in self._slots)
        for s in self._slots:
            if not s.ready:
                continue
            while len(s.inflight) < self.pipeline_depth:
                if s.inflight and batch.crashes[s.inflight[-1][0]]:
                    break  # a retried item runs alone
                i = None if s.inflight else batch.take_retry(s, fresh_available)
                if i is None:
                    if not batch.pending:
                        break
                    i = batch.pending.popleft()
                if not s.inflight:
                    s.item_start = time.monotonic()
                s.fresh = False
                s.inflight.append((i, s.handle.score.remote(batch.requests[i])))

    def _on_ready(self, s: _Slot) -> None:
        try:
            self._ray.get(s.ready_ref)
        except Exception as e:  # noqa: BLE001
            self._start_failed(s, f"{type(e).__name__}: {e}"[:500])
            return
        self._started(s)

    def _on_result(self, s: _Slot, batch: Batch) -> None:
        """The head call finished: its result, or the actor died (`_crashed`)."""
        ray = self._ray
        index, ref = s.inflight[0]
        try:
            score, extra, status = ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # the method itself raised: not a crash
            score, extra, status = 0.0, {"error": f"{type(e).__name__}: {e}"[:500]}, "error"
        except ray.exceptions.RayError as e:  # the actor died
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self._crashed(batch, s, f"actor died: {type(e).__name__}: {first}")
            return
        s.inflight.popleft()
        s.item_start = time.monotonic()
        self._record(batch, index, score, extra, status)
