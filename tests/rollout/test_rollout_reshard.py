"""Bucketing of a weight stream (`megarl.rollout.reshard`): bucket bounds, order, casting, and
that the bucket size bounds peak memory: live streamed bytes (weakref accounting) and the
resident set of a subprocess streaming a 192 MB synthetic model, for two bucket sizes. The
backend streams at TP=2 / PP=2 are checked in test_rollout_reshard_dist.py."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.rollout.reshard import (
    flatten_buckets,
    save_hf_from_backend,
    tensor_bytes,
    weight_buckets,
)

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=30), st.integers(4, 2000))
def test_buckets_bounded_ordered_complete(sizes, bucket):
    stream = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]
    buckets = list(weight_buckets(iter(stream), bucket))
    flat = [name for b in buckets for name, _ in b]
    assert flat == [name for name, _ in stream]
    for b in buckets:
        total = sum(tensor_bytes(t) for _, t in b)
        assert total <= bucket or len(b) == 1  # only a lone oversized tensor may exceed it
    # greedy: a bucket is closed only when the next tensor would not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert sum(tensor_bytes(t) for _, t in b) + tensor_bytes(nxt[0][1]) > bucket


def test_cast_flatten_and_errors():
    stream = [("a", torch.ones(4, dtype=torch.float32)), ("i", torch.arange(3))]
    (b,) = list(weight_buckets(iter(stream), 1 << 20, dtype=torch.bfloat16))
    assert b[0][1].dtype == torch.bfloat16 and b[1][1].dtype == torch.int64  # ints untouched
    assert [n for n, _ in flatten_buckets(weight_buckets(iter(stream), 8))] == ["a", "i"]
    with pytest.raises(ValueError, match="twice"):
        list(weight_buckets(iter(stream + stream[:1]), 1 << 20))
    with pytest.raises(ValueError, match="positive"):
        list(weight_buckets(iter(stream), 0))


def test_bucket_bytes_from_config():
    from megarl.config import Config
    from megarl.trainer.settings import rollout_settings

    cfg = Config()
    cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes = 3
    assert rollout_settings(cfg).bucket_bytes == 3 * 2**20
    cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes = 0
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
        rollout_settings(cfg)


def _peak_live(bucket: int, n: int = 40, numel: int = 1000) -> int:
    live = [0, 0]

    def gone(k):
        live[0] -= k

    def produce():  # a stream that creates each tensor on demand, as export_weights does
        for i in range(n):
            t = torch.randn(numel)
            live[0] += tensor_bytes(t)
            live[1] = max(live[1], live[0])
            weakref.finalize(t, gone, tensor_bytes(t))
            yield f"w{i}", t
            del t

    for b in weight_buckets(produce(), bucket):
        del b  # the consumer copies and drops
    return live[1]


def test_live_bytes_bounded_by_bucket():
    tensor = 4000  # bytes per tensor
    small, large = _peak_live(3 * tensor), _peak_live(12 * tensor)
    assert small <= 3 * tensor + tensor and large <= 12 * tensor + tensor
    assert small < large < 40 * tensor


_RSS_CHILD = r"""
import json, resource, sys, torch
from megarl.rollout.reshard import weight_buckets
bucket = int(sys.argv[1])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def produce():
    for i in range(48):
        yield f"w{i}", torch.ones(1 << 20)  # 4 MiB each, 192 MiB in all
x = torch.ones(1 << 20)  # first-allocation costs before the baseline
del x
base = rss()
peak = 0
for b in weight_buckets(produce(), bucket):
    peak = max(peak, rss() - base)
    del b
print(json.dumps({"peak": peak}))
"""


def _child_peak(bucket: int) -> int:
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(bucket)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         # a fixed mmap threshold: freed tensors go back to the OS at once
                         # (glibc's dynamic threshold would keep them in the heap for reuse)
                         env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                              "PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def test_resident_memory_follows_bucket_size():
    mib = 2**20
    small, large = _child_peak(8 * mib), _child_peak(64 * mib)
    # one bucket + the tensor that did not fit (4 MiB slack), never the whole 192 MiB
    assert small <= 8 * mib + 4 * mib + 4 * mib, small / mib
    assert 60 * mib < large <= 64 * mib + 4 * mib + 4 * mib, large / mib


def test_save_hf_from_stream(tmp_path, tiny_folder, hf_model):
    """The same bucketed stream writes an HF folder transformers loads (world of one)."""
    from megarl.models import hf_config_for, load_model
    from megarl.models.state_dict_adapter import model_state_for_export

    src = load_model(tiny_folder("qwen2", tie_word_embeddings=True))

    class FakeBackend:  # the only method save_hf_from_backend uses besides the config
        def export_weights(self):
            return model_state_for_export(src)

    with pytest.raises(ValueError, match="config="):
        save_hf_from_backend(FakeBackend(), tmp_path / "x")
    out = save_hf_from_backend(FakeBackend(), tmp_path / "out", config=hf_config_for(src),
                               bucket_bytes=30_000)
    hf = hf_model(out)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, src(ids), atol=1e-5, rtol=0)
