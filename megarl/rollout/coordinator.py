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

New weights go to every worker at once (`publish`, over the weight group of
`megarl.rollout.weight_stream`); each worker applies them once its submitted requests are done
and says so, with a digest of its engine's tensors when asked for one, which is checked against
what was sent. `generate` runs a whole list of prompts (validation, greedy baselines) on the
workers' current weights, dealt round-robin. After a worker was dropped, the next publish
first forms the weight group again with the live workers (`regroup`).
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
from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.weight_stream import Sent, WeightGroup, check_digests, send_weights

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
                 warn: Callable[[str], None] = logger.warning,
                 group: WeightGroup | None = None) -> None:
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
        self.group = group  # the weight group (rank 0 here), for `publish`
        self.dropped: list[str] = []  # causes, in order
        self.versions: dict[Channel, int] = {c: 0 for c in channels}  # weights each one runs
        self.sent: dict[int, Sent] = {}  # version -> what its publish sent (digests checked)
        self.busy_s: dict[Channel, float] = {}  # seconds each worker has computed so far
        self._formed: set[Channel] = set()  # workers that joined the group's last forming
        self._jobs: dict[int, dict] = {}  # generate job id -> its parts and results
        self._next_job = 0

    def add(self, requests: Iterable[PromptRequest]) -> None:
        """Queue prompts (handed out in this order, at once to the workers with room)."""
        for r in requests:
            if r.n < 1:
                raise ValueError(f"prompt {r.key}: n must be >= 1")
            self.queue.append(r)
        self._dispatch()

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
            busy = self.in_flight[ch] or any(
                ch is owner and part not in job["done"]
                for job in self._jobs.values() for part, owner in job["owner"].items())
            if busy and now - self.heard[ch] > self.timeout_s:
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

    def publish(self, named: Any, version: int, bucket_bytes: int,
                engine_dtype: Any = None, digest: bool = False) -> Sent:
        """Stream new weights (version ``version``, cast to ``engine_dtype``) to every worker
        over the weight group; with ``digest`` each worker's digests are checked when it
        reports the load."""
        if self.group is None:
            raise RuntimeError("Coordinator.publish needs the weight group (group=)")
        self.pump(0)  # a worker that died since the last read is dropped before the broadcast
        if self.group.size != len(self.live) + 1:
            self.regroup()
        sent = send_weights(self.group, list(self.live), named, version, bucket_bytes,
                            engine_dtype, digest)
        # a worker reports a load once its running requests end: keep a few versions' digests
        self.sent = {v: s for v, s in self.sent.items() if v >= version - 4}
        self.sent[version] = sent
        return sent

    def regroup(self) -> None:
        """Form the weight group again with the live workers only (after a loss)."""
        if not self.live:
            raise ChannelError(f"no rollout worker is left (the last: {self.last_cause})")
        generation, size = self.group.generation + 1, len(self.live) + 1
        self._formed.clear()
        for rank, ch in enumerate(self.live, start=1):
            ch.send("regroup", {"rank": rank, "size": size, "generation": generation})
        self.group.reform(0, size, generation)
        deadline = time.monotonic() + self.timeout_s
        while set(self.live) - self._formed:  # every member formed, not only this end
            if time.monotonic() > deadline:
                raise ChannelError(f"the weight group did not form again within "
                                   f"{self.timeout_s:g} s")
            self.pump(0.1)
        self.warn(f"the weight group formed again with the {len(self.live)} live rollout "
                  f"workers (lost: {'; '.join(self.dropped)})")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_keys: list[int], timeout_s: float | None = None) -> list[Completion]:
        """``prompts``' completions on the workers' current weights (``sampling.n`` each, in
        prompt order), the prompts dealt round-robin; each worker first finishes what it runs."""
        if not prompts:
            return []
        job_id = self._next_job
        self._next_job += 1
        parts: dict[int, list[int]] = {}
        for i in range(len(prompts)):
            parts.setdefault(i % len(self.live), []).append(i)
        job = self._jobs[job_id] = {"parts": parts, "done": {}, "owner": {}}
        for part, idx in parts.items():
            self._send_part(job_id, part, idx, prompts, sampling, prompt_keys)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while len(job["done"]) < len(parts):
                if deadline is not None and time.monotonic() > deadline:
                    raise ChannelError(f"a generation of {len(prompts)} prompts on the rollout "
                                       f"workers took more than {timeout_s:g} s")
                self.pump(1.0)
                for part, ch in list(job["owner"].items()):  # a dropped worker's part: again
                    if part not in job["done"] and ch not in self.live:
                        self._send_part(job_id, part, parts[part], prompts, sampling,
                                        prompt_keys)
        finally:
            del self._jobs[job_id]
        out: list[Completion] = []
        for part, idx in sorted(parts.items()):
            for c in job["done"][part]:
                c.prompt_index = idx[c.prompt_index]
                out.append(c)
        out.sort(key=lambda c: c.prompt_index)
        return out

    def close(self) -> None:
        """Tell every live worker to stop."""
        for ch in self.live:
            try:
                ch.send("stop")
            except ChannelError:
                pass

    # ------------------------------------------------------------------ internals
    def _send_part(self, job_id: int, part: int, idx: list[int], prompts: list[list[int]],
                   sampling: SamplingParams, prompt_keys: list[int]) -> None:
        while True:
            if not self.live:
                raise ChannelError(f"no rollout worker is left (the last: {self.last_cause})")
            ch = self.live[part % len(self.live)]
            try:
                ch.send("generate", {"id": (job_id, part), "prompts": [prompts[i] for i in idx],
                                     "prompt_keys": [prompt_keys[i] for i in idx],
                                     "sampling": sampling})
            except ChannelError as e:
                self._drop(ch, str(e))
                continue
            self._jobs[job_id]["owner"][part] = ch
            self.heard[ch] = time.monotonic()
            return

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
        if kind == "group_ready":
            self._formed.add(ch)
            return
        if kind == "weights_loaded":
            version = int(payload["version"])
            self.versions[ch] = version
            if payload.get("digests") is not None and version in self.sent:
                check_digests(self.sent[version], payload["digests"], ch.peer)
            return
        if kind == "generated":
            job = self._jobs[payload["id"][0]]
            job["done"][payload["id"][1]] = unpack_completions(payload["completions"])
            return
        if isinstance(payload, dict) and "busy_s" in payload:
            self.busy_s[ch] = float(payload["busy_s"])
        if kind != "samples":
            return  # heartbeats
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
        self.dropped.append(f"{ch.peer}: {cause}")
        self.warn(f"rollout worker dropped: {cause}; {len(back)} prompts in flight go to the "
                  f"{len(self.live)} others")
        try:
            ch.close()
        except OSError:
            pass
