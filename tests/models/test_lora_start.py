"""How the actor's LoRA adapters start on the torch backend: verl's ``lora_A_init_method`` /
``lora_B_init_method`` draws (Megatron-Bridge's ``get_init_fn``: xavier = ``xavier_normal_``,
kaiming = ``kaiming_uniform_(a=sqrt(5))``, normal = N(0, 0.2), zero) against seeded
``torch.nn.init`` calls and their textbook spreads, and ``lora_adapter_path``: a PEFT folder
(made with peft, B != 0) read through the config gives the logits of
``peft.PeftModel.from_pretrained`` on transformers, in float64."""

from __future__ import annotations

import json
import math

import peft
import pytest
import torch
import transformers
from torch import nn

from megarl.backends.torch.layout import Layout
from megarl.backends.torch.lora import apply_actor_lora
from megarl.config.loader import resolve_config
from megarl.errors import UserInputError
from megarl.models import load_model
from megarl.models.lora import LoRALinear, adapter_settings, adapters_disabled
from megarl.models.testing import make_tiny_hf_model, save_random_peft_adapter
from megarl.trainer.settings import lora_settings, role_settings

F64 = torch.float64
REFERENCE = {  # Megatron-Bridge's get_init_fn, spelled with torch.nn.init
    "xavier": lambda t, g: nn.init.xavier_normal_(t, generator=g),
    "kaiming": lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g),
    "normal": lambda t, g: nn.init.normal_(t, 0.0, 0.2, generator=g),
    "zero": lambda t, g: nn.init.zeros_(t),
}


@pytest.mark.parametrize("init_a, init_b", [("xavier", "zero"), ("kaiming", "zero"),
                                            ("normal", "xavier"), ("zero", "kaiming")])
def test_init_methods_are_the_seeded_torch_draws(init_a, init_b):
    """A then B from one generator, exactly as the seeded torch.nn.init calls. Planted:
    xavier_uniform_ for xavier (same std, other values) or B drawn before A fails."""
    base = nn.Linear(48, 40, bias=False, dtype=F64)
    m = LoRALinear(base, 6, 12.0, generator=torch.Generator().manual_seed(7), init_a=init_a,
                   init_b=init_b)
    g = torch.Generator().manual_seed(7)
    a, b = torch.empty(6, 48, dtype=F64), torch.empty(40, 6, dtype=F64)
    REFERENCE[init_a](a, g)
    REFERENCE[init_b](b, g)
    assert torch.equal(m.lora_A.weight, a) and torch.equal(m.lora_B.weight, b)


def test_init_spreads_are_the_textbook_ones():
    """xavier: std sqrt(2 / (in + r)); kaiming(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), std
    1/sqrt(3 in); normal: std 0.2 (4000 x 8 draws: within 3%)."""
    base = nn.Linear(4000, 16, bias=False, dtype=F64)
    want = {"xavier": math.sqrt(2 / 4008), "kaiming": 1 / math.sqrt(3 * 4000), "normal": 0.2}
    for method, std in want.items():
        m = LoRALinear(base, 8, 16.0, generator=torch.Generator().manual_seed(1), init_a=method)
        a = m.lora_A.weight.detach()
        assert abs(float(a.std()) / std - 1) < 0.03, method
        assert abs(float(a.mean())) < 0.05 * std, method
    kaiming = LoRALinear(base, 8, 16.0, init_a="kaiming").lora_A.weight
    assert float(kaiming.abs().max()) <= 1 / math.sqrt(4000)


def _peft_folder(tmp_path, target=("q_proj", "v_proj", "down_proj"), **extra):
    """(model folder, adapter folder, token ids): a PEFT adapter with random non-zero A and B,
    saved by peft."""
    folder = make_tiny_hf_model(tmp_path / "m", "qwen2", "lm", 2)
    adapter, g = save_random_peft_adapter(folder, tmp_path / "adapter", list(target), **extra)
    return folder, adapter, torch.randint(3, 128, (2, 9), generator=g)


def test_adapter_path_gives_peft_logits(tmp_path):
    """The config's lora_adapter_path (lora_rank 0: the folder's r and alpha, as verl) starts
    the actor at PEFT's model: float64 logits within 1e-9. Planted: alpha from the config (16
    instead of the folder's 12), A and B transposed, or the folder ignored: off by > 1e-2."""
    folder, adapter, ids = _peft_folder(tmp_path)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        "data: {train_files: t.parquet, train_batch_size: 8, max_response_length: 64}\n"
        f"actor_rollout_ref: {{model: {{path: {folder}, lora_adapter_path: {adapter}}}, "
        "actor: {ppo_mini_batch_size: 8}, rollout: {n: 2}}\nalgorithm: {adv_estimator: grpo}\n")
    settings = lora_settings(resolve_config(str(cfg_file)).config)
    assert (settings.rank, settings.alpha) == (4, 12.0)
    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=F64), adapter)
    ours = load_model(folder, dtype=F64)
    apply_actor_lora(ours, settings, Layout(pp=1, dp_shard=1, tp=1, sp=False), seed=0)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids)
        assert (got - want).abs().max() <= 1e-9
        with adapters_disabled(ours):
            assert (ours(ids) - want).abs().max() > 1e-2
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == sorted(
        f"model.layers.{i}.{m}.lora_{ab}.weight" for i in range(ours.args.num_hidden_layers)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for ab in "AB")


def test_torch_backend_from_config_starts_from_the_adapter_folder(tmp_path):
    """The trainer's path (TorchBackend.from_settings): the actor's adapters are the folder's
    tensors (planted: the folder ignored, B drawn as zeros: fails) and only they train."""
    from safetensors.torch import load_file

    from megarl.backends.torch import TorchBackend
    from megarl.utils.dist import init_distributed

    init_distributed(torch.device("cpu"))  # a world of one
    folder, adapter, _ = _peft_folder(tmp_path)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        "data: {train_files: t.parquet, train_batch_size: 8, max_response_length: 64}\n"
        f"actor_rollout_ref: {{model: {{path: {folder}, lora_adapter_path: {adapter}}}, "
        "actor: {ppo_mini_batch_size: 8}, rollout: {n: 2}}\nalgorithm: {adv_estimator: grpo}\n")
    cfg = resolve_config(str(cfg_file)).config
    actor = TorchBackend.from_settings(role_settings("actor", cfg, str(folder)))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    trained = {n: p for n, p in actor.model.named_parameters() if p.requires_grad}
    assert len(trained) == len(saved) > 0
    for name, t in saved.items():
        ours = name.removeprefix("base_model.model.")
        got = trained[ours].detach()
        got = got.full_tensor() if hasattr(got, "full_tensor") else got  # FSDP2's DTensor
        assert torch.equal(got.cpu(), t.to(got.dtype)), name  # the folder is float64


def test_an_adapter_saved_with_dropout_starts_the_run(tmp_path):
    """Most SFT adapters are trained with lora_dropout 0.05 or 0.1 (and megarl's own saves
    record the run's): such a folder loads, and the actor starts at PEFT's eval-mode model
    (dropout off) within 1e-9. Before: refused ("lora_dropout=0.05; megarl trains plain LoRA
    adapters")."""
    folder, adapter, ids = _peft_folder(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.05}))
    settings = adapter_settings(adapter, 0, 16.0)
    assert settings.dropout == 0.0  # the run's own (verl's default), not the folder's
    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=F64), adapter).eval()
    assert ref.peft_config["default"].lora_dropout == 0.05
    ours = load_model(folder, dtype=F64)
    apply_actor_lora(ours, settings, Layout(pp=1, dp_shard=1, tp=1, sp=False), seed=0)
    with torch.no_grad():
        assert (ours(ids) - ref(input_ids=ids).logits).abs().max() <= 1e-9


def test_adapter_path_refusals_name_the_key(tmp_path):
    folder, adapter, _ = _peft_folder(tmp_path)
    with pytest.raises(UserInputError, match=r"lora_rank=8 .* has r=4"):
        adapter_settings(adapter, 8, 12.0)
    with pytest.raises(UserInputError, match=r"lora_alpha=16.0 .* has lora_alpha=12"):
        adapter_settings(adapter, 4, 16.0)
    assert adapter_settings(adapter, 4, 12.0).rank == 4
    with pytest.raises(UserInputError, match="lora_adapter_path=.*does not exist"):
        adapter_settings(tmp_path / "nowhere", 0, 16.0)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(UserInputError, match="lora_adapter_path=.*use_dora=True"):
        adapter_settings(adapter, 0, 16.0)
    # an adapter of other modules than the folder's config names: the tensors do not match
    (adapter / "adapter_config.json").write_text(json.dumps({**config,
                                                             "target_modules": ["o_proj"]}))
    ours = load_model(folder, dtype=F64)
    with pytest.raises(UserInputError, match="lora_adapter_path=.*do not match"):
        apply_actor_lora(ours, adapter_settings(adapter, 0, 16.0),
                         Layout(pp=1, dp_shard=1, tp=1, sp=False), seed=0)
