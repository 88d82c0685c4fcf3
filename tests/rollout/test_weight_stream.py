"""The weight stream (megarl/rollout/weight_stream.py) through the rollout workers' pool
(megarl/rollout/worker_pool.py): two worker processes, a weight group over gloo, new weights
published while requests run.

- every prompt's samples equal generating it alone (this process, transformers-free: megarl's
  engine on the same weights; tokens exact, logprobs within 1e-5) on the weights of the version
  it carries: prompts handed out before the publish on the old weights (version 0), those
  handed out after it on the new ones (version 1); each version serves some;
- the stream went out in several buckets and both workers report version 1 with digests equal
  to the trainer's; a whole-list generation (greedy, as validation) runs on the new weights;
- a digest that disagrees (the trainer sends and digests float16 casts, the engines hold
  float32) fails the run naming a tensor; after a worker died the group forms again without it (a warning
  names it) and the other worker runs the new weights.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_helpers import float64_model, moved_folder, prompts_of, switching_reference
from safetensors.torch import load_file

from megarl.rollout.build import EngineSpec
from megarl.rollout.coordinator import PromptRequest
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.reshard import weight_buckets
from megarl.rollout.weight_stream import WeightDigestError, wire_dtype
from megarl.rollout.worker_pool import WorkerPlacement, WorkerPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp32_bounds import fp32_ref_gap_bound  # noqa: E402

pytestmark = pytest.mark.dist  # processes of their own

SP = SamplingParams(temperature=0.9, max_new_tokens=12, stop_token_ids=[7, 20, 33, 61])
GREEDY = SamplingParams(greedy=True, temperature=0.0, max_new_tokens=12,
                        stop_token_ids=[7, 20, 33, 61])
PROMPTS = prompts_of([6, 2, 13, 4, 9, 3, 7, 5, 11, 8], seed=4)
BUCKET = 64 << 10  # bytes: the tiny model goes out in several buckets


def _pool(path, count: int = 2, sampling: SamplingParams = SP, max_len: int = 40,
          partial_rollout: bool = False) -> WorkerPool:
    spec = EngineSpec("torch", {"path": str(path), "dtype": "fp32", "device": "cpu",
                                "tokenizer": None, "max_num_seqs": 3})
    placement = WorkerPlacement(specs=[spec] * count, sampling=sampling, max_len=max_len,
                                capacity=3, timeout_s=60, partial_rollout=partial_rollout)
    return WorkerPool(placement, torch.device("cpu"), bucket_bytes=BUCKET, check_digest=True)


def _new_weights(path) -> dict[str, torch.Tensor]:
    """The folder's weights, each moved by 5% noise (seeded)."""
    g = torch.Generator().manual_seed(7)
    state = load_file(str(path / "model.safetensors"))
    return {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _requests(keys):
    return [PromptRequest(key=k, prompt=PROMPTS[k % len(PROMPTS)], seed=50 + k, n=2,
                          max_new_tokens=12) for k in keys]


def _engine(path, weights=None):
    from megarl.rollout.torch import TorchRolloutEngine

    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3, tokenizer=None)
    if weights is not None:
        engine.update_weights(iter(weights.items()))
    return engine


def _same(a, b):
    for x, y in zip(sorted(a, key=lambda c: c.token_ids), sorted(b, key=lambda c: c.token_ids),
                    strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_header_dtypes_read_back_and_others_are_refused():
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert wire_dtype(str(d)) is d
    with pytest.raises(ValueError, match="not a torch dtype: 'torch.nn'"):
        wire_dtype("torch.nn")


def test_requests_after_a_publish_run_on_the_new_weights(tiny_folder):
    path = tiny_folder("qwen3")
    new = _new_weights(path)
    pool = _pool(path)
    try:
        coord = pool.coord
        coord.add(_requests(range(6)))  # 3 sequences per worker go out now, the rest queue
        before = {k for held in coord.in_flight.values() for k in held}
        pool.update_weights(iter(new.items()), version=1)
        coord.add(_requests(range(6, 12)))
        ready = coord.take(12, timeout_s=120)
        while set(coord.versions.values()) != {1}:  # the loads (and digest checks) reported
            coord.pump(0.1)
        greedy = pool.generate(PROMPTS[:4], GREEDY, [0, 1, 2, 3])
        sent = coord.sent[1]
    finally:
        pool.close()
    assert sent.nbytes == sum(v.numel() * 4 for v in new.values())
    assert len(list(weight_buckets(iter(new.items()), BUCKET))) > 2
    versions = {r.key: {c.policy_version for c in r.samples} for r in ready}
    assert all(len(v) == 1 for v in versions.values()), versions
    assert {k for k, v in versions.items() if v == {0}} == before and before
    assert all(versions[k] == {1} for k in range(6, 12))
    old_engine, new_engine = _engine(path), _engine(path, new)
    for r in ready:
        engine = new_engine if versions[r.key] == {1} else old_engine
        alone = engine.generate([r.prompt], SamplingParams(
            n=2, temperature=SP.temperature, max_new_tokens=12, seed=r.seed,
            stop_token_ids=SP.stop_token_ids), prompt_keys=[r.key])
        _same(alone, r.samples)
    assert [c.prompt_index for c in greedy] == [0, 1, 2, 3]
    assert all(c.policy_version == 1 for c in greedy)
    _same(new_engine.generate(PROMPTS[:4], GREEDY, prompt_keys=[0, 1, 2, 3]), greedy)


def test_a_digest_that_disagrees_fails_naming_the_tensor(tiny_folder):
    path = tiny_folder("qwen3")
    pool = _pool(path, count=1)
    try:
        pool.engine_dtype = torch.float16  # sent (and digested) in another dtype than engines
        # hold: each engine casts the values back to float32, whose bytes differ
        pool.update_weights(iter(_new_weights(path).items()), version=1)
        with pytest.raises(WeightDigestError, match=r"weight digest mismatch: rollout worker 0 "
                                                    r"\(pid \d+\) holds \S+ with sha256"):
            for _ in range(600):
                pool.coord.pump(0.1)
    finally:
        pool.close()


def test_a_lost_worker_leaves_the_group_and_the_other_gets_the_weights(tiny_folder):
    path = tiny_folder("qwen3")
    new = _new_weights(path)
    pool = _pool(path)
    warnings = []
    try:
        pool.coord.warn = warnings.append
        pool.procs[1].kill()
        pool.procs[1].join()
        pool.update_weights(iter(new.items()), version=1)  # finds it gone, forms the group again
        pool.coord.add(_requests(range(6)))
        ready = pool.coord.take(6, timeout_s=120)  # all served by the other
        live = pool.coord.live
    finally:
        pool.close()
    assert [ch.peer.split(" (")[0] for ch in live] == ["rollout worker 0"]
    assert warnings[0].startswith("rollout worker dropped: rollout worker 1 (pid ")
    assert warnings[1].startswith("the weight group formed again with the 1 live rollout "
                                  "workers (lost: rollout worker 1 (pid ")
    engine = _engine(path, new)
    for r in ready:
        assert {c.policy_version for c in r.samples} == {1}
        _same(engine.generate([r.prompt], SamplingParams(
            n=2, temperature=SP.temperature, max_new_tokens=12, seed=r.seed,
            stop_token_ids=SP.stop_token_ids), prompt_keys=[r.key]), r.samples)


LONG = SamplingParams(temperature=0.9, max_new_tokens=200, ignore_eos=True)  # no stop


def test_a_partial_rollout_goes_on_under_the_published_weights(tiny_folder, tmp_path):
    """``partial_rollout``: a request of 2 tokens and two of 200 start together on one worker;
    once the short one is back (the long ones then have 198 tokens to go) the worker is
    stopped (SIGSTOP, so however slowly this process gets to it, the publish finds the long
    requests running), new weights are published, the worker resumed, and a fourth request
    added. The long samples span both versions: each token
    stamped with the version that sampled it, every token equal to the brute-force draw that
    reads its whole prefix with the old weights before the switch and the new ones after it
    (float64 transformers, the same uniforms), every logprob within the fp32 bound of its
    reference; ``policy_version`` is the first token's; the fourth request runs wholly on
    version 1, and the worker reports the load at once, while the long requests still run."""
    path = tiny_folder("qwen3")
    new_path = moved_folder(path, tmp_path / "moved")
    pool = _pool(path, count=1, sampling=LONG, max_len=220, partial_rollout=True)
    reqs = [PromptRequest(key=k, prompt=PROMPTS[k], seed=70 + k, n=1,
                          max_new_tokens=2 if k == 0 else 200) for k in range(4)]
    try:
        coord = pool.coord
        coord.add(reqs[:3])
        (short,) = coord.take(1, timeout_s=60)
        worker = pool.procs[0].pid
        os.kill(worker, signal.SIGSTOP)
        # resumed from another thread: the publish may wait on the worker's socket buffers
        resume = threading.Timer(1.0, os.kill, (worker, signal.SIGCONT))
        resume.start()
        try:
            pool.update_weights(iter(load_file(str(new_path / "model.safetensors")).items()),
                                version=1)
        finally:
            resume.join()
        coord.add(reqs[3:])
        while coord.versions[coord.live[0]] != 1:
            coord.pump(0.1)
        loaded_with = coord.pending  # prompts still running when the load was reported
        ready = coord.take(3, timeout_s=120)
    finally:
        pool.close()
    assert short.key == 0 and short.samples[0].token_versions == [0, 0]
    assert loaded_with >= 2
    hf_old, hf_new = float64_model(path), float64_model(new_path)
    bound = max(fp32_ref_gap_bound(p, tokens=600, temperature=LONG.temperature)
                for p in (path, new_path))
    for r in ready:
        (c,) = r.samples
        v = c.token_versions
        assert len(v) == len(c.token_ids) == 200 and v == sorted(v) and set(v) <= {0, 1}
        switch = v.index(1) if 1 in v else 200
        assert c.policy_version == v[0]
        if r.key == 3:
            assert switch == 0, v
        else:
            assert 0 < switch < 200, f"prompt {r.key} did not span the publish: {v}"
        tokens, lps = switching_reference(hf_old, hf_new, switch, r.prompt, r.key, r.seed, 0,
                                          LONG)
        assert c.token_ids == tokens, r.key
        np.testing.assert_allclose(c.logprobs.double().numpy(), lps, atol=bound, rtol=0)
