"""vLLM / SGLang adapters up to the engine boundary. Neither engine runs here (GPU only), so
these tests cover only the adapters' own logic, against recording fakes: sampling-parameter
mapping, output parsing into Completions, weight buckets streamed to the update call, and the
order of sleep / wake / update calls; plus the clear error when the package is missing.
What happens inside vLLM / SGLang is NOT tested here."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sglang import SGLangEngine, to_sglang_params
from megarl.rollout.vllm import VLLMEngine, to_vllm_kwargs
from megarl.rollout.vllm.worker import MegarlWorkerExtension

# ------------------------------------------------------------------------------- fakes


class RecordingLLM:
    """Stands in for vllm.LLM: records calls, answers generate from a script."""

    def __init__(self, script=None):
        self.calls: list[tuple] = []
        self.script = script

    def generate(self, requests, sampling_params, use_tqdm):
        self.calls.append(("generate", requests, sampling_params))
        return self.script(requests, sampling_params)

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method, [[(n, tuple(t.shape)) for n, t in a] for a in args]))
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


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


# ------------------------------------------------------------------------------- mapping


def test_vllm_sampling_mapping():
    sp = SamplingParams(n=4, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=33,
                        stop_token_ids=[5, 6], stop=["</s>"], seed=3, ignore_eos=True)
    assert to_vllm_kwargs(sp, seed=11) == {
        "n": 4, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_tokens": 33,
        "stop": ["</s>"], "stop_token_ids": [5, 6], "ignore_eos": True, "seed": 11,
        "logprobs": 0, "detokenize": True, "skip_special_tokens": False,
    }
    g = to_vllm_kwargs(SamplingParams(greedy=True, temperature=0.9, top_k=5, top_p=0.5,
                                      logprobs=False))
    assert (g["temperature"], g["top_k"], g["top_p"], g["logprobs"]) == (0.0, -1, 1.0, None)
    assert g["stop"] is None and g["stop_token_ids"] is None and g["detokenize"] is False


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


# ------------------------------------------------------------------------------- outputs


def _vllm_out(index, ids, lps, reason):
    steps = [{t: SimpleNamespace(logprob=lp, rank=1, decoded_token=None)} for t, lp in
             zip(ids, lps)]
    return SimpleNamespace(index=index, token_ids=ids, logprobs=steps, finish_reason=reason)


def test_vllm_generate_parses_and_seeds_per_prompt():
    def script(requests, params):
        outs = []
        for r in requests:  # each prompt: 2 samples, returned out of index order
            p = r["prompt_token_ids"]
            outs.append(SimpleNamespace(outputs=[
                _vllm_out(1, [p[-1], 2], [-0.5, -0.25], "stop"),
                _vllm_out(0, [7, 8, 9], [-1.0, -2.0, -3.0], "length"),
            ]))
        return outs

    llm = RecordingLLM(script)
    engine = VLLMEngine(llm=llm, sampling_params_cls=dict)
    out = engine.generate([[1, 4], [1, 5, 6]], SamplingParams(n=2, seed=9, max_new_tokens=3))
    assert [(c.prompt_index, c.token_ids, c.finish_reason) for c in out] == [
        (0, [7, 8, 9], "length"), (0, [4, 2], "stop"),
        (1, [7, 8, 9], "length"), (1, [6, 2], "stop")]
    torch.testing.assert_close(out[1].logprobs, torch.tensor([-0.5, -0.25]))
    (_, requests, params), = llm.calls
    assert requests == [{"prompt_token_ids": [1, 4]}, {"prompt_token_ids": [1, 5, 6]}]
    seeds = [p["seed"] for p in params]
    assert seeds[0] != seeds[1] and all(isinstance(s, int) for s in seeds)
    assert [p["n"] for p in params] == [2, 2]
    # same seed again -> same per-prompt seeds
    engine.generate([[1, 4], [1, 5, 6]], SamplingParams(n=2, seed=9, max_new_tokens=3))
    assert [p["seed"] for p in llm.calls[-1][2]] == seeds


def test_vllm_bad_outputs_raise():
    def aborted(requests, params):
        return [SimpleNamespace(outputs=[_vllm_out(0, [3], [-1.0], "abort")])]

    with pytest.raises(RuntimeError, match="abort"):
        VLLMEngine(llm=RecordingLLM(aborted), sampling_params_cls=dict).generate(
            [[1]], SamplingParams())

    def short(requests, params):
        o = _vllm_out(0, [3, 4], [-1.0, -1.0], "length")
        o.logprobs = o.logprobs[:1]
        return [SimpleNamespace(outputs=[o])]

    with pytest.raises(RuntimeError, match="logprob"):
        VLLMEngine(llm=RecordingLLM(short), sampling_params_cls=dict).generate(
            [[1]], SamplingParams())


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


# ------------------------------------------------------------------------------- weights


def test_vllm_update_streams_buckets_and_sleep_order():
    llm = RecordingLLM()
    engine = VLLMEngine(llm=llm, sampling_params_cls=dict, bucket_bytes=1000)  # 2 x 400 B
    engine.sleep()
    engine.update_weights(iter(_stream()))  # flat stream, bucketed by the adapter
    engine.wake()
    engine.sleep()
    engine.wake()
    kinds = [c[0] if c[0] != "rpc" else c[1] for c in llm.calls]
    assert kinds == ["sleep", "wake_up", "megarl_load_weights", "megarl_load_weights",
                     "megarl_load_weights", "megarl_finish_weights", "reset_prefix_cache",
                     "wake_up", "sleep", "wake_up"]
    assert llm.calls[0] == ("sleep", 1)
    assert llm.calls[1] == ("wake_up", ["weights"])  # weights back before loading them
    assert llm.calls[7] == ("wake_up", ["kv_cache"])  # then the cache
    assert llm.calls[9] == ("wake_up", None)  # a plain sleep/wake cycle
    buckets = [c[2][0] for c in llm.calls if c[0] == "rpc" and c[1] == "megarl_load_weights"]
    assert [len(b) for b in buckets] == [2, 2, 2]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in _stream()]


def test_vllm_update_keeps_given_buckets():
    llm = RecordingLLM()
    engine = VLLMEngine(llm=llm, sampling_params_cls=dict, bucket_bytes=10)
    s = _stream(5)
    engine.update_weights(iter([s[:3], s[3:]]))  # buckets from reshard pass through as they are
    loads = [c[2][0] for c in llm.calls if c[0] == "rpc" and c[1] == "megarl_load_weights"]
    assert [len(b) for b in loads] == [3, 2]


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


def test_worker_extension_loads_through_model():
    seen = []
    worker = MegarlWorkerExtension()
    worker.device = torch.device("cpu")
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(
        load_weights=lambda weights: seen.extend(weights)))
    assert worker.megarl_load_weights(_stream(3)) == 3
    assert [n for n, _ in seen] == [n for n, _ in _stream(3)]


# ------------------------------------------------------------------------------- missing


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_error():
    with pytest.raises(ImportError, match=r"pip install megarl\[vllm\]"):
        VLLMEngine("/nonexistent")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_missing_sglang_error():
    with pytest.raises(ImportError, match=r"pip install megarl\[sglang\]"):
        SGLangEngine("/nonexistent")


def test_builders_reach_the_adapters():
    """The trainer's build_engine maps rollout.name to these classes (and their from_config)."""
    from megarl.config import Config
    from megarl.trainer.builders import build_engine

    cfg = Config()
    for name in ("vllm", "sglang"):
        cfg.actor_rollout_ref.rollout.name = name
        if importlib.util.find_spec(name) is None:
            with pytest.raises(ImportError, match=rf"pip install megarl\[{name}\]"):
                build_engine(cfg, "/nonexistent", device="cpu")
