"""A rollout worker in a process of its own (megarl/rollout/worker.py) over the control channel
(megarl/rollout/channel.py), driven from this process as the coordinator would drive it:

- requests sent in two waves, the second while the first decodes, come back as samples the
  step each finishes, with the coordinator's ids (n > 1 included), and each equals the same
  request generated alone by an engine in this process (tokens exact, logprobs within 1e-5);
- "stop" ends the worker (exit code 0);
- a worker without the job's key is refused at the handshake, naming it;
- a worker that stops talking (SIGSTOP) fails the coordinator's wait after its timeout, and
  one that dies (SIGKILL) fails it at once, each naming the worker and what was awaited.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.rollout.channel import ChannelError, ChannelListener
from megarl.rollout.completion_arrays import unpack_completions
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.worker import worker_main

pytestmark = pytest.mark.dist  # processes of their own

KEY = b"job-secret"
SP = SamplingParams(temperature=0.9, max_new_tokens=12, stop_token_ids=[7, 20, 33, 61])


def _start(path, listener, key=KEY):
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=worker_main, daemon=True,
                       args=(str(path), listener.host, listener.port, key, SP, 40,
                             {"max_num_seqs": 3, "tokenizer": None}, "worker 0", 60.0))
    proc.start()
    return proc


def _request(i, prompt, n=1):
    return {"id": f"r{i}", "prompt": prompt, "prompt_key": i, "seed": 100 + i, "n": n,
            "max_new_tokens": 12}


def _samples(ch, want: int) -> dict[str, list]:
    got: dict[str, list] = {}
    count = 0
    while count < want:
        kind, payload = ch.recv("finished samples", timeout_s=60)
        if kind == "error":
            pytest.fail(payload)
        if kind != "samples":
            continue
        for rid, c in zip(payload["ids"], unpack_completions(payload["completions"])):
            got.setdefault(rid, []).append(c)
            count += 1
    return got


def test_a_worker_streams_samples_equal_to_generating_alone(tiny_folder):
    from megarl.rollout.torch import TorchRolloutEngine

    path = tiny_folder("qwen3")
    listener = ChannelListener(KEY)
    proc = _start(path, listener)
    try:
        ch = listener.accept("worker 0", timeout_s=60)
        assert ch.recv("its hello", timeout_s=60) == ("hello", {"name": "worker 0", "dtype": "torch.float32"})
        prompts = prompts_of([6, 2, 13, 4, 9, 3], seed=4)
        first = [_request(i, prompts[i], n=2 if i == 0 else 1) for i in range(3)]
        for r in first:
            ch.send("request", r)
        got = _samples(ch, 1)
        assert sum(len(v) for v in got.values()) < 4  # the first wave still decodes: the
        # second joins its running batch
        for i in range(3, 6):
            ch.send("request", _request(i, prompts[i]))
        more = _samples(ch, 2 + 1 + 1 + 3 - sum(len(v) for v in got.values()))
        for rid, cs in more.items():
            got.setdefault(rid, []).extend(cs)
        ch.send("stop")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        listener.close()
    assert sorted(got) == [f"r{i}" for i in range(6)] and len(got["r0"]) == 2
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3, tokenizer=None)
    for i in range(6):
        req = _request(i, prompts[i], n=2 if i == 0 else 1)
        alone = engine.generate([req["prompt"]], SamplingParams(
            n=req["n"], temperature=SP.temperature, max_new_tokens=12, seed=req["seed"],
            stop_token_ids=SP.stop_token_ids), prompt_keys=[i])
        mine = sorted(got[req["id"]], key=lambda c: c.token_ids)
        for a, b in zip(sorted(alone, key=lambda c: c.token_ids), mine, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_a_worker_without_the_key_is_refused(tiny_folder):
    listener = ChannelListener(KEY)
    proc = _start(tiny_folder("qwen3"), listener, key=b"another job")
    try:
        with pytest.raises(ChannelError, match="worker 0 failed the channel's authentication"):
            listener.accept("worker 0", timeout_s=60)
    finally:
        proc.kill()
        listener.close()


def test_a_silent_or_dead_worker_fails_the_wait_naming_it(tiny_folder):
    listener = ChannelListener(KEY)
    proc = _start(tiny_folder("qwen3"), listener)
    try:
        ch = listener.accept("worker 0", timeout_s=60)
        ch.recv("its hello", timeout_s=60)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="worker 0 sent nothing for 1 s while waiting "
                                               "for finished samples"):
            while True:  # heartbeats sent before the stop may still be queued
                ch.recv("finished samples", timeout_s=1)
        assert time.monotonic() - t0 < 30
        proc.kill()
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(30)
        with pytest.raises(ChannelError, match="worker 0 is gone"):
            while True:
                ch.recv("finished samples", timeout_s=30)
    finally:
        if proc.is_alive():
            proc.kill()
        listener.close()
