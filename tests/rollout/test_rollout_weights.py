"""update_weights from a full (bucketed) export stream, tied embeddings, errors, a shared
training model, sleep / wake (with weight offload), and from_config."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.models import load_model
from megarl.models.state_dict_adapter import model_state_for_export
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.reshard import weight_buckets
from megarl.rollout.torch import TorchRolloutEngine, WeightUpdateError, load_weight_stream
from megarl.trainer.settings import rollout_settings

SP = SamplingParams(n=2, max_new_tokens=10, temperature=0.9, seed=21)


def _gen(engine, prompts):
    return [c.token_ids for c in engine.generate(prompts, SP)]


@pytest.mark.parametrize("tied", [False, True])
def test_update_weights_from_stream(tied, tiny_folder):
    a = tiny_folder("llama", tie_word_embeddings=tied)
    b = tiny_folder("llama", tie_word_embeddings=tied, seed=1)
    prompts = prompts_of([4, 7], seed=3)
    want = _gen(TorchRolloutEngine.from_pretrained(b), prompts)
    engine = TorchRolloutEngine.from_pretrained(a)
    before = _gen(engine, prompts)
    assert before != want
    src = load_model(b)
    # the engine takes buckets as they come from reshard (and a flat stream as well)
    engine.update_weights(weight_buckets(model_state_for_export(src), bucket_bytes=20_000))
    assert _gen(engine, prompts) == want
    for name, t in src.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name
    if tied:
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    engine.update_weights(model_state_for_export(load_model(a)))
    assert _gen(engine, prompts) == before


def test_update_weights_errors(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"))
    full = list(model_state_for_export(load_model(tiny_folder("qwen2"))))
    with pytest.raises(WeightUpdateError, match="not a parameter"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", full[0][1])])
    name, t = full[1]
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.update_weights([(name, t[: t.shape[0] // 2])])
    with pytest.raises(WeightUpdateError, match="lacked"):
        engine.update_weights(full[:-1])
    with pytest.raises(WeightUpdateError, match="twice"):
        engine.update_weights(full + full[:1])
    engine.update_weights(full[:3], strict=False)  # a partial update is allowed when asked


def test_shared_model_no_copy(tiny_folder):
    model = load_model(tiny_folder("qwen2"))
    engine = TorchRolloutEngine(model, max_num_seqs=4)
    prompts = prompts_of([5], seed=1)
    before = _gen(engine, prompts)
    assert load_weight_stream(model, model_state_for_export(model)) == 0  # same storages
    with torch.no_grad():  # a "training step" on the shared model is seen at once
        model.lm_head.weight.mul_(-1.0)
    assert _gen(engine, prompts) != before


@pytest.mark.parametrize("offload", [False, True])
def test_sleep_wake(offload, tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen2", tie_word_embeddings=True),
                                                offload_weights_on_sleep=offload)
    prompts = prompts_of([5, 3], seed=2)
    before = _gen(engine, prompts)
    assert engine._cache is not None
    engine.sleep()
    assert engine._cache is None
    engine.wake()
    assert _gen(engine, prompts) == before
    engine.sleep()
    assert _gen(engine, prompts) == before  # generate wakes a sleeping engine
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def test_update_while_asleep_and_offloaded(tiny_folder):
    """The trainer's order (sleep, update_weights, wake, generate) with the weights offloaded:
    when update_weights returns, the offloaded host tensors already hold the new weights (on a
    GPU their copies from the trainer's GPU tensors into pinned memory are waited for before it
    returns), and the woken engine generates what an engine built from them does."""
    a, b = tiny_folder("qwen2"), tiny_folder("qwen2", seed=1)
    prompts = prompts_of([5, 3], seed=2)
    want = _gen(TorchRolloutEngine.from_pretrained(b), prompts)
    engine = TorchRolloutEngine.from_pretrained(a, offload_weights_on_sleep=True)
    assert _gen(engine, prompts) != want
    engine.sleep()
    src = load_model(b)
    engine.update_weights(model_state_for_export(src))
    for name, t in src.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name
    engine.wake()
    assert _gen(engine, prompts) == want


@pytest.mark.parametrize("dst, src, waited", [
    ("cpu", "cuda:1", "cuda:1"), ("cuda:0", "cpu", "cuda:0"),
    ("cuda:0", "cuda:0", None), ("cpu", "cpu", None), ("cuda:1", "cuda:0", None)])
def test_host_device_copies_are_waited_for(dst, src, waited):
    """load_weight_stream synchronises the stream of every GPU that a copy to or from host
    memory ran on (such a copy into pinned memory is still running when copy_ returns);
    copies between GPUs stay ordered on the stream and are not waited for."""
    from megarl.rollout.torch.weights import host_device_copy

    got = host_device_copy(torch.device(dst), torch.device(src))
    assert got == (None if waited is None else torch.device(waited))


def test_from_config(tiny_folder):
    from megarl.config import Config

    cfg = Config()
    cfg.actor_rollout_ref.model.dtype = "fp32"
    cfg.actor_rollout_ref.rollout.max_num_seqs = 3
    cfg.data.max_prompt_length, cfg.data.max_response_length = 16, 8
    path = str(tiny_folder("qwen2"))
    engine = TorchRolloutEngine.from_rollout_settings(rollout_settings(cfg), path, device="cpu")
    assert engine.max_num_seqs == 3 and engine.max_model_len == 24
    assert engine.dtype == torch.float32 and engine.eos_token_ids == [2]
    assert engine.tokenizer is not None and engine.tokenizer.eos_token_id == 2
    cfg.actor_rollout_ref.model.dtype = "bf16"
    engine = TorchRolloutEngine.from_rollout_settings(rollout_settings(cfg), path)
    assert engine.dtype == torch.bfloat16
    out = engine.generate(prompts_of([4], seed=0), SamplingParams(max_new_tokens=30, seed=1,
                                                                 ignore_eos=True))
    assert len(out[0].token_ids) == 20  # cut to max_model_len (16 + 8) - 4 prompt tokens


def test_kv_cache_budget_limits_slots(tiny_folder):
    """A byte cap smaller than max_num_seqs slots: fewer slots, same outputs; too small: error."""
    path = tiny_folder("qwen2")
    prompts = prompts_of([4, 6, 5], seed=5)
    sp = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=3)
    free = TorchRolloutEngine.from_pretrained(path, max_num_seqs=6)
    want = [c.token_ids for c in free.generate(prompts, sp)]
    # qwen2 tiny: 2 layers x 2 kv heads x 16 head dim x 4 bytes x 2 (k, v) = 512 B per position
    per_slot = 512 * (6 + 6)
    capped = TorchRolloutEngine.from_pretrained(path, max_num_seqs=6,
                                                kv_cache_bytes=2 * per_slot + 100)
    assert [c.token_ids for c in capped.generate(prompts, sp)] == want
    assert capped._cache.slots == 2
    tiny = TorchRolloutEngine.from_pretrained(path, kv_cache_bytes=per_slot - 1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        tiny.generate(prompts, sp)
