"""The rollout workers of a disaggregated run, seen from the trainer (docs/design.md,
"Placement: two worlds in one job").

Trainer rank 0 starts ``count`` worker processes on its node (`megarl.rollout.worker`, each one
engine on its own device or CPUs, each dying with the trainer), accepts their control channels,
forms the weight group with them and keeps a `Coordinator` over them. The pool is also the
run's `RolloutEngine` for whole-list generations (validation, greedy baselines) and for weight
publishes, so the trainer's code paths that take an engine work unchanged; on the other trainer
ranks it holds nothing: their share of a generation is rank 0's (the trainer runs them with the
whole world as one engine group), and they only take part in the export of the weights.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.rollout.build import EngineSpec
from megarl.rollout.channel import ChannelError, ChannelListener
from megarl.rollout.coordinator import Coordinator
from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.reshard import as_named
from megarl.rollout.weight_stream import WeightGroup, wire_dtype
from megarl.rollout.worker import worker_main

log = logging.getLogger(__name__)


@dataclass
class WorkerPlacement:
    """Where the workers run: one EngineSpec each (its device or CPUs set), the node's address
    the workers reach the trainer at, and the sampling settings of the training rollout."""

    specs: list[EngineSpec]
    sampling: SamplingParams
    max_len: int
    capacity: int  # sequences in flight per worker
    timeout_s: float
    host: str = "127.0.0.1"
    # on a GPU: the share of its free memory a worker's KV cache takes (measured there)
    kv_fraction: float | None = None
    # running requests go on under new weights (async_training.partial_rollout)
    partial_rollout: bool = False


class WorkerPool:
    """``placement``'s workers, started by the rank given ``placement`` (None on the other
    ranks: module doc). ``device``: the trainer rank's device (the weight group's there)."""

    def __init__(self, placement: WorkerPlacement | None, device: torch.device, *,
                 bucket_bytes: int, check_digest: bool) -> None:
        self.placement = placement
        self.bucket_bytes, self.check_digest = int(bucket_bytes), check_digest
        self.procs: list[Any] = []
        self.coord: Coordinator | None = None
        self.group: WeightGroup | None = None
        self.last_sync_bytes = 0
        self._latest: int | None = None
        if placement is not None:
            try:
                self._start(placement, device)
            except BaseException:
                self.close()
                raise

    def _start(self, p: WorkerPlacement, device: torch.device) -> None:
        key = secrets.token_bytes(32)
        listener = ChannelListener(key, host=p.host)
        count = len(p.specs)
        self.group = WeightGroup.listen(count + 1, device, p.timeout_s, host=p.host)
        ctx = mp.get_context("spawn")
        for i, spec in enumerate(p.specs):
            proc = ctx.Process(
                target=worker_main, daemon=True, name=f"megarl-rollout-worker-{i}",
                args=(spec, listener.host, listener.port, key, p.sampling, p.max_len, None,
                      f"rollout worker {i}", p.timeout_s, (self.group.port, i + 1, count + 1),
                      p.kv_fraction, p.partial_rollout))
            proc.start()
            self.procs.append(proc)
        channels, dtypes = [], set()
        try:
            for i in range(count):
                ch = listener.accept(f"rollout worker {i} (pid {self.procs[i].pid})",
                                     timeout_s=p.timeout_s)
                kind, hello = ch.recv("its hello (its engine built)", timeout_s=p.timeout_s)
                ch.peer = f"{hello['name']} (pid {self.procs[i].pid})"
                dtypes.add(hello["dtype"])
                channels.append(ch)
        finally:
            listener.close()
        self.group.form()
        for ch in channels:  # every member formed (not only this end): none waits on another
            kind, _ = ch.recv("its place in the weight group", timeout_s=p.timeout_s)
            if kind != "group_ready":
                raise ChannelError(f"{ch.peer} sent {kind!r} instead of joining the weight group")
        if len(dtypes) != 1:
            raise ChannelError(f"the rollout workers hold their weights in different dtypes "
                               f"({sorted(dtypes)}); they are built from one spec")
        self.engine_dtype = wire_dtype(dtypes.pop())  # what the weights are cast to and sent in
        self.coord = Coordinator(channels, capacity=p.capacity, timeout_s=p.timeout_s,
                                 group=self.group)
        log.info("rollout workers: %d started (pids %s)", count, [q.pid for q in self.procs])

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_keys: Sequence[int] | None = None) -> list[Completion]:
        """Rank 0: ``prompts`` on the workers' current weights; other ranks: nothing."""
        if self.coord is None:
            return []
        keys = list(range(len(prompts))) if prompt_keys is None else [int(k) for k in prompt_keys]
        return self.coord.generate(prompts, sampling, keys, timeout_s=self.placement.timeout_s)

    def update_weights(self, weights: Iterable[Any], version: int | None = None) -> None:
        """Publish ``weights`` (the actor's export stream: collective, every rank consumes it)
        as ``version`` (default: the last + 1, 0 at first)."""
        if version is None:
            version = 0 if self._latest is None else self._latest + 1
        named = as_named(weights)
        if self.coord is None:
            for _ in named:
                pass
        else:
            sent = self.coord.publish(named, version, self.bucket_bytes, self.engine_dtype,
                                      self.check_digest)
            self.last_sync_bytes = sent.nbytes
        self._latest = version

    @property
    def latest_version(self) -> int | None:
        return self._latest

    def sleep(self) -> None:
        """No-op: the workers' memory is their own."""

    def wake(self) -> None:
        """No-op (see sleep)."""

    @property
    def asleep(self) -> bool:
        return False

    def close(self) -> None:
        """Stop the workers (each dies with the trainer anyway)."""
        if self.coord is not None:
            self.coord.close()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self.procs = []
        self.coord = None
        if self.group is not None:
            self.group.close()
            self.group = None

