"""What both reward pools do when a worker fails to start, dies or runs out of time.

The policy, one place for the `local` pool (worker subprocesses, `megarl.rewards.local_pool`)
and the `ray` pool (Ray actors, `megarl.rewards.ray_pool`); each pool keeps its transport (how a
worker is spawned, killed and watched) and calls into this:

- an item whose worker dies is retried once, on a fresh worker (one never sent an item) where
  there is one (`Batch.take_retry`); a second death scores it 0 with status "error" and
  {"error": "<reason> (after one retry)"}; the local pool sends a retried item alone;
- an item still running `timeout_s` seconds after the previous item of its worker finished (or
  after the send) has its worker killed and replaced, and scores 0 with status "timeout";
- the other items a dead or killed worker held go back to the front of the queue, in their
  order, so results never depend on the number of workers;
- a worker that dies before it is ready, or is not ready `start_timeout_s` seconds after its
  spawn, is a start failure and is replaced; `max_start_failures` of them in a row close the
  pool and raise RuntimeError.

`stats` counts (see `RewardPool`): reward/errors and reward/timeouts (one per such result, the
worker's own ones included), reward/crash_retries (one per retried item), reward/worker_restarts
(one per replaced worker).
"""

from __future__ import annotations

import abc
import threading
import time
from collections import deque
from typing import Any

from megarl.rewards.pool import RewardPool, RewardRequest, RewardResult, Status


class Batch:
    """The bookkeeping of one `score()` call over n requests.

    results: one slot per request index, None until scored. pending: indices not yet sent, in
    order. retries: indices whose worker died once, waiting for a worker. crashes: worker deaths
    per index. remaining: results still missing.
    """

    def __init__(self, requests: list[RewardRequest]):
        n = len(requests)
        self.requests = requests
        self.results: list[RewardResult | None] = [None] * n
        self.pending: deque[int] = deque(range(n))
        self.retries: deque[int] = deque()
        self.crashes = [0] * n
        self.remaining = n

    def take_retry(self, slot: PoolSlot, fresh_available: bool) -> int | None:
        """The next retried index for `slot`, if any: retries go to a fresh worker (one never
        sent an item) and to any other only while no fresh one is there."""
        if self.retries and (slot.fresh or not fresh_available):
            return self.retries.popleft()
        return None


class PoolSlot:
    """What the scheduler knows of one worker (a process or an actor).

    started: `time.monotonic()` at spawn (s). ready: it finished its warm-up. fresh: it was never
    sent an item. inflight: what it was sent and has not answered, in send order (one entry per
    request index; see `indices`). item_start: `time.monotonic()` when its head item started (s):
    at the send, or when the item before it finished.
    """

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.ready = False
        self.fresh = True
        self.inflight: deque[Any] = deque()
        self.item_start = 0.0

    def indices(self) -> list[int]:
        """The request indices in flight, head first (entries are indices unless overridden)."""
        return list(self.inflight)


class SupervisedRewardPool(RewardPool):
    """A `RewardPool` whose workers sit in `_slots` and are replaced when they fail.

    Subclasses give the transport: `_new_slot` (spawn) and `_kill` (kill, harmless if dead),
    `worker_noun` and `start_fix` for the messages; they call `_started`, `_record`, `_crashed`,
    `_expire` and `_start_failed` from their scheduler.
    """

    _slots: list[Any]
    worker_noun = "worker"  # how messages name one worker
    start_fix = "check that the workers can import megarl and math_verify."  # after "Fix: ..."

    def __init__(self, num_workers: int, timeout_s: float, memory_mb: int,
                 start_timeout_s: float, max_start_failures: int) -> None:
        super().__init__()
        self.num_workers, self.timeout_s, self.memory_mb = num_workers, timeout_s, memory_mb
        self.start_timeout_s, self.max_start_failures = start_timeout_s, max_start_failures
        self._start_failures = 0
        self._lock = threading.Lock()

    @abc.abstractmethod
    def _new_slot(self) -> PoolSlot:
        """Spawn a worker (it warms up in the background)."""

    @abc.abstractmethod
    def _kill(self, slot: PoolSlot) -> None:
        """Kill the worker; harmless if it already exited."""

    def _deadline(self, slot: PoolSlot) -> float:
        """`time.monotonic()` (s) past which the slot's warm-up or head item has taken too long."""
        if not slot.ready:
            return slot.started + self.start_timeout_s
        return slot.item_start + self.timeout_s

    def _replace(self, slot: PoolSlot) -> None:
        self._kill(slot)
        self._slots[self._slots.index(slot)] = self._new_slot()
        self.stats["reward/worker_restarts"] += 1

    def _started(self, slot: PoolSlot) -> None:
        """The worker finished its warm-up: the run of start failures ends."""
        slot.ready = True
        self._start_failures = 0

    def _start_failed(self, slot: PoolSlot, reason: str) -> None:
        """The worker died or hung before it was ready: replace it, or after
        `max_start_failures` such failures in a row close the pool and raise RuntimeError."""
        self._start_failures += 1
        if self._start_failures >= self.max_start_failures:
            self.close()
            raise RuntimeError(
                f"reward {self.worker_noun}s failed to start {self._start_failures} times in a row "
                f"({reason}). Fix: raise reward_model.memory_mb (now {self.memory_mb}) or "
                f"{self.start_fix}"
            )
        self._replace(slot)

    def _record(self, batch: Batch, index: int, score: float, extra: dict[str, Any],
                status: Status) -> None:
        """A worker's answer for request `index`."""
        batch.results[index] = RewardResult(float(score), extra, status)
        self._count_status(status)
        batch.remaining -= 1

    def _crashed(self, batch: Batch, slot: PoolSlot, reason: str) -> None:
        """The ready worker died (`reason`: how): its head item is retried once, then scores 0
        with status "error"; the rest of its items go back to the queue; it is replaced."""
        indices = slot.indices()
        slot.inflight.clear()
        if indices:
            head = indices[0]
            batch.crashes[head] += 1
            if batch.crashes[head] >= 2:
                error = {"error": f"{reason} (after one retry)"}
                batch.results[head] = RewardResult(0.0, error, "error")
                self.stats["reward/errors"] += 1
                batch.remaining -= 1
            else:
                batch.retries.append(head)
                self.stats["reward/crash_retries"] += 1
            batch.pending.extendleft(reversed(indices[1:]))
        self._replace(slot)

    def _expire(self, batch: Batch, slot: PoolSlot) -> None:
        """The slot is past its `_deadline`: a start failure if it is not ready, else its head
        item scores 0 with status "timeout", the rest go back to the queue, it is replaced."""
        if not slot.ready:
            self._start_failed(slot, f"{self.worker_noun} did not start within "
                                     f"{self.start_timeout_s} s")
            return
        indices = slot.indices()
        slot.inflight.clear()
        error = {"error": f"timed out after {self.timeout_s} s"}
        batch.results[indices[0]] = RewardResult(0.0, error, "timeout")
        self.stats["reward/timeouts"] += 1
        batch.remaining -= 1
        batch.pending.extendleft(reversed(indices[1:]))
        self._replace(slot)
