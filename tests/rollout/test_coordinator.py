"""The coordinator (megarl/rollout/coordinator.py) with two rollout worker processes
(megarl/rollout/worker.py) on one tiny model:

- 10 prompts (n = 2) handed out 3 sequences in flight per worker come back ready, each
  prompt's samples equal to generating it alone in this process (tokens exact, logprobs within
  1e-5), whichever worker served it; both workers served some;
- a worker killed with prompts in flight is dropped with a warning naming it; its prompts are
  served by the other, with the same samples (keyed noise, same weights);
- with every worker gone, the wait fails naming the last cause.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.rollout.channel import ChannelError, ChannelListener
from megarl.rollout.coordinator import Coordinator, PromptRequest
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.worker import worker_main

pytestmark = pytest.mark.dist  # processes of their own

KEY = b"job-secret"
SP = SamplingParams(temperature=0.9, max_new_tokens=12, stop_token_ids=[7, 20, 33, 61])
PROMPTS = prompts_of([6, 2, 13, 4, 9, 3, 7, 5, 11, 8], seed=4)


def _workers(path, count: int):
    listener = ChannelListener(KEY)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, daemon=True,
                         args=(str(path), listener.host, listener.port, KEY, SP, 40,
                               {"max_num_seqs": 3, "tokenizer": None}, f"worker {i}", 60.0))
             for i in range(count)]
    for p in procs:
        p.start()
    channels = []
    for i in range(count):
        ch = listener.accept(f"worker {i}", timeout_s=60)
        _, hello = ch.recv("its hello", timeout_s=60)
        ch.peer = hello["name"]  # the worker says which one it is
        channels.append(ch)
    listener.close()
    return procs, channels


def _requests():
    return [PromptRequest(key=k, prompt=p, seed=50 + k, n=2, max_new_tokens=12)
            for k, p in enumerate(PROMPTS)]


def _check_alone(path, ready):
    from megarl.rollout.torch import TorchRolloutEngine

    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3, tokenizer=None)
    for r in ready:
        alone = engine.generate([r.prompt], SamplingParams(
            n=2, temperature=SP.temperature, max_new_tokens=12, seed=r.seed,
            stop_token_ids=SP.stop_token_ids), prompt_keys=[r.key])
        got = sorted(r.samples, key=lambda c: c.token_ids)
        for a, b in zip(sorted(alone, key=lambda c: c.token_ids), got, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_prompts_come_back_ready_from_both_workers(tiny_folder):
    path = tiny_folder("qwen3")
    procs, channels = _workers(path, 2)
    served = {}
    try:
        coord = Coordinator(channels, capacity=3, timeout_s=60)
        coord.add(_requests())
        ready = []
        while coord.pending:  # record which worker holds each prompt before it is ready
            for ch, held in coord.in_flight.items():
                served.update({k: ch.peer for k in held})
            coord.pump(0.05)
            ready += list(coord.ready)
            coord.ready.clear()
        coord.close()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert sorted(r.key for r in ready) == list(range(len(PROMPTS)))
    assert set(served.values()) == {"worker 0", "worker 1"}
    _check_alone(path, ready)


def test_a_dead_worker_s_prompts_go_to_the_other(tiny_folder):
    path = tiny_folder("qwen3")
    procs, channels = _workers(path, 2)
    warnings = []
    try:
        coord = Coordinator(channels, capacity=3, timeout_s=60, warn=warnings.append)
        coord.add(_requests())
        coord._dispatch()
        assert coord.in_flight[channels[1]]  # the victim holds prompts
        procs[1].kill()
        ready = coord.take(len(PROMPTS), timeout_s=120)
        coord.close()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert len(warnings) == 1 and warnings[0].startswith("rollout worker dropped: worker 1 is "
                                                         "gone"), warnings
    assert sorted(r.key for r in ready) == list(range(len(PROMPTS)))
    _check_alone(path, ready)


def test_with_no_worker_left_the_wait_names_the_last_cause(tiny_folder):
    procs, channels = _workers(tiny_folder("qwen3"), 1)
    try:
        coord = Coordinator(channels, capacity=3, timeout_s=60, warn=lambda _: None)
        coord.add(_requests())
        coord._dispatch()
        procs[0].kill()
        with pytest.raises(ChannelError, match=r"no rollout worker is left \(the last: worker 0 "
                                               r"is gone"):
            coord.take(len(PROMPTS), timeout_s=60)
    finally:
        if procs[0].is_alive():
            procs[0].kill()
