"""The SGLang adapter up to the engine boundary. SGLang cannot run here (no CPU wheel; it pins
a CUDA torch), so these tests cover the adapter's own logic against a recording fake: sampling
parameters and seeds, output parsing into Completions, weight buckets, the order of memory
calls, GPU placement and the release check. Whether each call exists in the real package is
checked by test_sglang_contract.py."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from megarl.config import Config
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sglang import SGLangEngine, to_sglang_params
from megarl.rollout.sglang import engine as sglang_engine
from megarl.trainer.settings import rollout_settings


class RecordingSGLang:
    def __init__(self, script=None, status=(True, "ok")):
        self.calls: list[tuple] = []
        self.script = script or _echo
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


def _echo(input_ids, params):
    """One generated token per request (the prompt's last), then a stop."""
    return [{"output_ids": [ids[-1]],
             "meta_info": {"output_token_logprobs": [(-0.5, ids[-1], None)],
                           "finish_reason": {"type": "stop"}}} for ids in input_ids]


def _stream(n=6, numel=100):
    return [(f"model.layers.{i}.w", torch.zeros(numel)) for i in range(n)]


def _seeds(eng: RecordingSGLang) -> list[int]:
    return [p["sampling_seed"] for p in eng.calls[-1][2]]


class FakeEngineCls:
    """``sglang.Engine`` of a fake sglang module: keeps its constructor's keywords."""

    built: list[dict] = []

    def __init__(self, **kwargs):
        FakeEngineCls.built.append(kwargs)


@pytest.fixture
def fake_sglang(monkeypatch):
    """A fake ``sglang`` module (release 0.5.23) whose Engine records how it was built."""
    FakeEngineCls.built = []
    module = types.SimpleNamespace(__version__="0.5.23", Engine=FakeEngineCls)
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.delenv(sglang_engine.ORIGINAL_LOGPROB_ENV, raising=False)
    return module


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


def test_sglang_seeds_follow_prompt_keys():
    """A request's seed is a function of (seed, prompt key, sample index): the same prompt key
    gets the same seeds in whatever call and position it comes; the default key is the
    prompt's position."""
    eng = RecordingSGLang()
    engine = SGLangEngine(engine=eng)
    sp = SamplingParams(n=2, seed=5)
    engine.generate([[1], [2], [3]], sp, prompt_keys=[10, 11, 12])
    batch = _seeds(eng)
    engine.generate([[3]], sp, prompt_keys=[12])
    assert _seeds(eng) == batch[4:6]
    engine.generate([[1], [2]], sp)
    positional = _seeds(eng)
    engine.generate([[2]], sp, prompt_keys=[1])
    assert _seeds(eng) == positional[2:4] and positional[:2] != batch[:2]
    engine.generate([[3]], SamplingParams(n=2, seed=6), prompt_keys=[12])
    assert _seeds(eng) != batch[4:6]
    with pytest.raises(ValueError, match="one key per prompt"):
        engine.generate([[1], [2]], sp, prompt_keys=[1])


def test_sglang_unseeded_requests_still_differ():
    """Under deterministic inference SGLang gives an unseeded request one fixed default seed;
    the adapter draws a fresh seed per call instead, so the n samples differ."""
    eng = RecordingSGLang()
    engine = SGLangEngine(engine=eng)
    engine.generate([[1]], SamplingParams(n=4))
    first = _seeds(eng)
    engine.generate([[1]], SamplingParams(n=4))
    assert len(set(first)) == 4 and _seeds(eng) != first
    engine.generate([[1]], SamplingParams(n=1, greedy=True))
    assert "sampling_seed" not in eng.calls[-1][2][0]


def test_sglang_says_once_that_seeds_are_ignored(caplog):
    engine = SGLangEngine(engine=RecordingSGLang(), enable_deterministic_inference=False)
    assert not engine.seeds_effective
    with caplog.at_level(logging.WARNING, logger=sglang_engine.__name__):
        engine.generate([[1]], SamplingParams(seed=1))
        engine.generate([[1]], SamplingParams(seed=2))
    assert [r.getMessage() for r in caplog.records].count(
        "SGLang ignores sampling seeds: the engine runs without enable_deterministic_inference, "
        "so its samples are not reproducible") == 1


def test_sglang_update_and_memory_order():
    eng = RecordingSGLang()
    engine = SGLangEngine(engine=eng, bucket_bytes=1000)
    engine.update_weights(iter(_stream()))
    engine.sleep()
    assert engine.asleep
    engine.sleep()  # a second sleep releases nothing more
    engine.update_weights(iter(_stream(2)))
    engine.wake()
    assert not engine.asleep
    kinds = [c[0] for c in eng.calls]
    assert kinds == ["update", "update", "update", "flush_cache", "release", "resume", "update",
                     "flush_cache", "resume"]
    assert all(c[2] is False for c in eng.calls if c[0] == "update")
    assert eng.calls[4] == ("release", ["weights", "kv_cache", "cuda_graph"])
    assert eng.calls[5] == ("resume", ["weights"])
    assert eng.calls[8] == ("resume", ["kv_cache", "cuda_graph"])
    with pytest.raises(RuntimeError, match="failed: boom"):
        SGLangEngine(engine=RecordingSGLang(status=(False, "boom"))).update_weights(_stream(1))


def test_sglang_generate_after_a_weight_sync_wakes_the_rest():
    eng = RecordingSGLang()
    engine = SGLangEngine(engine=eng)
    engine.sleep()
    engine.update_weights(_stream(1))
    engine.generate([[1]], SamplingParams(seed=0))
    assert [c[0] for c in eng.calls] == ["release", "resume", "update", "flush_cache", "resume",
                                         "generate"]
    assert eng.calls[4] == ("resume", ["kv_cache", "cuda_graph"])


def test_sglang_refuses_to_run_on_released_weights():
    """Released weights have no backup: waking or generating before a weight sync fails."""
    eng = RecordingSGLang()
    engine = SGLangEngine(engine=eng)
    engine.sleep()
    with pytest.raises(RuntimeError, match="without update_weights"):
        engine.wake()
    with pytest.raises(RuntimeError, match="without update_weights"):
        engine.generate([[1]], SamplingParams())
    assert [c[0] for c in eng.calls] == ["release"]


def test_sglang_gpu_placement_from_local_rank():
    """Each rank's engine starts on its own GPU; with TP the group's first GPU."""
    cfg = Config()
    one = rollout_settings(cfg)
    assert [sglang_engine.engine_kwargs(one, r)["base_gpu_id"] for r in (0, 1)] == [0, 1]
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    rs = rollout_settings(cfg)
    kwargs = [sglang_engine.engine_kwargs(rs, r, local_world_size=4) for r in range(4)]
    assert [k["base_gpu_id"] for k in kwargs] == [0, 0, 2, 2]
    assert {(k["tp_size"], k["gpu_id_step"]) for k in kwargs} == {(2, 1)}
    assert [sglang_engine.hosts_engine(r, 2) for r in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="divides --nproc_per_node"):
        sglang_engine.engine_kwargs(rs, 0, local_world_size=3)


def test_sglang_from_config_builds_on_its_rank(fake_sglang):
    cfg = Config()
    cfg.actor_rollout_ref.model.tokenizer_path = "/tok"
    for rank in (0, 1):
        SGLangEngine.from_rollout_settings(rollout_settings(cfg), "/model",
                                           env={"LOCAL_RANK": str(rank)})
    first, second = FakeEngineCls.built
    assert (first["base_gpu_id"], second["base_gpu_id"]) == (0, 1)
    assert first["model_path"] == "/model" and first["tokenizer_path"] == "/tok"
    assert first["enable_memory_saver"] is True
    assert first["enable_deterministic_inference"] is True


def test_sglang_tp_group_member_hosts_no_engine(fake_sglang):
    """With TP 2, rank 1 belongs to rank 0's engine: it builds none, generates nothing, and
    reads the whole weight stream (its collectives run) without loading it."""
    cfg = Config()
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    member = SGLangEngine.from_rollout_settings(rollout_settings(cfg), "/model",
                                                env={"LOCAL_RANK": "1",
                                                           "LOCAL_WORLD_SIZE": "2"})
    assert FakeEngineCls.built == []
    read = []

    def stream():
        for name, t in _stream(3):
            read.append(name)
            yield name, t

    member.sleep()
    assert member.asleep  # in step with the host's engine (the trainer reads it)
    member.update_weights(stream())
    assert len(read) == 3
    assert member.generate([[1, 2]], SamplingParams(n=2, seed=0)) == []
    assert not member.asleep
    SGLangEngine.from_rollout_settings(rollout_settings(cfg), "/model",
                                       env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert [k["base_gpu_id"] for k in FakeEngineCls.built] == [0]


def test_sglang_release_outside_the_supported_range(fake_sglang):
    fake_sglang.__version__ = "0.4.6"
    with pytest.raises(ImportError, match=r"sglang 0\.4\.6 is installed, but megarl supports "
                                          r"sglang>=0\.5\.5,<0\.6"):
        SGLangEngine("/model")
    assert FakeEngineCls.built == []  # refused before any other sglang call


def test_missing_sglang_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang raises, installed or not
    with pytest.raises(ImportError, match=r"pip install megarl\[sglang\]"):
        SGLangEngine("/nonexistent")
