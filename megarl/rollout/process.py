"""`ProcessRolloutEngine`: a rollout engine in a process of its own, beside the trainer.

The trainer process keeps a proxy that speaks the `RolloutEngine` protocol plus two calls for
asynchronous rollout (`submit` / `result`); the engine itself runs in a spawned child, pinned
to its own cores with one intra-op thread, so generation overlaps the trainer's
forward/backward passes. The child hosts either megarl's `TorchRolloutEngine` or a
`VLLMEngine` (vLLM's ``LLM`` in the child, with its single-process ``uni`` executor: the child
is a world of one whatever the trainer's world, so each training rank has its own engine;
`megarl.rollout.engine_process` is the child's side).

Weights travel through a ring of ``slots`` shared-memory copies of the model (host memory,
allocated at the first publish, HF names as in the resharding stream):

    trainer: update_weights(actor.export_weights())   publish version v into slot j
             submit(prompts, sampling, keys)           the request names the newest version
    engine:  before a request starts, load the named version's slot if it is not the one
             already loaded (the only point where the engine's weights change), ack "loaded",
             generate, return completions stamped with that version.

A slot is overwritten only once every request that names the version it holds has acked its
load, so a publish never races a load and the version a request uses is fixed when it is
submitted, whatever the timing: the outputs are a function of (weights of that version,
prompts, sampling seed) only. With ``slots = staleness + 1`` the trainer never waits on that
rule (a version is loaded before the step that publishes ``staleness + 1`` versions later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from megarl.rollout.build import EngineSpec
from megarl.rollout.engine_process import completion_from_state, completion_state, engine_main
from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.reshard import as_named


class EngineProcessError(RuntimeError):
    """The engine process failed (its traceback is in the message) or died."""


@dataclass
class _Request:
    serial: int  # the publish it uses (labels may repeat; serials do not)
    loaded: bool = False
    result: list[Completion] | None = None


@dataclass(frozen=True)
class EngineSpan:
    """What the engine process did for one request, in ``time.perf_counter()`` seconds (the
    system-wide monotonic clock on Linux, comparable with the trainer's `Timer.sink`):
    ``start`` it took the request, ``generate`` it had loaded the weights and began
    generating, ``end`` it finished."""

    request: int
    version: int
    start: float
    generate: float
    end: float


class ProcessRolloutEngine:
    """Proxy of a rollout engine running in a spawned process (see the module doc).

    slots: shared weight copies (>= 1; ``staleness + 1`` lets the trainer publish without
    waiting). version_fn: the label of the next published version (default: 0 for the first
    publish, then +1 per publish); the trainer passes its step so a version names the step
    whose update produced it.
    """

    def __init__(self, spec: EngineSpec, *, slots: int = 2,
                 version_fn: Callable[[], int] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.spec = spec
        self.version_fn = version_fn
        self._ctx = mp.get_context("spawn")
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=engine_main, args=(spec, child), daemon=True,
                                       name="megarl-rollout-engine")
        self._proc.start()
        child.close()
        self._nslots = slots
        self._ring: list[dict[str, torch.Tensor]] | None = None
        self._slot_serial: list[int | None] = [None] * slots
        self._next_slot = 0
        self._serial = -1
        self._latest: tuple[int, int, int] | None = None  # (version label, slot, serial)
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._prefetched: dict[Any, int] = {}  # match key -> request id
        self._versions: dict[int, int] = {}  # request id -> version label, until done
        self.spans: deque[EngineSpan] = deque(maxlen=1024)  # the newest requests' timings
        self._closed = False

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_keys: Sequence[int] | None = None) -> list[Completion]:
        """A prefetched request with exactly these arguments is collected; any other call
        runs now on the newest published weights. Completions carry ``policy_version``."""
        rid = self._prefetched.pop(_match_key(prompts, sampling, prompt_keys), None)
        if rid is None:
            rid = self.submit(prompts, sampling, prompt_keys)
        return self.result(rid)

    def update_weights(self, weights: Iterable[Any]) -> None:
        """Publish a new version: copy the (HF name, full tensor) stream (flat or bucketed)
        into the next ring slot. Every rank must consume its whole stream (collective)."""
        version = (self.version_fn() if self.version_fn is not None
                   else (0 if self._latest is None else self._latest[0] + 1))
        slot = self._next_slot
        self._wait_slot_free(slot)
        if self._ring is None:
            self._ring = [{} for _ in range(self._nslots)]
            for name, tensor in as_named(weights):
                for ring in self._ring:
                    ring[name] = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
                self._ring[slot][name].copy_(tensor.detach())
            self._send(("ring", self._ring))
        else:
            target = self._ring[slot]
            seen = set()
            for name, tensor in as_named(weights):
                if name not in target:
                    raise ValueError(f"update_weights: {name!r} was not in the first published "
                                     "stream; every publish must carry the same tensors")
                target[name].copy_(tensor.detach())
                seen.add(name)
            if seen != set(target):
                missing = sorted(set(target) - seen)
                raise ValueError(f"update_weights: the stream lacked {missing[:4]}")
        self._serial += 1
        self._slot_serial[slot] = self._serial
        self._latest = (version, slot, self._serial)
        self._next_slot = (slot + 1) % self._nslots

    def sleep(self) -> None:
        """No-op: the engine's memory is its own process's (it keeps generating while the
        trainer trains)."""

    def wake(self) -> None:
        """No-op (see sleep)."""

    @property
    def asleep(self) -> bool:
        return False

    # ------------------------------------------------------------------ asynchronous calls
    @property
    def latest_version(self) -> int | None:
        """The version the next submitted request will use (None before the first publish)."""
        return None if self._latest is None else self._latest[0]

    def submit(self, prompts: list[list[int]], sampling: SamplingParams,
               prompt_keys: Sequence[int] | None = None) -> int:
        """Queue a generation on the newest published version; returns a request id."""
        if self._latest is None:
            raise RuntimeError("ProcessRolloutEngine: publish weights (update_weights) before "
                               "the first generation")
        version, slot, serial = self._latest
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = _Request(serial)
        self._versions[rid] = version
        keys = None if prompt_keys is None else [int(k) for k in prompt_keys]
        self._send(("gen", rid, version, slot, serial, [list(map(int, p)) for p in prompts],
                    sampling, keys))
        return rid

    def prefetch(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_keys: Sequence[int] | None = None) -> tuple:
        """`submit` now (unless an identical request is pending); a later `generate` with the
        same arguments collects it. Returns the request's match key (see `drop`)."""
        key = _match_key(prompts, sampling, prompt_keys)
        if key not in self._prefetched:
            self._prefetched[key] = self.submit(prompts, sampling, prompt_keys)
        return key

    def drop(self, key: tuple) -> bool:
        """Collect and discard the prefetched request of ``key``, if still pending."""
        rid = self._prefetched.pop(key, None)
        if rid is None:
            return False
        self.result(rid)
        return True

    def result(self, rid: int) -> list[Completion]:
        """Wait for request ``rid`` and return its completions (each stamped with the version
        that generated it)."""
        req = self._requests.get(rid)
        if req is None:
            raise KeyError(f"no pending request {rid}")
        while req.result is None:
            self._receive()
        del self._requests[rid]
        return req.result

    def pending(self) -> list[tuple[Any, int]]:
        """The prefetched requests not yet collected: (match key, request id), oldest first."""
        return sorted(self._prefetched.items(), key=lambda kv: kv[1])

    def export_prefetched(self) -> list[dict[str, Any]]:
        """Wait for every prefetched request and return them as plain data (checkpoint of the
        batches in flight); they stay collectable."""
        out = []
        for key, rid in self.pending():
            comps = self.result(rid)
            # keep it collectable: re-register the finished result under a new id
            new = self._next_id
            self._next_id += 1
            self._requests[new] = _Request(-1, loaded=True, result=comps)
            self._prefetched[key] = new
            out.append({"key": key, "completions": [completion_state(c) for c in comps]})
        return out

    def import_prefetched(self, state: list[dict[str, Any]]) -> None:
        """Register finished requests saved by `export_prefetched` (exact resume)."""
        for entry in state:
            comps = [completion_from_state(c) for c in entry["completions"]]
            rid = self._next_id
            self._next_id += 1
            self._requests[rid] = _Request(-1, loaded=True, result=comps)
            self._prefetched[_freeze(entry["key"])] = rid

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                self._conn.send(("close",))
                self._proc.join(timeout=30)
        except (BrokenPipeError, OSError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._conn.close()

    # ------------------------------------------------------------------ internals
    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as err:
            raise EngineProcessError(f"the rollout engine process is gone "
                                     f"(exit code {self._proc.exitcode})") from err

    def _receive(self) -> None:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise EngineProcessError(f"the rollout engine process died (exit code "
                                         f"{self._proc.exitcode})")
        try:
            msg = self._conn.recv()
        except EOFError as err:
            raise EngineProcessError("the rollout engine process closed its pipe") from err
        kind = msg[0]
        if kind == "error":
            raise EngineProcessError(f"the rollout engine process failed:\n{msg[1]}")
        req = self._requests[msg[1]]
        if kind == "loaded":
            req.loaded = True
        elif kind == "done":
            req.loaded = True
            req.result = [completion_from_state(c) for c in msg[2]]
            self.spans.append(EngineSpan(msg[1], self._versions.pop(msg[1], -1), *msg[3]))

    def _wait_slot_free(self, slot: int) -> None:
        held = self._slot_serial[slot]
        if held is None:
            return
        while any(r.serial == held and not r.loaded for r in self._requests.values()):
            self._receive()

    def __del__(self) -> None:  # best effort; the trainer calls close()
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------- plain-data helpers


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _match_key(prompts: list[list[int]], sampling: SamplingParams,
               prompt_keys: Sequence[int] | None) -> tuple:
    s = sampling
    return _freeze((
        [list(map(int, p)) for p in prompts],
        None if prompt_keys is None else [int(k) for k in prompt_keys],
        [s.n, s.temperature, s.top_k, s.top_p, s.max_new_tokens, list(s.stop_token_ids),
         list(s.stop), s.seed, s.greedy, s.logprobs, s.ignore_eos],
    ))


