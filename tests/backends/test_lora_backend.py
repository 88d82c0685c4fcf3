"""The torch backend with LoRA (a world of one, fp32): only the adapters train and hold
optimizer state, the base stays bit for bit, the weights sent to engines are PEFT's merged
weights, the reference is the base model (the backend of a plain ``ref`` role), checkpoints
hold the adapters only and resume exactly."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from policy_batch import loss_fn, make_batch

from megarl.backends.torch import TorchBackend
from megarl.backends.torch.lora import apply_actor_lora
from megarl.backends.torch.lora_reference import AdapterOffReference
from megarl.errors import UserInputError
from megarl.models import load_model
from megarl.models.lora import LoraSettings, is_adapter_param
from megarl.trainer.settings import role_settings
from megarl.utils import dist as mdist

LORA = LoraSettings(rank=4, alpha=8.0, target_modules="all-linear", exclude_modules=["k_proj"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    mdist.init_distributed(torch.device("cpu"))
    return make_tiny_hf_model(tmp_path_factory.mktemp("lora") / "m", "qwen2", tokenizer=False,
                              lm_head_scale=3.0)


def actor(folder, **kw) -> TorchBackend:
    return TorchBackend("actor", str(folder), device="cpu", optim={"lr": 5e-2, "weight_decay": 0.0},
                        use_fused_kernels=False, lora=LORA, seed=3, **kw)


def train(backend: TorchBackend, steps: int) -> None:
    for k in range(steps):
        backend.train_step([make_batch(k)], loss_fn)


def adapters(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()
            if is_adapter_param(n)}


def test_only_adapters_train_and_hold_optimizer_state(folder):
    a = actor(folder)
    base = load_model(folder)  # the folder's weights, read independently
    names = [n for n, _ in a.model.named_parameters()]
    adapter_names = [n for n in names if is_adapter_param(n)]
    assert len(adapter_names) == 2 * 6 * 2  # q, v, o, gate, up, down x 2 layers, A and B
    opt_params = {id(p) for g in a.optimizer.param_groups for p in g["params"]}
    params = dict(a.model.named_parameters())
    assert opt_params == {id(params[n]) for n in adapter_names}
    before = adapters(a)
    train(a, 2)
    assert len(a.optimizer.state) == len(adapter_names)  # exp_avg etc. for the adapters only
    after = adapters(a)
    assert all(not torch.equal(before[n], after[n]) for n in adapter_names)
    for n, p in base.named_parameters():  # the base: bit for bit the folder's
        assert torch.equal(params[n], p), n


def test_exported_weights_are_peft_merged_weights(folder):
    a = actor(folder)
    train(a, 2)
    got = dict(a.export_weights())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = peft.get_peft_model(hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha,
                                                  target_modules=LORA.target_modules,
                                                  exclude_modules=LORA.exclude_modules))
    refp = dict(ref.named_parameters())
    with torch.no_grad():
        for n, t in adapters(a).items():
            module, ab = n.rsplit(".lora_", 1)
            refp[f"base_model.model.{module}.lora_{ab[0]}.default.weight"].copy_(t)
    want = ref.merge_and_unload().state_dict()
    assert list(got) == [n for n, _ in a.export_weights()]
    assert set(got) == set(want) and not any(is_adapter_param(n) for n in got)
    moved = 0
    for n, t in got.items():
        assert t.shape == want[n].shape and (t - want[n]).abs().max() <= 1e-6, n
        moved += not torch.equal(t, dict(load_model(folder).named_parameters())[n]) if (
            n.endswith("q_proj.weight")) else 0
    assert moved == 2  # the merged q_proj of both layers differs from the base
    sent = sum(t.numel() * t.element_size() for t in got.values())
    adapter = sum(t.numel() * t.element_size() for t in dict(a.export_adapter()).values())
    print(f"weights sent to the engine: {sent} bytes (merged); adapters: {adapter} bytes")
    assert sent == sum(t.numel() * t.element_size() for t in want.values())


def test_reference_is_the_base_model(folder):
    a = actor(folder)
    train(a, 2)
    ref = AdapterOffReference(a, forward_max_tokens=16, forward_micro_batch_size=None)
    plain = TorchBackend("ref", str(folder), device="cpu", dtype="fp32",
                         use_fused_kernels=False)
    batch = make_batch(7)
    got, _ = ref.logprobs(batch, temperature=0.7)
    want, _ = plain.logprobs(batch, temperature=0.7)
    assert torch.equal(got, want)
    trained, _ = a.logprobs(batch, temperature=0.7)  # adapters on again afterwards
    assert (trained - want).abs().max() > 1e-3
    assert a.forward_max_tokens == 16384  # the actor's own micro-batching is restored


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("lora_tied") / "m", "llama",
                              tokenizer=False, tie_word_embeddings=True)


def checkpoint_model_keys(directory) -> set[str]:
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in keys if k.startswith("model.")}


def test_checkpoint_of_tied_model_holds_adapters_only(tied_folder, tmp_path):
    a = actor(tied_folder)
    train(a, 1)
    a.save(str(tmp_path / "ck"))
    assert checkpoint_model_keys(tmp_path / "ck") == set(adapters(a))  # no lm_head alias
    b = actor(tied_folder)
    b.load(str(tmp_path / "ck"))
    assert all(torch.equal(adapters(b)[n], t) for n, t in adapters(a).items())


def test_checkpoint_holds_adapters_only_and_resumes_exactly(folder, tmp_path):
    a = actor(folder)
    train(a, 2)
    a.save(str(tmp_path / "ck"))
    assert checkpoint_model_keys(tmp_path / "ck") == set(adapters(a))
    b = actor(folder)
    b.load(str(tmp_path / "ck"))
    assert b.step == a.step == 2
    for n, t in adapters(a).items():
        assert torch.equal(adapters(b)[n], t)
    train(a, 1)
    b.train_step([make_batch(0)], loss_fn)  # the same third step as a's (batch seed 0)
    c = actor(folder)
    train(c, 2)
    c.train_step([make_batch(0)], loss_fn)
    for n, t in adapters(c).items():  # the uninterrupted run
        assert torch.equal(adapters(b)[n], t), n
    full = TorchBackend("actor", str(folder), device="cpu", use_fused_kernels=False)
    with pytest.raises(UserInputError, match="lora_rank"):
        full.load(str(tmp_path / "ck"))
    other = TorchBackend("actor", str(folder), device="cpu", use_fused_kernels=False,
                         lora=LoraSettings(rank=8, alpha=8.0))
    with pytest.raises(UserInputError, match="holds LoRA adapters.*lora_rank"):
        other.load(str(tmp_path / "ck"))


def test_moe_lora_is_refused(tmp_path):
    from megarl.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "moe", "qwen3_moe", tokenizer=False)
    with pytest.raises(UserInputError, match="mixture-of-experts"):
        actor(path)


def test_tensor_parallel_lora_is_refused(folder):
    from megarl.backends.torch.layout import Layout

    layout = Layout.resolve(2, tp=2, pp=1, dp_shard=-1, sp=False, ulysses=1)
    with pytest.raises(UserInputError, match="tensor_model_parallel_size=1"):
        apply_actor_lora(load_model(folder), LORA, layout, 0)


def test_config_keys_reach_the_backend():
    from megarl.backends.torch.config import backend_kwargs
    from megarl.config import load_config

    m = "actor_rollout_ref.model"
    cfg = load_config("grpo", [f"{m}.lora_rank=8", f"{m}.lora_alpha=16",
                               f"{m}.target_modules=all-linear"])
    assert backend_kwargs(role_settings("actor", cfg, "/x"))[1]["lora"] == LoraSettings(8, 16.0)
    assert "lora" not in backend_kwargs(role_settings("ref", cfg, "/x"))[1]
    cfg = load_config("grpo", [f"{m}.lora_rank=4",
                               f"{m}.target_modules=[q_proj,v_proj]",
                               f"{m}.exclude_modules=[model.layers.0.self_attn.q_proj]"])
    assert backend_kwargs(role_settings("actor", cfg, "/x"))[1]["lora"] == LoraSettings(
        4, 16.0, ["q_proj", "v_proj"], ["model.layers.0.self_attn.q_proj"])
    assert backend_kwargs(role_settings("actor", load_config("grpo"), "/x"))[1]["lora"] is None
    for key, value in (("lora_rank", -1), ("lora_alpha", 0)):
        bad = load_config("grpo", [f"{m}.lora_rank=8", f"{m}.{key}={value}"])
        with pytest.raises(UserInputError, match=f"{m}.{key}"):
            backend_kwargs(role_settings("actor", bad, "/x"))
