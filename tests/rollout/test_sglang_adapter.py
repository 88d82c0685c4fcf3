"""The SGLang adapter up to the engine boundary. SGLang cannot run here (no CPU wheel; it pins
a CUDA torch), so these tests cover the adapter's own logic against a recording fake: sampling
parameters, output parsing into Completions, weight buckets and the order of memory calls.
Whether each call exists in the real package is checked by test_sglang_contract.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sglang import SGLangEngine, to_sglang_params


class RecordingSGLang:
    def __init__(self, script=None, status=(True, "ok")):
        self.calls: list[tuple] = []
        self.script = script
        self.status = status

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        return self.script(input_ids, sampling_params)

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.calls.append(("update", [(n, tuple(t.shape)) for n, t in named_tensors], flush_cache))
        return self.status

    def flush_cache(self):
        self.calls.append(("flush_cache",))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))



def _stream(n=6, numel=100):
    return [(f"model.layers.{i}.w", torch.zeros(numel)) for i in range(n)]


def test_sglang_sampling_mapping():
    sp = SamplingParams(n=2, temperature=1.1, top_k=-1, top_p=0.95, max_new_tokens=7,
                        stop=["\n\n"], stop_token_ids=[9], seed=1)
    assert to_sglang_params(sp, seed=42) == {
        "temperature": 1.1, "top_k": -1, "top_p": 0.95, "max_new_tokens": 7,
        "ignore_eos": False, "skip_special_tokens": False, "stop": ["\n\n"],
        "stop_token_ids": [9], "sampling_seed": 42,
    }
    g = to_sglang_params(SamplingParams(temperature=0.0, top_k=3))
    assert (g["temperature"], g["top_k"], g["top_p"]) == (0.0, -1, 1.0)
    assert "sampling_seed" not in g and "stop" not in g


def test_sglang_generate_parses_prompt_major():
    def script(input_ids, params):
        return [{"output_ids": [ids[-1], 2],
                 "meta_info": {"output_token_logprobs": [(-0.1 * k, ids[-1], None),
                                                         (-0.2, 2, None)],
                               "finish_reason": {"type": "stop", "matched": 2}}}
                for k, ids in enumerate(input_ids)]

    eng = RecordingSGLang(script)
    out = SGLangEngine(engine=eng).generate([[1, 4], [1, 5]], SamplingParams(n=3, seed=2))
    (_, input_ids, params, want_lp), = eng.calls
    assert input_ids == [[1, 4]] * 3 + [[1, 5]] * 3 and want_lp is True
    assert len({p["sampling_seed"] for p in params}) == 6  # one seed per request
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert [c.token_ids for c in out] == [[4, 2]] * 3 + [[5, 2]] * 3
    assert all(c.finish_reason == "stop" for c in out)
    torch.testing.assert_close(out[4].logprobs, torch.tensor([-0.4, -0.2]))

    def mismatched(input_ids, params):
        return [{"output_ids": [3], "meta_info": {"output_token_logprobs": [(-1.0, 4, None)],
                                                  "finish_reason": {"type": "length"}}}]

    with pytest.raises(RuntimeError, match="differ"):
        SGLangEngine(engine=RecordingSGLang(mismatched)).generate([[1]], SamplingParams())


def test_sglang_update_and_memory_order():
    eng = RecordingSGLang()
    engine = SGLangEngine(engine=eng, bucket_bytes=1000)
    engine.update_weights(iter(_stream()))
    engine.sleep()
    engine.update_weights(iter(_stream(2)))
    engine.wake()
    kinds = [c[0] for c in eng.calls]
    assert kinds == ["update", "update", "update", "flush_cache", "release", "resume", "update",
                     "flush_cache", "resume"]
    assert all(c[2] is False for c in eng.calls if c[0] == "update")
    assert eng.calls[5] == ("resume", ["weights"]) and eng.calls[8] == ("resume", ["kv_cache"])
    with pytest.raises(RuntimeError, match="failed: boom"):
        SGLangEngine(engine=RecordingSGLang(status=(False, "boom"))).update_weights(_stream(1))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_missing_sglang_error():
    with pytest.raises(ImportError, match=r"pip install megarl\[sglang\]"):
        SGLangEngine("/nonexistent")


