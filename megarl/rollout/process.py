"""`ProcessRolloutEngine`: a rollout engine in a process of its own, beside the trainer.

The trainer process keeps a proxy that speaks the `RolloutEngine` protocol plus two calls for
asynchronous rollout (`submit` / `result`); the engine itself runs in a spawned child, pinned
to its own cores with one intra-op thread, so generation overlaps the trainer's
forward/backward passes. The child hosts either megarl's `TorchRolloutEngine` or a
`VLLMEngine` (vLLM's ``LLM`` in the child, with its single-process ``uni`` executor: the child
is a world of one whatever the trainer's world, so each training rank has its own engine;
`megarl.rollout.engine_process` is the child's side).

Weights travel through a ring of ``slots`` copies of the model in one shared-memory file
(`megarl.rollout.weight_ring`, created at the first publish, HF names as in the resharding
stream), one ring per node: the node's first rank writes it, every engine process of the
node maps it.

    trainer: update_weights(actor.export_weights())   publish version v into slot j
             submit(prompts, sampling, keys)           the request names the newest version
    engine:  before a request starts, load the named version's slot if it is not the one
             already loaded (the only point where the engine's weights change), ack "loaded",
             generate, return completions stamped with that version.

A slot is overwritten only once every request that names the version it holds has acked its
load (on every rank of the node: a publish is collective), so a publish never races a load and
the version a request uses is fixed when it is submitted, whatever the timing: the outputs are
a function of (weights of that version, prompts, sampling seed) only. With
``slots = staleness + 1`` the trainer never waits on that rule (a version is loaded before the
step that publishes ``staleness + 1`` versions later).

Multi-turn rollouts (`generate_agent` / `prefetch_agent`): a whole multi-turn request is one
request; the engine process runs the agent loop on it (`megarl.rollout.agent.remote`: the tools
built there from the run's tool config, once), so every turn of its trajectories is generated
by the version the request named.

Host memory per node: ``slots x W`` for the ring (W: the bytes of the published weights in the
engine's dtype: fp32 master weights travel as the bf16 a bf16 engine loads) plus each engine's
own copy of the model (on the GPU for vLLM).

Transport: two one-way pipes, each drained by a thread on its receiving side, so neither side
ever blocks sending while the other is blocked sending too (requests and results of any
size); prompts and completions travel as flat arrays (`megarl.rollout.completion_arrays`). The engine
process says "ready" once it has built its engine (on a GPU the proxy waits for it before
returning, so the trainer does not load its models while the engine sizes its memory), dies
with the trainer (`megarl.utils.lifetime`), and a wait on it that hears nothing for
``timeout_s`` fails naming what it waited for. A multi-turn request reports progress after
each turn, so the silence is counted from the last turn, not from the request's start.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from megarl.rollout.build import EngineSpec
from megarl.rollout.completion_arrays import pack_completions, pack_prompts, unpack_completions
from megarl.rollout.engine_process import drain_into, engine_main
from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.reshard import as_named
from megarl.rollout.weight_ring import RingLayout, WeightRing
from megarl.utils import dist as mdist

# Default seconds a wait on the engine process may hear nothing before the run fails.
DEFAULT_TIMEOUT_S = 1800.0


class EngineProcessError(RuntimeError):
    """The engine process failed (its traceback is in the message) or died."""


@dataclass
class _Request:
    serial: int  # the publish it uses (labels may repeat; serials do not)
    loaded: bool = False
    result: list[Any] | None = None  # completions, or plain trajectories (agent requests)
    agent: bool = False


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
    waiting). A publish's version label is ``update_weights(..., version=)`` (the trainer
    passes its count of actor updates, so a version's lag is counted in updates), by default 0
    for the first publish, then +1 per publish. timeout_s: how long a wait on the engine process may hear
    nothing from it (``async_training.engine_timeout_s``).
    """

    def __init__(self, spec: EngineSpec, *, slots: int = 2,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self._ctx = mp.get_context("spawn")
        requests_in, self._to_engine = self._ctx.Pipe(duplex=False)
        self._from_engine, results_out = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=engine_main, args=(spec, requests_in, results_out),
                                       daemon=True, name="megarl-rollout-engine")
        self._proc.start()
        requests_in.close()
        results_out.close()
        self._inbox: queue.Queue = queue.Queue()
        threading.Thread(target=drain_into, args=(self._from_engine, self._inbox), daemon=True,
                         name="megarl-engine-results").start()
        self._ready = self._attached = False
        self._nslots = slots
        self._ring: WeightRing | None = None  # this node's ring, on the rank that wrote it
        self._layout: RingLayout | None = None  # the node's ring's, on every rank
        self.last_sync_bytes = 0  # the tensor bytes of the last publish (the engine's dtype)
        self._published = False
        self._slot_serial: list[int | None] = [None] * slots
        self._next_slot = 0
        self._serial = -1
        self._latest: tuple[int, int, int] | None = None  # (version label, slot, serial)
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._prefetched: dict[Any, int] = {}  # match key -> request id
        self._versions: dict[int, int] = {}  # request id -> version label, until done
        self.spans: deque[EngineSpan] = deque(maxlen=1024)  # the newest requests' timings
        self._agent: Any = None  # the agent whose setup the engine process holds
        self._closed = False
        if torch.device(spec.device).type == "cuda":
            self.wait_ready()

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_keys: Sequence[int] | None = None) -> list[Completion]:
        """A prefetched request with exactly these arguments is collected; any other call
        runs now on the newest published weights. Completions carry ``policy_version``."""
        rid = self._prefetched.pop(_match_key(prompts, sampling, prompt_keys), None)
        if rid is None:
            rid = self.submit(prompts, sampling, prompt_keys)
        return self.result(rid)

    def update_weights(self, weights: Iterable[Any], version: int | None = None) -> None:
        """Publish a new version (labelled ``version``; default: the last label + 1, 0 at
        first): copy the (HF name, full tensor) stream (flat or bucketed) into the next ring
        slot. Collective: every rank calls it and consumes its whole stream; the node's first
        rank writes the node's ring."""
        if version is None:
            version = 0 if self._latest is None else self._latest[0] + 1
        slot = self._next_slot
        self._wait_slot_free(slot)
        if not self._published:
            self._publish_first(as_named(weights))
        else:
            mdist.barrier()  # every engine of the node is done with what the slot held
            if self._ring is not None:
                self._ring.write(slot, as_named(weights))
            else:
                for _ in as_named(weights):
                    pass
            mdist.barrier()  # written before any engine of the node may load it
        self.last_sync_bytes = sum(p.nbytes for p in self._layout.places)
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

    def wait_ready(self) -> None:
        """Wait until the engine process has built its engine (its memory is taken)."""
        while not self._ready:
            self._receive(f"its start-up (building the {self.spec.engine} engine)")

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
        self._send(("gen", rid, version, slot, serial, pack_prompts(prompts), sampling, keys))
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

    # ------------------------------------------------------------------ multi-turn requests
    def generate_agent(self, agent: Any, request: Any, sampling: SamplingParams
                       ) -> list[dict[str, Any]]:
        """Multi-turn rollouts run by the agent loop in the engine process
        (`megarl.rollout.agent.remote`): the prefetched request equal to this one is
        collected, else it runs now on the newest published weights. ``agent``: the run's
        `AgentRollout`; ``request``: an `AgentRequest`. Returns plain trajectories, every turn
        of each generated by one weight version."""
        rid = self._prefetched.pop(_agent_key(request, sampling), None)
        if rid is None:
            rid = self.submit_agent(agent, request, sampling)
        return self.result(rid)

    def submit_agent(self, agent: Any, request: Any, sampling: SamplingParams) -> int:
        """Queue a multi-turn request on the newest published version; returns its id."""
        if self._latest is None:
            raise RuntimeError("ProcessRolloutEngine: publish weights (update_weights) before "
                               "the first generation")
        if self._agent is not agent:  # the tools are built there once per agent
            from megarl.rollout.agent.remote import agent_setup, check_remote_tools

            check_remote_tools(agent.settings, agent.tools)
            self._send(("agent_setup", agent_setup(agent.settings, agent.tokenizer,
                                                   agent.tools)))
            self._agent = agent
        version, slot, serial = self._latest
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = _Request(serial, agent=True)
        self._versions[rid] = version
        self._send(("agent", rid, version, slot, serial, request, sampling))
        return rid

    def prefetch_agent(self, agent: Any, request: Any, sampling: SamplingParams) -> tuple:
        """`submit_agent` now (unless an identical request is pending); a later
        `generate_agent` with the same request collects it. Returns its match key."""
        key = _agent_key(request, sampling)
        if key not in self._prefetched:
            self._prefetched[key] = self.submit_agent(agent, request, sampling)
        return key

    def result(self, rid: int) -> list[Any]:
        """Wait for request ``rid`` and return its completions (each stamped with the version
        that generated it)."""
        req = self._requests.get(rid)
        if req is None:
            raise KeyError(f"no pending request {rid}")
        while req.result is None:
            self._receive(f"request {rid} (policy version {self._versions.get(rid)})")
        del self._requests[rid]
        return req.result

    def pending(self) -> list[tuple[Any, int]]:
        """The prefetched requests not yet collected: (match key, request id), oldest first."""
        return sorted(self._prefetched.items(), key=lambda kv: kv[1])

    def export_prefetched(self) -> list[dict[str, Any]]:
        """Wait for every prefetched request and return them as tensors and plain data
        (checkpoint of the batches in flight, `megarl.rollout.completion_arrays`); they stay
        collectable."""
        out = []
        for key, rid in self.pending():
            agent = self._requests[rid].agent
            comps = self.result(rid)
            # keep it collectable: re-register the finished result under a new id
            new = self._next_id
            self._next_id += 1
            self._requests[new] = _Request(-1, loaded=True, result=comps, agent=agent)
            self._prefetched[key] = new
            out.append({"key": key, "trajectories": comps} if agent
                       else {"key": key, "packed": pack_completions(comps)})
        return out

    def import_prefetched(self, state: list[dict[str, Any]]) -> None:
        """Register finished requests saved by `export_prefetched` (exact resume)."""
        for entry in state:
            if "trajectories" in entry:  # a multi-turn request's plain trajectories
                rid = self._next_id
                self._next_id += 1
                self._requests[rid] = _Request(-1, loaded=True, result=list(entry["trajectories"]),
                                               agent=True)
                self._prefetched[_freeze(entry["key"])] = rid
                continue
            if "packed" in entry:
                comps = unpack_completions(entry["packed"])
            else:  # saved as one dict of lists per completion (before flat arrays)
                comps = [_completion_from_lists(c) for c in entry["completions"]]
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
                self._to_engine.send(("close",))
                self._proc.join(timeout=30)
        except (BrokenPipeError, OSError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._to_engine.close()
        self._from_engine.close()
        if self._ring is not None:
            self._ring.unlink()

    # ------------------------------------------------------------------ internals
    def _publish_first(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Create the node's ring (its first rank, from this stream) and map it in every
        engine process of the node; the file's name goes once all have mapped it."""
        node = (socket.gethostname(), _group_rank())
        ranks = mdist.all_gather_objects(node)
        leader = ranks.index(node) == mdist.rank()
        info = None
        if leader:
            self._ring = WeightRing.create(named, self._nslots, self.spec.weight_dtype)
            info = (str(self._ring.path), self._ring.layout)
        else:
            for _ in named:
                pass
        infos = mdist.all_gather_objects((node, info))
        path, layout = next(i for n, i in infos if n == node and i is not None)
        self._layout = layout
        self._send(("ring", path, layout))
        while not self._attached:
            self._receive(f"it to map the weight ring {path}")
        mdist.barrier()
        if self._ring is not None:
            self._ring.unlink()
        self._published = True

    def _send(self, msg: tuple) -> None:
        try:
            self._to_engine.send(msg)
        except (BrokenPipeError, OSError) as err:
            self._proc.join(timeout=5)
            while True:  # its last words: the error that ended it
                try:
                    last = self._inbox.get(timeout=1.0)
                except queue.Empty:
                    break
                if last[0] == "error":
                    raise EngineProcessError(
                        f"the rollout engine process failed:\n{last[1]}") from err
            raise EngineProcessError(f"the rollout engine process is gone "
                                     f"(exit code {self._proc.exitcode})") from err

    def _next_message(self, waiting_for: str) -> tuple:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._inbox.get(timeout=min(1.0, self.timeout_s))
            except queue.Empty:
                pass
            if not self._proc.is_alive():
                try:  # its last words (an error report) may still be on their way
                    return self._inbox.get(timeout=1.0)
                except queue.Empty:
                    pass
                raise EngineProcessError(f"the rollout engine process died (exit code "
                                         f"{self._proc.exitcode}) while the trainer waited for "
                                         f"{waiting_for}")
            if time.monotonic() > deadline:
                raise EngineProcessError(
                    f"the rollout engine process (pid {self._proc.pid}) sent nothing for "
                    f"{self.timeout_s:g} s while the trainer waited for {waiting_for}: it is "
                    "alive but stuck (a hung generation or device); if a generation of this "
                    "size takes that long, raise async_training.engine_timeout_s")

    def _receive(self, waiting_for: str) -> None:
        msg = self._next_message(waiting_for)
        kind = msg[0]
        if kind == "error":
            raise EngineProcessError(f"the rollout engine process failed:\n{msg[1]}")
        if kind == "eof":
            self._proc.join(timeout=5)
            raise EngineProcessError(f"the rollout engine process closed its pipe (exit code "
                                     f"{self._proc.exitcode}) while the trainer waited for "
                                     f"{waiting_for}")
        if kind == "ready":
            self._ready = True
            return
        if kind == "attached":
            self._attached = True
            return
        if kind == "progress":  # a turn of a multi-turn request done: the wait starts anew
            return
        req = self._requests[msg[1]]
        if kind == "loaded":
            req.loaded = True
        elif kind in ("done", "agent_done"):
            req.loaded = True
            req.result = unpack_completions(msg[2]) if kind == "done" else msg[2]
            self.spans.append(EngineSpan(msg[1], self._versions.pop(msg[1], -1), *msg[3]))

    def _wait_slot_free(self, slot: int) -> None:
        held = self._slot_serial[slot]
        if held is None:
            return
        for rid, r in list(self._requests.items()):
            while r.serial == held and not r.loaded:
                self._receive(f"request {rid} to load version {self._versions.get(rid)} "
                              f"before slot {slot} is rewritten")

    def __del__(self) -> None:  # best effort; the trainer calls close()
        try:
            self.close()
        except Exception:
            pass


def _group_rank() -> str:
    return os.environ.get("GROUP_RANK", "0")


def _completion_from_lists(d: dict[str, Any]) -> Completion:
    lp, routed = d["logprobs"], d.get("routed_experts")
    return Completion(prompt_index=d["prompt_index"], token_ids=list(d["token_ids"]),
                      logprobs=None if lp is None else torch.tensor(lp, dtype=torch.float32),
                      finish_reason=d["finish_reason"], policy_version=d["policy_version"],
                      routed_experts=None if routed is None else torch.tensor(
                          routed, dtype=torch.int16))


# ---------------------------------------------------------------------- plain-data helpers


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _agent_key(request: Any, sampling: SamplingParams) -> tuple:
    """The match key of a multi-turn request (`megarl.rollout.agent.remote.AgentRequest`)."""
    return ("agent", request.digest(), _match_key([], sampling, None))


def _match_key(prompts: list[list[int]], sampling: SamplingParams,
               prompt_keys: Sequence[int] | None) -> tuple:
    s = sampling
    return _freeze((
        [list(map(int, p)) for p in prompts],
        None if prompt_keys is None else [int(k) for k in prompt_keys],
        [s.n, s.temperature, s.top_k, s.top_p, s.max_new_tokens, list(s.stop_token_ids),
         list(s.stop), s.seed, s.greedy, s.logprobs, s.ignore_eos],
    ))


