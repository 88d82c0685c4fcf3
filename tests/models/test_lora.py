"""megarl's LoRA (`megarl.models.lora`) against PEFT on transformers' own Llama / Qwen2, in
float64: the same folder loaded by transformers (+ ``peft.get_peft_model``) and by
`megarl.models.load_model` (+ `apply_lora`), the same adapter tensors in both."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from megarl.errors import UserInputError
from megarl.models import load_model
from megarl.models.lora import (
    LoRALinear,
    LoraSettings,
    adapter_state_dict,
    adapters_disabled,
    apply_lora,
    merged_state_dict,
    save_merged,
    save_peft_adapter,
)

TOL = 1e-6
F64 = torch.float64
FAMILIES = ["llama", "qwen2"]  # qwen2: q/k/v biases under the adapters
# (target_modules, exclude_modules) as verl passes them to PEFT
SELECTIONS = [
    ("all-linear", None),
    (["q_proj", "v_proj"], None),
    ("all-linear", ["k_proj", "model.layers.1.mlp.down_proj"]),
    (r".*\.layers\.0\..*_proj", r".*up_proj"),
    (["o_proj", "gate_proj"], r"model\.layers\.0\..*"),
]


def peft_pair(folder, rank=4, alpha=8.0, target="all-linear", exclude=None, seed=0,
              dropout=0.0):
    """(peft model, our model, adapted names): same base, same non-zero adapter tensors."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=F64)
    ref = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                                  target_modules=target,
                                                  exclude_modules=exclude))
    ours = load_model(folder, dtype=F64)
    names = apply_lora(ours, rank, alpha, target, exclude, dropout)
    gen = torch.Generator().manual_seed(seed)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in adapter_state_dict(ours).items():
            module, ab = name.rsplit(".lora_", 1)
            ab = ab.split(".")[0]
            value = 0.3 * torch.randn(p.shape, generator=gen, dtype=F64)  # B != 0
            p.copy_(value)
            ref_params[f"base_model.model.{module}.lora_{ab}.default.weight"].copy_(value)
    return ref, ours, names


def batch(vocab=128, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (2, 9), generator=gen)


def peft_targets(ref) -> list[str]:
    return sorted(n.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]
                  for n, _ in ref.named_parameters() if ".lora_A." in n)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_adapter_grads_match_peft(hf_folder, family):
    ref, ours, names = peft_pair(hf_folder(family))
    ids = batch()
    got = ours(ids)
    want = ref(input_ids=ids).logits
    assert (got - want).abs().max() <= TOL
    # the adapters move the logits well beyond the tolerance
    with torch.no_grad(), adapters_disabled(ours):
        assert (ours(ids) - want).abs().max() > 1e-2
    weights = torch.linspace(-1, 1, got.shape[-1], dtype=F64)
    (torch.log_softmax(got, -1) * weights).sum().backward()
    (torch.log_softmax(want, -1) * weights).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ours_params = dict(ours.named_parameters())
    assert len(ref_grads) == 2 * len(names) == sum(p.requires_grad for p in ours_params.values())
    for name in names:
        for ab in "AB":
            g = ours_params[f"{name}.lora_{ab}.weight"].grad
            assert g is not None and g.abs().max() > 1e-4
            assert (g - ref_grads[f"base_model.model.{name}.lora_{ab}.default.weight"]).abs().max() <= TOL
    # the base is frozen: no gradient anywhere outside the adapters
    assert all(p.grad is None for n, p in ours_params.items() if ".lora_" not in n)


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_drops_what_peft_drops_in_training_only(hf_folder, family):
    """lora_dropout 0.3 on every adapter's input: in train mode, from the same generator state,
    the logits and every adapter gradient equal PEFT's (the same masks, drawn in the same module
    order); in eval mode the adapters run whole (the logits of the dropout-free pair)."""
    folder = hf_folder(family)
    ref, ours, names = peft_pair(folder, dropout=0.3)
    _, plain, _ = peft_pair(folder)
    ids = batch()
    ref.train()
    ours.train()
    torch.manual_seed(11)
    got = ours(ids)
    torch.manual_seed(11)
    want = ref(input_ids=ids).logits
    assert (got - want).abs().max() <= TOL
    with torch.no_grad():
        whole = plain(ids)
        assert (got - whole).abs().max() > 1e-2  # the masks did drop something
        torch.manual_seed(12)  # another draw drops other elements
        assert (ours(ids) - got).abs().max() > 1e-2
        ours.eval()
        assert torch.equal(ours(ids), whole)
    weights = torch.linspace(-1, 1, got.shape[-1], dtype=F64)
    (torch.log_softmax(got, -1) * weights).sum().backward()
    (torch.log_softmax(want, -1) * weights).sum().backward()
    ref_params, ours_params = dict(ref.named_parameters()), dict(ours.named_parameters())
    for name in names:
        for ab in "AB":
            g = ours_params[f"{name}.lora_{ab}.weight"].grad
            r = ref_params[f"base_model.model.{name}.lora_{ab}.default.weight"].grad
            assert g.abs().max() > 1e-4 and (g - r).abs().max() <= TOL, (name, ab)


def test_post_dropout_drops_the_adapter_output():
    """dropout_position post (Megatron-Bridge's): y = W x + b + s * dropout(B A x), in float64
    against the adapter's output masked by the draw F.dropout makes from the same state; the
    base output is never dropped."""
    gen = torch.Generator().manual_seed(2)
    base = torch.nn.Linear(6, 5, dtype=F64)
    layer = LoRALinear(base, 3, 6.0, 0.5, generator=gen, init_b="normal",
                       dropout_position="post")
    x = torch.randn(4, 7, 6, generator=gen, dtype=F64)
    torch.manual_seed(3)
    got = layer(x)
    delta = (x @ layer.lora_A.weight.t() @ layer.lora_B.weight.t()).detach()
    torch.manual_seed(3)
    kept = torch.nn.functional.dropout(torch.ones_like(delta), 0.5)
    want = base(x) + delta * kept * 2.0
    assert (got - want).abs().max() <= 1e-12
    assert 0 < int((kept == 0).sum()) < kept.numel()
    layer.eval()
    assert (layer(x) - (base(x) + 2.0 * delta)).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="dropout_position"):
        LoRALinear(base, 3, 6.0, 0.5, dropout_position="middle")


@pytest.mark.parametrize("family", FAMILIES)
def test_disabled_adapters_are_the_base_model(hf_folder, family):
    folder = hf_folder(family)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=F64)
    ref, ours, _ = peft_pair(folder)
    ids = batch()
    with torch.no_grad():
        want = base(input_ids=ids).logits
        with adapters_disabled(ours):
            off = ours(ids)
        with ref.disable_adapter():
            peft_off = ref(input_ids=ids).logits
        on = ours(ids)  # enabled again after the context
    assert (off - want).abs().max() <= TOL
    assert (peft_off - want).abs().max() <= TOL
    assert (on - want).abs().max() > 1e-2


@pytest.mark.parametrize(("target", "exclude"), SELECTIONS)
def test_selection_matches_peft(hf_folder, target, exclude):
    ref, ours, names = peft_pair(hf_folder("qwen2"), target=target, exclude=exclude)
    assert sorted(names) == peft_targets(ref)
    assert all(isinstance(ours.get_submodule(n), LoRALinear) for n in names)


def test_all_linear_never_takes_the_head(hf_folder):
    _, ours, names = peft_pair(hf_folder("llama", tie_word_embeddings=True))
    assert "lm_head" not in names and len(names) == 7 * ours.args.num_hidden_layers


def test_fresh_adapter_changes_nothing_and_init_is_peft_like(hf_folder):
    folder = hf_folder("llama")
    ours = load_model(folder, dtype=F64)
    ids = batch()
    with torch.no_grad():
        before = ours(ids)
        apply_lora(ours, 8, 16, "all-linear")
        after = ours(ids)
    assert torch.equal(before, after)
    q = ours.get_submodule("model.layers.0.self_attn.q_proj")
    assert torch.count_nonzero(q.lora_B.weight) == 0
    bound = 1 / q.in_features**0.5  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
    a = q.lora_A.weight
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound and a.std() > 0.4 * bound
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)


def test_bad_selection_is_one_clear_error(hf_folder):
    ours = load_model(hf_folder("llama"), dtype=F64)
    with pytest.raises(UserInputError, match="target_modules.*selects no module"):
        apply_lora(ours, 4, 8, ["qkv_proj"])
    with pytest.raises(UserInputError, match="not a linear layer"):
        apply_lora(ours, 4, 8, ["input_layernorm"])
    with pytest.raises(UserInputError, match="lora_rank"):
        apply_lora(ours, 0, 8)


def test_merged_state_dict_is_the_adapted_model(hf_folder, tmp_path):
    """Folded weights in a plain HF folder: transformers (no PEFT) gives the adapted logits."""
    folder = hf_folder("qwen2")
    ref, ours, _ = peft_pair(folder)
    ids = batch()
    merged = merged_state_dict(ours)
    base = dict(ours.named_parameters())
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(merged[f"{q}.weight"], base[f"{q}.weight"])
    assert torch.equal(merged[f"{q}.bias"], base[f"{q}.bias"])
    assert not any(".lora_" in n for n in merged)
    out = save_merged(ours, tmp_path / "merged", source_dir=folder)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=F64)
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max() <= TOL


@pytest.mark.parametrize(("family", "target", "exclude"),
                         [("llama", "all-linear", None), ("qwen2", "all-linear", ["k_proj"]),
                          ("qwen2", ["q_proj", "down_proj"], None)])
def test_peft_loads_our_adapter_folder(hf_folder, tmp_path, family, target, exclude):
    folder = hf_folder(family)
    _, ours, names = peft_pair(folder, rank=3, alpha=5.0, target=target, exclude=exclude)
    settings = LoraSettings(rank=3, alpha=5.0, target_modules=target, exclude_modules=exclude)
    out = save_peft_adapter(tmp_path / "adapter", adapter_state_dict(ours), settings,
                            base_model_name_or_path=str(folder))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 3 and config["lora_alpha"] == 5.0 and config["peft_type"] == "LORA"
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert f"base_model.model.{names[0]}.lora_A.weight" in keys and len(keys) == 2 * len(names)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=F64)
    loaded = peft.PeftModel.from_pretrained(hf_base, out)
    assert peft_targets(loaded) == sorted(names)
    ids = batch(seed=3)
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - ours(ids)).abs().max() <= TOL
