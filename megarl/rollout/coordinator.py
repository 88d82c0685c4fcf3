"""The coordinator: the trainer's side of the request and sample streams (docs/design.md,
"The request and sample streams", "Failure handling").

It hands prompts to the rollout workers (`megarl.rollout.worker`) so that each keeps up to
``capacity`` sequences in flight, files each finished sample under its prompt, and gives the
prompts whose n samples are all back in the order they completed:

    coord = Coordinator(channels, capacity=64)
    coord.add(PromptRequest(key, prompt_ids, seed, n, max_new_tokens) for ...)
    ready = coord.take(ppo_mini_batch_size * require_batches, timeout_s=...)

A worker that fails (its connection closes, it reports an error, or it is silent for
``timeout_s``) is dropped with a warning naming it and the cause; its prompts in flight go back
to the queue whole (their samples already returned are dropped: a sample's noise is keyed by
(seed, prompt key, sample, position), so on the same weights the regenerated samples are the
same) and are handed to the others. With no worker left, the wait fails naming the last cause.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from megarl.rollout.channel import Channel, ChannelError
from megarl.rollout.completion_arrays import unpack_completions
from megarl.rollout.protocol import Completion

logger = logging.getLogger(__name__)


@dataclass
class PromptRequest:
    """One prompt's n samples: ``key`` names the prompt (its noise key, and how the caller
    finds it again); ``max_new_tokens``: each sample's response budget."""

    key: int
    prompt: list[int]
    seed: int
    n: int = 1
    max_new_tokens: int | None = None
    samples: list[Completion] = field(default_factory=list, repr=False)


class Coordinator:
    """Keeps ``channels``' workers full (``capacity`` sequences in flight each) and collects
    their samples (module doc). ``timeout_s``: how long a worker with work may stay silent."""

    def __init__(self, channels: list[Channel], *, capacity: int, timeout_s: float = 1800.0,
                 warn: Callable[[str], None] = logger.warning) -> None:
        if not channels:
            raise ValueError("the coordinator needs at least one rollout worker")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.live = list(channels)
        self.capacity, self.timeout_s, self.warn = capacity, timeout_s, warn
        self.queue: deque[PromptRequest] = deque()
        self.in_flight: dict[Channel, dict[int, PromptRequest]] = {c: {} for c in channels}
        self.heard: dict[Channel, float] = {c: time.monotonic() for c in channels}
        self.ready: deque[PromptRequest] = deque()
        self.last_cause = ""

    def add(self, requests: Iterable[PromptRequest]) -> None:
        """Queue prompts (handed out in this order)."""
        for r in requests:
            if r.n < 1:
                raise ValueError(f"prompt {r.key}: n must be >= 1")
            self.queue.append(r)

    @property
    def pending(self) -> int:
        """Prompts queued or in flight (not yet ready)."""
        return len(self.queue) + sum(len(m) for m in self.in_flight.values())

    def take(self, count: int, timeout_s: float | None = None) -> list[PromptRequest]:
        """The first ``count`` prompts whose samples are all back (each with ``samples``, in
        sample order), waiting for them; fails if fewer are queued or in flight."""
        if count > len(self.ready) + self.pending:
            raise ValueError(f"take({count}): only {len(self.ready) + self.pending} prompts "
                             "were added and not taken")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self.ready) < count:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ChannelError(f"{len(self.ready)} of {count} prompts ready after "
                                   f"{timeout_s:g} s")
            self.pump(min(self.timeout_s, 1.0 if left is None else left))
        return [self.ready.popleft() for _ in range(count)]

    def pump(self, wait_s: float) -> None:
        """Hand out queued prompts, then read what the workers sent within ``wait_s``."""
        self._dispatch()
        if not self.live:
            raise ChannelError(f"no rollout worker is left (the last: {self.last_cause})")
        now = time.monotonic()
        for ch in list(self.live):
            if self.in_flight[ch] and now - self.heard[ch] > self.timeout_s:
                self._drop(ch, f"{ch.peer} sent nothing for {self.timeout_s:g} s with "
                               f"{len(self.in_flight[ch])} prompts in flight")
        conns = {ch.conn: ch for ch in self.live}
        for conn in wait(list(conns), timeout=wait_s):
            ch = conns[conn]
            try:
                while ch.poll(0):
                    self._receive(ch, *ch.recv("a message"))
            except ChannelError as e:
                self._drop(ch, str(e))

    def close(self) -> None:
        """Tell every live worker to stop."""
        for ch in self.live:
            try:
                ch.send("stop")
            except ChannelError:
                pass

    # ------------------------------------------------------------------ internals
    def _load(self, ch: Channel) -> int:
        return sum(r.n - len(r.samples) for r in self.in_flight[ch].values())

    def _dispatch(self) -> None:
        while self.queue and self.live:
            ch = min(self.live, key=self._load)
            if self._load(ch) >= self.capacity:
                return
            r = self.queue.popleft()
            try:
                ch.send("request", {"id": r.key, "prompt": r.prompt, "prompt_key": r.key,
                                    "seed": r.seed, "n": r.n,
                                    "max_new_tokens": r.max_new_tokens})
            except ChannelError as e:
                self.queue.appendleft(r)
                self._drop(ch, str(e))
                continue
            self.in_flight[ch][r.key] = r
            self.heard[ch] = time.monotonic()

    def _receive(self, ch: Channel, kind: str, payload: Any) -> None:
        self.heard[ch] = time.monotonic()
        if kind == "error":
            raise ChannelError(f"{ch.peer} failed: {str(payload).strip().splitlines()[-1]}")
        if kind != "samples":
            return  # heartbeats, hello
        for key, c in zip(payload["ids"], unpack_completions(payload["completions"])):
            r = self.in_flight[ch][key]
            r.samples.append(c)
            if len(r.samples) == r.n:
                del self.in_flight[ch][key]
                self.ready.append(r)

    def _drop(self, ch: Channel, cause: str) -> None:
        if ch not in self.live:
            return
        self.live.remove(ch)
        back = list(self.in_flight.pop(ch).values())
        for r in reversed(back):  # back to the queue's front, in their order
            r.samples.clear()
            self.queue.appendleft(r)
        self.last_cause = cause
        self.warn(f"rollout worker dropped: {cause}; {len(back)} prompts in flight go to the "
                  f"{len(self.live)} others")
        try:
            ch.close()
        except OSError:
            pass
