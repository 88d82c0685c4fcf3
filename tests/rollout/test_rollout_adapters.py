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
