"""`local` reward pool: worker subprocesses on this machine, each killable on its own.

Workers are forked by a zygote, `python -m megarl.rewards._worker --zygote` (a fresh interpreter
that has math-verify imported and warmed up, never the trainer's main module or torch), so a
replacement is ready in milliseconds; each talks to the parent over two private pipes. The parent
sends a worker a chunk of items, the worker answers item by item, and the parent watches every
busy worker with `multiprocessing.connection.wait` against a deadline: the item in progress
must finish `timeout_s` after the previous one (or after the send). Past it the worker is
SIGKILLed and replaced and the item scores 0 with status "timeout". A worker that dies
(segfault, os._exit, MemoryError under its RLIMIT_AS) has its item retried once, alone, on a
fresh worker; a second death scores 0 with status "error". Unfinished items of a dead worker's
chunk go back to the queue, so results never depend on the number of workers.

Each worker runs in its own session. Besides keeping terminal signals away, this matters for
throughput on shared Linux machines: with autogroup scheduling (the default on most distros)
all processes of one session share one CPU slice under contention, so N workers in the
trainer's session would score no faster than one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path

from megarl.rewards.pool import RewardRequest, RewardResult
from megarl.rewards.pool_policy import Batch, PoolSlot, SupervisedRewardPool
from megarl.utils import lifetime

_PKG_ROOT = str(Path(__file__).resolve().parents[2])
logger = logging.getLogger(__name__)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[lifetime.PARENT_PID_ENV] = str(os.getpid())  # the zygote / worker dies with this process
    return env


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker exited (status unknown)"
    if exitcode < 0:
        try:
            return f"worker killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"worker killed by signal {-exitcode}"
    return f"worker exited with code {exitcode}"


class _Zygote:
    """A warm interpreter that forks workers (see `megarl.rewards._worker`)."""

    def __init__(self, start_timeout_s: float):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "megarl.rewards._worker", "--zygote", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=_worker_env(),
            )
        finally:
            child.close()
        self.sock = parent
        self.sock.settimeout(start_timeout_s)
        self.ready = False

    def _call(self, msg: bytes, fds: tuple[int, ...] = ()) -> str:
        if not self.ready:
            if self.sock.recv(64) != b"ready":
                raise OSError("reward zygote did not start")
            self.ready = True
        if fds:
            socket.send_fds(self.sock, [msg], list(fds))
        else:
            self.sock.send(msg)
        reply = self.sock.recv(64)
        if not reply:
            raise OSError("reward zygote exited")
        return reply.decode()

    def spawn(self, inbox_r: int, outbox_w: int, memory_mb: int) -> int:
        return int(self._call(f"spawn {memory_mb}".encode(), (inbox_r, outbox_w)).split()[1])

    def reap(self, pid: int) -> int:
        return int(self._call(f"reap {pid}".encode()).split()[1])

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Worker(PoolSlot):
    """One worker process: forked by the zygote, or (without one) started directly.

    inflight: the request indices sent to it and not answered, in send order.
    """

    def __init__(self, memory_mb: int, zygote: _Zygote | None):
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        self.zygote, self.proc = zygote, None
        try:
            if zygote is not None:
                self.pid = zygote.spawn(req_r, res_w, memory_mb)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "megarl.rewards._worker", str(req_r), str(res_w), str(memory_mb)],
                    pass_fds=(req_r, res_w),
                    env=_worker_env(),
                    start_new_session=True,  # see the zygote: one autogroup per worker
                )
                self.pid = self.proc.pid
        except BaseException:
            os.close(req_w)
            os.close(res_r)
            raise
        finally:
            os.close(req_r)
            os.close(res_w)
        self.outbox = Connection(req_w, readable=False)
        self.inbox = Connection(res_r, writable=False)
        super().__init__()
        self.crash_message: str | None = None
        self.status: str | None = None

    def kill(self) -> str:
        """SIGKILL (harmless if it already exited), reap, close pipes; returns how it ended."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                if self.proc is not None:
                    self.status = _describe(self.proc.wait(timeout=10))
                else:
                    st = self.zygote.reap(self.pid)
                    self.status = _describe(os.waitstatus_to_exitcode(st) if st >= 0 else None)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.status = "worker exited (status unknown)"
            for c in (self.outbox, self.inbox):
                try:
                    c.close()
                except OSError:
                    pass
        return self.status

    def death_reason(self) -> str:
        status = self.kill()
        return self.crash_message or status


def _shutdown(workers: list[_Worker | None], zygote_box: list[_Zygote | None]) -> None:
    for w in workers:
        if w is not None:
            try:
                w.outbox.send(("stop",))
            except (OSError, ValueError):
                pass
    for w in workers:
        if w is not None:
            w.kill()
    workers[:] = [None] * len(workers)
    if zygote_box[0] is not None:
        zygote_box[0].close()
        zygote_box[0] = None


class LocalRewardPool(SupervisedRewardPool):
    """Worker subprocesses with a per-item wall-clock bound and a per-worker RLIMIT_AS.

    num_workers: processes scoring in parallel. timeout_s: seconds one item may take.
    memory_mb: RLIMIT_AS of each worker (its whole address space, ~60 MiB of which is the
    idle interpreter with math-verify). chunk_size: items sent per message (pipelining).
    start_timeout_s: seconds a new worker may take to import and warm up.
    max_start_failures: start failures in a row (death or start timeout before "ready") that
    close the pool and raise. Crash / timeout policy: `megarl.rewards.pool_policy`.
    """

    start_fix = "check that `python -m megarl.rewards._worker` can import megarl and math_verify."

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        chunk_size: int = 8,
        start_timeout_s: float = 120.0,
        max_start_failures: int = 3,
        use_zygote: bool = True,
    ):
        super().__init__(num_workers, timeout_s, memory_mb, start_timeout_s, max_start_failures)
        self.chunk_size = chunk_size
        # Workers are forked on first use; the zygote warms up meanwhile.
        self._zygote: list[_Zygote | None] = [_Zygote(start_timeout_s) if use_zygote else None]
        self._slots: list[_Worker | None] = [None] * num_workers
        self._finalizer = weakref.finalize(self, _shutdown, self._slots, self._zygote)

    # -- public -----------------------------------------------------------------------------

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        if self._finalizer.alive is False:
            raise RuntimeError("LocalRewardPool.score() after close()")
        with self._lock:
            try:
                return self._score(Batch(list(requests)))
            except BaseException:
                # Interrupted (e.g. KeyboardInterrupt): drop workers holding stale items.
                for k, w in enumerate(self._slots):
                    if w is not None and w.inflight:
                        w.kill()
                        self._slots[k] = None
                raise

    def close(self) -> None:
        self._finalizer()

    # -- scheduling -------------------------------------------------------------------------

    def _score(self, batch: Batch) -> list[RewardResult]:
        for k, w in enumerate(self._slots):
            if w is None:
                self._slots[k] = self._new_slot()
        while batch.remaining:
            self._dispatch(batch)
            busy = [w for w in self._slots if w is not None and (w.inflight or not w.ready)]
            now = time.monotonic()
            deadlines = [self._deadline(w) for w in busy]
            if not deadlines:
                raise RuntimeError("LocalRewardPool: items left but no worker is busy (scheduler bug)")
            timeout = max(0.0, min(deadlines) - now)
            live = {w.inbox: w for w in self._slots if w is not None}
            for conn in wait(list(live), timeout):
                self._drain(live[conn], batch)
            now = time.monotonic()
            for w in busy:
                if w in self._slots and (w.inflight or not w.ready) and now > self._deadline(w):
                    self._expire(batch, w)
        return batch.results  # type: ignore[return-value]

    def _dispatch(self, batch: Batch) -> None:
        """Send each ready idle worker one retried item, or a chunk of pending ones."""
        pending = batch.pending
        fresh_available = any(w is not None and w.fresh for w in self._slots)
        for w in self._slots:
            if w is None or not w.ready or w.inflight:
                continue
            retry = batch.take_retry(w, fresh_available)
            if retry is not None:
                items = [retry]
            elif pending:
                k = max(1, min(self.chunk_size, len(pending) // (2 * self.num_workers)))
                items = [pending.popleft() for _ in range(min(k, len(pending)))]
            else:
                continue
            w.fresh = False
            w.inflight.extend(items)
            w.item_start = time.monotonic()
            try:
                w.outbox.send(("score", [(i, batch.requests[i]) for i in items]))
            except (OSError, ValueError):
                pass  # the worker died; its pipe reports EOF and _drain handles it

    def _drain(self, w: _Worker, batch: Batch) -> None:
        """Read every message the worker has sent; on EOF the worker died (`_died`)."""
        while True:
            try:
                if not w.inbox.poll():
                    return
                msg = w.inbox.recv()
            except (EOFError, OSError):
                self._died(w, batch)
                return
            kind = msg[0]
            if kind == "ready":
                self._started(w)
            elif kind == "failed":
                w.crash_message = f"worker failed to start: {msg[1]}"
            elif kind == "crash":
                w.crash_message = msg[2]
            elif kind == "result":
                _, index, score, extra, status = msg
                head = w.inflight.popleft()
                assert head == index, (head, index)
                self._record(batch, index, score, extra, status)
                w.item_start = time.monotonic()

    def _new_slot(self) -> _Worker:
        zygote = self._zygote[0]
        if zygote is not None:
            try:
                return _Worker(self.memory_mb, zygote)
            except (OSError, ValueError) as e:
                logger.warning("reward zygote failed (%s); starting workers directly (slower)", e)
                zygote.close()
                self._zygote[0] = None
        return _Worker(self.memory_mb, None)

    def _kill(self, w: _Worker) -> None:
        w.kill()

    def _died(self, w: _Worker, batch: Batch) -> None:
        reason = w.death_reason()
        if not w.ready:
            self._start_failed(w, reason)
        else:
            self._crashed(batch, w, reason)
