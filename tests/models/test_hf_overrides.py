"""verl's ``model.override_config`` merged into the HF config (`megarl.models.overrides`): the
model megarl builds from the overridden config computes transformers' logits with the same
override (float64), architecture-changing overrides are refused naming the key, and fields
megarl's model does not read are named in a notice. The reference is transformers' own model
built from its own config object with the override set on it."""

from __future__ import annotations

import pytest
import torch
import transformers

from megarl.models import ModelArgs, Transformer, read_hf_config
from megarl.models.hf_io import iter_hf_tensors
from megarl.models.overrides import (
    OverrideError,
    apply_hf_overrides,
    effective_overrides,
    merge_overrides,
    override_notices,
)
from megarl.models.state_dict_adapter import from_hf
from megarl.models.testing import make_tiny_hf_model

KEY = "actor_rollout_ref.model.override_config"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("overrides")
    return {fam: make_tiny_hf_model(root / fam, fam, tokenizer=False)
            for fam in ("qwen2", "llama3")}


def megarl_logits(path, override_config, ids):
    """Logits [B, T, V] (float64) of megarl's model built from config.json + the overrides."""
    args = ModelArgs.from_hf_config(read_hf_config(path, override_config))
    with torch.device("meta"):
        model = Transformer(args, head="lm", dtype=torch.float64)
    model.load_state_dict(from_hf(iter_hf_tensors(path, dtype=torch.float64), model),
                          assign=True)
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(ids)


def hf_logits(path, ids, **rope):
    """transformers' logits (float64), its config's RoPE parameters updated with ``rope``."""
    config = transformers.AutoConfig.from_pretrained(path)
    config.rope_parameters.update(rope)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config,
                                                              dtype=torch.float64).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# (family, override_config, the RoPE parameters transformers gets for it)
CASES = [
    ("qwen2", {"rope_theta": 500.0, "max_position_embeddings": 1024}, {"rope_theta": 500.0}),
    # verl's megatron spelling (under model_config) and a nested mapping merged key by key
    ("llama3", {"model_config": {"rope_parameters": {"factor": 2.0}, "rope_theta": 5e4}},
     {"factor": 2.0, "rope_theta": 5e4}),
]


@pytest.mark.parametrize(("family", "override", "rope"), CASES, ids=["qwen2", "llama3-nested"])
def test_overridden_model_matches_transformers_with_the_same_override(folders, family,
                                                                      override, rope):
    """Measured on the 2-core Xeon: |megarl - transformers| 0.0 for both (float64), while the
    override moves the logits by 2.7 (qwen2) / 1.3 (llama3). Planted: rope_theta written only
    at the top level (transformers 5's config.json reads it from rope_parameters) leaves
    megarl's logits 2.7 away."""
    path = folders[family]
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    expected = hf_logits(path, ids, **rope)
    got = megarl_logits(path, override, ids)
    assert (got - expected).abs().max() < 1e-10
    assert (hf_logits(path, ids) - expected).abs().max() > 1e-2  # the override matters
    assert (megarl_logits(path, None, ids) - expected).abs().max() > 1e-2


def test_max_position_embeddings_reaches_the_model_args(folders):
    args = ModelArgs.from_hf_config(read_hf_config(folders["qwen2"], {
        "max_position_embeddings": 4096}))
    assert args.max_position_embeddings == 4096
    assert args.hf_config["max_position_embeddings"] == 4096  # the saved config.json too


@pytest.mark.parametrize(("override", "named"), [
    ({"hidden_size": 128}, "hidden_size=128"),
    ({"num_hidden_layers": 3, "rope_theta": 1e4}, "num_hidden_layers=3"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"model_config": {"intermediate_size": 256}}, "intermediate_size=256"),
])
def test_overrides_that_change_the_weights_are_refused(folders, override, named):
    """Planted: without the shape check, hidden_size=128 builds a model the checkpoint's
    64-wide tensors do not fit (an error deep in loading), and tie_word_embeddings=True
    silently drops the trained lm_head."""
    with pytest.raises(OverrideError) as err:
        read_hf_config(folders["qwen2"], override)
    msg = str(err.value)
    assert msg.startswith(f"{KEY}: {named} changes the model's weights")
    assert "rope_theta" not in msg.split("changes")[0]  # only the culprit is named


def test_critic_key_is_named(folders):
    with pytest.raises(OverrideError, match=r"^critic\.model\.override_config: vocab_size=256"):
        read_hf_config(folders["qwen2"], {"vocab_size": 256},
                       key="critic.model.override_config")


def test_fields_megarl_does_not_read_get_a_notice(folders):
    config = read_hf_config(folders["qwen2"])
    override = {"use_cache": False, "attn_implementation": "sdpa", "rope_theta": 1e5,
                "my_custom_field": 3}
    merged = apply_hf_overrides(config, override)
    assert merged["my_custom_field"] == 3 and merged["use_cache"] is False  # passed through
    notices = override_notices(config, override)
    assert len(notices) == 1
    assert notices[0].startswith(f"{KEY}: use_cache=False, attn_implementation='sdpa', "
                                 "my_custom_field=3 changes nothing megarl's model reads")
    assert override_notices(config, {"rms_norm_eps": 1e-5}) == []


def test_merge_rules():
    assert effective_overrides(None) == {} and effective_overrides({}) == {}
    assert effective_overrides({"model_config": {"a": 1}, "b": 2}) == {"a": 1}
    assert effective_overrides({"b": 2}) == {"b": 2}
    with pytest.raises(OverrideError, match=rf"^{KEY}\.model_config=3: expected a mapping"):
        effective_overrides({"model_config": 3})
    # an explicit rope_parameters.rope_theta wins over the top-level spelling
    merged = apply_hf_overrides({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
                                 "intermediate_size": 8, "num_hidden_layers": 1,
                                 "num_attention_heads": 2,
                                 "rope_parameters": {"rope_theta": 1.0, "rope_type": "default"}},
                                {"rope_theta": 2.0, "rope_parameters": {"rope_theta": 3.0}})
    assert merged["rope_parameters"] == {"rope_theta": 3.0, "rope_type": "default"}
    assert merge_overrides({"rope_parameters": {"rope_theta": 1.0}},
                           {"rope_theta": 2.0, "rope_parameters": None}) == {
        "rope_parameters": None, "rope_theta": 2.0}
