"""A rollout worker: keeps one engine full with the coordinator's requests and streams each
finished sample back the step it finishes (docs/design.md, "The request and sample streams").

Messages on its `megarl.rollout.channel.Channel`:

    coordinator -> worker   ("request", {"id": any, "prompt": [ids], "prompt_key": int,
                                          "seed": int, "n": int, "max_new_tokens": int})
                            ("weights_bucket", header)   then the bucket's broadcast on the
                                          weight group (`megarl.rollout.weight_stream`)
                            ("weights_end", {"version": int, "digest": bool})
                            ("regroup", {"rank": int, "size": int, "generation": int})   the
                                          weight group forms again without a lost member
                            ("generate", {"id": any, "prompts": [[ids]], "prompt_keys": [int],
                                          "sampling": SamplingParams})
                            ("stop", None)
    worker -> coordinator   ("hello", {"name": str, "dtype": str})   first
                            ("group_ready", None)   then, with a weight group: it has joined
                            ("samples", {"ids": [request id per completion], "completions":
                                          flat arrays (`completion_arrays.pack_completions`,
                                          each with the version that sampled it),
                                          "step": the engine step they finished at,
                                          "busy_s": seconds the worker has computed so far})
                            ("weights_loaded", {"version": int, "digests": {name: sha256} or
                                          None})
                            ("generated", {"id": any, "completions": flat arrays})
                            ("heartbeat", {"step": int, "busy_s": float, "in_flight": int})
                                          when idle or
                                          every ``heartbeat_s`` while decoding
                            ("error", "traceback text")   then the worker ends

A request joins the running batch at the next step with a free slot (`GenerationSession`); the
worker reads new requests between decode steps without waiting while it has work; idle, it
sends a heartbeat every ``heartbeat_s`` and ends after ``idle_timeout_s`` without a request.

New weights arrive between two decode steps: the buckets are staged at once (the trainer
waits on their broadcast), then

- ``async_training.partial_rollout=false`` (verl's default): applied when the requests already
  submitted have finished, so every sample comes whole from one version; requests that arrive
  meanwhile wait and run on the new version;
- ``partial_rollout=true``: applied at the next step boundary; the running sequences go on
  under them with their KV cache recomputed (`GenerationSession.weights_changed`), so a sample
  may span versions: each token carries the version that sampled it (``token_versions``), its
  ``policy_version`` is its first token's.

A "generate" call (validation, greedy baselines) waits for the running requests to finish and
runs on the weights its message follows.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from typing import Any

from megarl.rollout.channel import Channel, ChannelError, connect
from megarl.rollout.completion_arrays import pack_completions, to_wire
from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.weight_stream import WeightGroup, receive_bucket, tensor_digest


class RolloutWorker:
    """Serves ``channel``'s requests on ``engine`` (an engine with ``open_session``) with the
    shared ``sampling`` settings; ``max_len``: prompt + response tokens any request may reach.
    ``group``: the weight group new weights arrive on (None: the weights never change);
    ``version``: the version of the engine's weights at the start; ``partial_rollout``: new
    weights apply at the next step, running requests go on under them (module doc)."""

    def __init__(self, engine: Any, channel: Channel, sampling: SamplingParams, max_len: int,
                 *, heartbeat_s: float = 5.0, idle_timeout_s: float = 1800.0,
                 group: WeightGroup | None = None, version: int = 0,
                 partial_rollout: bool = False) -> None:
        self.engine, self.channel, self.group = engine, channel, group
        self.session = engine.open_session(sampling, max_len, version=version)
        self.partial_rollout = partial_rollout
        self.heartbeat_s, self.idle_timeout_s = heartbeat_s, idle_timeout_s
        self.owner: dict[int, list] = {}  # session request id -> [coordinator's id, left]
        self.steps = 0
        self.busy_s = 0.0  # seconds spent decoding and applying weights / generations
        self.version = version
        self.staged: list = []  # (name, tensor) of the weights being received
        self.barriers: deque = deque()  # ("swap", version, digest) / ("generate", payload)
        self.held: deque = deque()  # requests that arrived behind a barrier

    def serve(self) -> None:
        """Until the coordinator says stop (or goes away: ChannelError). A failure of the
        engine is sent as ("error", traceback) before it propagates."""
        try:
            self._serve()
        except Exception:
            try:
                self.channel.send("error", traceback.format_exc())
            finally:
                raise

    def _serve(self) -> None:
        last_beat = idle_since = time.monotonic()
        while True:
            wait = 0.0 if self.session.busy or self.barriers else self.heartbeat_s
            while self.channel.poll(wait):
                kind, payload = self.channel.recv("a request")
                if kind == "stop":
                    return
                self._handle(kind, payload)
                wait = 0.0
            if self.barriers and self._barrier_open():
                t0 = time.monotonic()
                self._pass_barriers()
                self.busy_s += time.monotonic() - t0
                continue
            if not self.session.busy:
                if time.monotonic() - idle_since > self.idle_timeout_s:
                    raise ChannelError(f"{self.channel.peer} sent no request for "
                                       f"{self.idle_timeout_s:g} s")
                self.channel.send("heartbeat", {"step": self.steps, "busy_s": self.busy_s,
                                                "in_flight": 0})
                last_beat = time.monotonic()
                continue
            idle_since = time.monotonic()
            done = self.session.step()
            self.busy_s += time.monotonic() - idle_since
            self.steps += 1
            if done:
                ids = [self._returned(c) for c in done]
                self.channel.send("samples", {"ids": ids, "step": self.steps,
                                              "busy_s": self.busy_s,
                                              "completions": to_wire(pack_completions(done))})
            elif time.monotonic() - last_beat >= self.heartbeat_s:
                self.channel.send("heartbeat", {"step": self.steps, "busy_s": self.busy_s,
                                                "in_flight": len(self.owner)})
                last_beat = time.monotonic()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "request":
            if self.barriers:
                self.held.append(payload)
            else:
                self._submit(payload)
        elif kind == "weights_bucket":
            if self.group is None:
                raise ValueError("rollout worker: weights sent, but it has no weight group")
            self.staged += receive_bucket(self.group, payload)
        elif kind == "weights_end":
            self.barriers.append(("swap", int(payload["version"]), bool(payload["digest"])))
        elif kind == "generate":
            self.barriers.append(("generate", payload))
        elif kind == "regroup":  # a member was lost: the group forms again without it
            self.group.reform(int(payload["rank"]), int(payload["size"]),
                              int(payload["generation"]))
            self.channel.send("group_ready", None)
        else:
            raise ValueError(f"rollout worker: unknown message {kind!r}")

    def _barrier_open(self) -> bool:
        """Whether the first barrier may pass now: with the session empty, or new weights
        under a partial rollout (running requests go on under them)."""
        return not self.session.busy or (self.partial_rollout and self.barriers[0][0] == "swap")

    def _pass_barriers(self) -> None:
        """Apply staged weights and run whole-batch generations, in the order they came, while
        each may pass (`_barrier_open`); then, with none left, submit the requests held
        behind them."""
        while self.barriers and self._barrier_open():
            barrier = self.barriers.popleft()
            if barrier[0] == "swap":
                _, version, digest = barrier
                staged, self.staged = self.staged, []
                self.engine.update_weights(staged)
                self.session.weights_changed(version)
                self.version = version
                self.channel.send("weights_loaded", {
                    "version": version, "digests": self._digests() if digest else None})
            else:
                job = barrier[1]
                done = self.engine.generate(job["prompts"], job["sampling"],
                                            prompt_keys=job["prompt_keys"])
                for c in done:
                    c.policy_version = self.version
                self.channel.send("generated", {"id": job["id"],
                                                "completions": to_wire(pack_completions(done))})
        while self.held and not self.barriers:
            self._submit(self.held.popleft())

    def _digests(self) -> dict[str, str]:
        """sha256 of every tensor of the engine's model, by HF name."""
        return {name: tensor_digest(t) for name, t in self.engine.model.state_dict().items()}

    def _submit(self, req: dict[str, Any]) -> None:
        n = int(req.get("n", 1))
        rid = self.session.submit(req["prompt"], prompt_key=int(req["prompt_key"]),
                                  seed=int(req["seed"]), n=n,
                                  max_new_tokens=req.get("max_new_tokens"))
        self.owner[rid] = [req["id"], n]

    def _returned(self, c: Completion) -> Any:
        """The coordinator's id of completion ``c`` (stamped with the version that sampled
        its first token); a request is forgotten after its last sample."""
        entry = self.owner[c.prompt_index]
        c.policy_version = c.token_versions[0]
        entry[1] -= 1
        if entry[1] == 0:
            del self.owner[c.prompt_index]
        return entry[0]


def worker_main(spec: Any, host: str, port: int, authkey: bytes, sampling: SamplingParams,
                max_len: int, engine_kwargs: dict[str, Any] | None = None,
                name: str = "rollout worker", timeout_s: float = 1800.0,
                group: tuple[int, int, int] | None = None,
                kv_fraction: float | None = None, partial_rollout: bool = False) -> None:
    """A rollout worker process: the engine of ``spec`` (a `megarl.rollout.build.EngineSpec`,
    or a model folder for megarl's torch engine with ``engine_kwargs``:
    `TorchRolloutEngine.from_pretrained`'s), connected to the coordinator at ``host:port``.
    ``group``: (store port, rank, size) of the weight group on ``host``. ``kv_fraction``: the
    share of its GPU's free memory the KV cache of megarl's engine takes, measured here.
    ``partial_rollout``: `RolloutWorker`'s. Dies with the process that started it."""
    import torch

    from megarl.utils.lifetime import die_with_parent

    die_with_parent()
    torch.set_num_threads(1)
    engine = _build_engine(spec, engine_kwargs, kv_fraction)
    channel = connect(host, port, authkey, "the coordinator", timeout_s=timeout_s)
    channel.send("hello", {"name": name, "dtype": str(engine.dtype)})
    weights = None
    try:
        if group is not None:
            store_port, rank, size = group
            weights = WeightGroup.join(host, store_port, rank, size, engine.device, timeout_s)
            channel.send("group_ready", None)
        RolloutWorker(engine, channel, sampling, max_len, idle_timeout_s=timeout_s,
                      group=weights, partial_rollout=partial_rollout).serve()
    finally:
        channel.close()


def _build_engine(spec: Any, engine_kwargs: dict[str, Any] | None,
                  kv_fraction: float | None) -> Any:
    if isinstance(spec, str):
        from megarl.rollout.torch import TorchRolloutEngine

        return TorchRolloutEngine.from_pretrained(spec, **(engine_kwargs or {}))
    import dataclasses

    from megarl.rollout.build import engine_from_spec
    from megarl.rollout.engine_process import enter_engine_env, pin_process
    from megarl.rollout.memory import device_memory

    device = enter_engine_env(spec)
    pin_process(spec.cpus, spec.threads)
    if kv_fraction is not None and "kv_cache_bytes" in spec.settings:
        free, _ = device_memory(device)
        spec = dataclasses.replace(spec, settings={**spec.settings,
                                                   "kv_cache_bytes": int(kv_fraction * free)})
    return engine_from_spec(spec, device)
