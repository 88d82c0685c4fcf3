"""The engine process of `megarl.rollout.process.ProcessRolloutEngine`: its environment (one
GPU, a world of its own, pinned cores) and the loop that serves the trainer's requests.

    engine_main(spec, requests, results)   the child's entry point: build the engine, serve
                                           until "close" (generations, and whole multi-turn
                                           requests run by the agent loop here)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megarl.rollout.build import EngineSpec, engine_from_spec
from megarl.rollout.completion_arrays import pack_completions, to_wire, unpack_prompts
from megarl.rollout.weight_ring import WeightRing
from megarl.utils.lifetime import die_with_parent

log = logging.getLogger(__name__)

# The launch variables of the trainer's world; the engine child is a world of its own.
_WORLD_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_VISIBLE = "CUDA_VISIBLE_DEVICES"


def pin_process(cpus: Sequence[int], threads: int) -> list[int]:
    """Pin this process to ``cpus`` where the OS allows it and use ``threads`` intra-op
    threads; returns the CPUs it runs on."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(int(c) for c in cpus))
        except OSError as err:  # e.g. a container that forbids it
            log.warning("rollout engine: could not pin to CPUs %s (%s)", list(cpus), err)
    torch.set_num_threads(max(1, int(threads)))
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cores_apart(engine_cpus: Sequence[int]) -> list[int]:
    """The CPUs of this process (the trainer's, which its engine process inherits) apart from
    the node's ``engine_cpus``: where an engine process pinned to one of them runs its tool
    programs. [] (inherit) when no engine is pinned; every CPU, with a warning, when the
    engines take them all."""
    if not engine_cpus or not hasattr(os, "sched_getaffinity"):
        return []
    mine = sorted(os.sched_getaffinity(0))
    apart = [c for c in mine if c not in set(int(c) for c in engine_cpus)]
    if not apart:
        log.warning("async_training.engine_cpus=%s leaves no CPU of this process (%s) to the "
                    "python tool's programs: they share the engines' cores", list(engine_cpus),
                    mine)
        return mine
    return apart


def engine_process_env(device: str, environ: Mapping[str, str]
                       ) -> tuple[dict[str, str | None], str]:
    """How the engine process of the trainer's ``device`` sets its environment, given the
    trainer's ``environ``: (variables to set, None = unset; the device the engine uses there).

    The trainer's world variables go: the engine process is a world of one (vLLM would take
    LOCAL_RANK & co. as its own). On CUDA the process sees only the trainer's GPU, as cuda:0:
    CUDA_VISIBLE_DEVICES becomes the entry of the trainer's list at the trainer's device index
    (or that index where the trainer had no list; UUIDs and MIG ids are kept as written).
    vLLM's single-process executor runs on its local rank 0, i.e. the first visible device,
    and megarl's torch engine is told cuda:0; without this every rank's engine took GPU 0.
    Must be applied before CUDA is initialised in the engine process."""
    changes: dict[str, str | None] = {name: None for name in _WORLD_ENV if name in environ}
    dev = torch.device(device)
    if dev.type != "cuda":
        return changes, str(dev)
    index = 0 if dev.index is None else dev.index
    listed = environ.get(_VISIBLE)
    if listed is None:
        changes[_VISIBLE] = str(index)
    else:
        ids = [v.strip() for v in listed.split(",") if v.strip()]
        if index >= len(ids):
            raise ValueError(f"rollout engine process: the trainer's device {device} is not in "
                             f"its {_VISIBLE}={listed!r}")
        changes[_VISIBLE] = ids[index]
    return changes, "cuda:0"


def enter_engine_env(spec: EngineSpec) -> str:
    """Apply `engine_process_env` to this (the engine) process; returns the engine's device."""
    changes, device = engine_process_env(spec.device, os.environ)
    if _VISIBLE in changes and torch.cuda.is_initialized():  # read once, at initialisation
        raise RuntimeError("the rollout engine process initialised CUDA before choosing its "
                           "device")
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return device


def engine_main(spec: EngineSpec, requests: Any, results: Any) -> None:
    """The engine process: build the engine, say "ready", then serve requests in order until
    "close". ``requests`` / ``results``: the receiving and sending ends of two one-way pipes.

    Requests are read by a thread of their own into a queue, so a large request never waits
    for the engine to finish a generation (and the trainer, whose receiving thread drains
    ``results``, never waits for a request to be read)."""
    die_with_parent(mp.parent_process().pid)
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=drain_into, args=(requests, inbox), daemon=True,
                     name="megarl-engine-requests").start()
    engine = None
    try:
        device = enter_engine_env(spec)
        pin_process(spec.cpus, spec.threads)
        engine = engine_from_spec(spec, device)
        results.send(("ready", os.getpid()))
        ring: WeightRing | None = None
        loaded: int | None = None  # serial of the publish in the engine's model
        worker = None  # the agent loop's tools (multi-turn requests)
        while True:
            msg = inbox.get()
            kind = msg[0]
            if kind in ("close", "eof"):
                if hasattr(engine, "close"):
                    engine.close()
                break
            if kind == "ring":
                ring = WeightRing.attach(msg[1], msg[2])
                results.send(("attached",))
                continue
            if kind == "agent_setup":
                from megarl.rollout.agent.remote import AgentWorker

                worker = AgentWorker(msg[1], program_cpus=spec.tool_cpus)
                continue
            if kind == "agent":  # a whole multi-turn request: every turn on one version
                _, rid, version, slot, serial, request, sampling = msg
            else:
                _, rid, version, slot, serial, prompts, sampling, keys = msg
            start = time.perf_counter()
            if serial != loaded:  # the pickup point: weights change only here
                engine.update_weights(ring.slot(slot).items())
                loaded = serial
            results.send(("loaded", rid))
            generate = time.perf_counter()
            if kind == "agent":  # a report after each turn: a long request is not silence
                trajectories = worker.run(engine, version, request, sampling,
                                          on_turn=lambda rid=rid: results.send(("progress", rid)))
                results.send(("agent_done", rid, trajectories,
                              (start, generate, time.perf_counter())))
                continue
            comps = engine.generate(unpack_prompts(prompts), sampling, prompt_keys=keys)
            for c in comps:
                c.policy_version = version
            results.send(("done", rid, to_wire(pack_completions(comps)),
                          (start, generate, time.perf_counter())))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return
    except BaseException:
        try:
            results.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise


def drain_into(conn: Any, inbox: queue.Queue) -> None:
    """Move every message from the pipe ``conn`` to ``inbox``; ("eof",) when the other side
    is gone (both sides of the engine process read their pipe with it)."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("eof",))
