"""A rollout worker: keeps one engine full with the coordinator's requests and streams each
finished sample back the step it finishes (docs/design.md, "The request and sample streams").

Messages on its `megarl.rollout.channel.Channel`:

    coordinator -> worker   ("request", {"id": any, "prompt": [ids], "prompt_key": int,
                                          "seed": int, "n": int, "max_new_tokens": int})
                            ("stop", None)
    worker -> coordinator   ("samples", {"ids": [request id per completion], "completions":
                                          flat arrays (`completion_arrays.pack_completions`),
                                          "step": the engine step they finished at})
                            ("heartbeat", {"step": int, "in_flight": int})   when idle or
                                          every ``heartbeat_s`` while decoding
                            ("error", "traceback text")   then the worker ends

A request joins the running batch at the next step with a free slot (`GenerationSession`); the
worker reads new requests between decode steps without waiting while it has work; idle, it
sends a heartbeat every ``heartbeat_s`` and ends after ``idle_timeout_s`` without a request.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from megarl.rollout.channel import Channel, ChannelError, connect
from megarl.rollout.completion_arrays import pack_completions, to_wire
from megarl.rollout.protocol import SamplingParams


class RolloutWorker:
    """Serves ``channel``'s requests on ``engine`` (an engine with ``open_session``) with the
    shared ``sampling`` settings; ``max_len``: prompt + response tokens any request may reach."""

    def __init__(self, engine: Any, channel: Channel, sampling: SamplingParams, max_len: int,
                 *, heartbeat_s: float = 5.0, idle_timeout_s: float = 1800.0) -> None:
        self.engine, self.channel = engine, channel
        self.session = engine.open_session(sampling, max_len)
        self.heartbeat_s, self.idle_timeout_s = heartbeat_s, idle_timeout_s
        self.owner: dict[int, list] = {}  # session request id -> [coordinator's id, samples left]
        self.steps = 0

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
            wait = 0.0 if self.session.busy else self.heartbeat_s
            while self.channel.poll(wait):
                kind, payload = self.channel.recv("a request")
                if kind == "stop":
                    return
                if kind != "request":
                    raise ValueError(f"rollout worker: unknown message {kind!r}")
                self._submit(payload)
                wait = 0.0
            if not self.session.busy:
                if time.monotonic() - idle_since > self.idle_timeout_s:
                    raise ChannelError(f"{self.channel.peer} sent no request for "
                                       f"{self.idle_timeout_s:g} s")
                self.channel.send("heartbeat", {"step": self.steps, "in_flight": 0})
                last_beat = time.monotonic()
                continue
            idle_since = time.monotonic()
            done = self.session.step()
            self.steps += 1
            if done:
                ids = [self._returned(c.prompt_index) for c in done]
                self.channel.send("samples", {"ids": ids, "step": self.steps,
                                              "completions": to_wire(pack_completions(done))})
            elif time.monotonic() - last_beat >= self.heartbeat_s:
                self.channel.send("heartbeat", {"step": self.steps,
                                                "in_flight": len(self.owner)})
                last_beat = time.monotonic()

    def _submit(self, req: dict[str, Any]) -> None:
        n = int(req.get("n", 1))
        rid = self.session.submit(req["prompt"], prompt_key=int(req["prompt_key"]),
                                  seed=int(req["seed"]), n=n,
                                  max_new_tokens=req.get("max_new_tokens"))
        self.owner[rid] = [req["id"], n]

    def _returned(self, rid: int) -> Any:
        """The coordinator's id of a completion of request ``rid`` (forgotten after its
        last sample)."""
        entry = self.owner[rid]
        entry[1] -= 1
        if entry[1] == 0:
            del self.owner[rid]
        return entry[0]


def worker_main(model_path: str, host: str, port: int, authkey: bytes, sampling: SamplingParams,
                max_len: int, engine_kwargs: dict[str, Any] | None = None,
                name: str = "rollout worker", timeout_s: float = 1800.0) -> None:
    """A rollout worker process: megarl's torch engine on ``model_path`` (``engine_kwargs``:
    `TorchRolloutEngine.from_pretrained`'s), connected to the coordinator at ``host:port``."""
    import torch

    from megarl.rollout.torch import TorchRolloutEngine

    torch.set_num_threads(1)
    engine = TorchRolloutEngine.from_pretrained(model_path, **(engine_kwargs or {}))
    channel = connect(host, port, authkey, "the coordinator", timeout_s=timeout_s)
    channel.send("hello", {"name": name})
    try:
        RolloutWorker(engine, channel, sampling, max_len, idle_timeout_s=timeout_s).serve()
    finally:
        channel.close()
