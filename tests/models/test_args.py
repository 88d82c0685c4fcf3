"""ModelArgs.from_hf_config on transformers-5 configs (written by transformers) and on the
transformers-4 / original-checkpoint layout (rope_theta + rope_scaling at top level)."""

from __future__ import annotations

import pytest

from megarl.models import (
    ModelArgs,
    UnsupportedModelError,
    num_labels_from_hf_config,
    read_hf_config,
)
from megarl.models.testing import tiny_hf_config

# A Llama-3.1-8B-style config.json in the original (transformers 4) layout, trimmed.
LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}


def test_llama31_v4_layout():
    args = ModelArgs.from_hf_config(LLAMA31_V4)
    assert (args.head_dim, args.n_rep, args.rope_theta, args.rms_norm_eps) == (128, 4, 5e5, 1e-5)
    assert args.rope_scaling.original_max_position_embeddings == 8192
    assert not (args.qkv_bias or args.o_bias or args.mlp_bias or args.qk_norm)
    old_key = dict(LLAMA31_V4, rope_scaling={**LLAMA31_V4["rope_scaling"], "type": "llama3"})
    del old_key["rope_scaling"]["rope_type"]
    assert ModelArgs.from_hf_config(old_key).rope_scaling == args.rope_scaling


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_transformers5_configs(tmp_path, family):
    config = tiny_hf_config(family, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    d = read_hf_config(tmp_path)
    args = ModelArgs.from_hf_config(d)
    assert args.hidden_size == 64 and args.num_key_value_heads == 2 and args.tie_word_embeddings
    assert args.head_dim == (24 if family == "qwen3" else 16)
    assert args.qkv_bias == (family == "qwen2") and not args.o_bias
    assert args.qk_norm == (family == "qwen3")
    assert (args.rope_scaling is not None) == (family == "llama3")
    assert args.rope_theta == config.rope_parameters["rope_theta"]
    assert args.hf_config == d


def test_qwen3_head_dim_default_and_explicit():
    base = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 10,
    }
    assert ModelArgs.from_hf_config(base).head_dim == 128  # transformers' Qwen3Config default
    assert ModelArgs.from_hf_config({**base, "head_dim": 32}).head_dim == 32
    assert ModelArgs.from_hf_config({**base, "model_type": "qwen2"}).head_dim == 16
    assert ModelArgs.from_hf_config(base).num_key_value_heads == 4  # defaults to MHA


def test_num_labels():
    assert num_labels_from_hf_config({"id2label": {"0": "a"}}) == 1
    assert num_labels_from_hf_config({"num_labels": 3, "id2label": {"0": "a"}}) == 3
    assert num_labels_from_hf_config({}) == 2


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"model_type": "gemma"}, UnsupportedModelError, "'gemma'.*llama, mistral, qwen2, qwen3"),
        ({"model_type": None}, UnsupportedModelError, "None"),
        ({"use_sliding_window": True}, UnsupportedModelError, "use_sliding_window"),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            UnsupportedModelError,
            "sliding_attention",
        ),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModelError, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ValueError, "low_freq_factor"),
        ({"vocab_size": None}, ValueError, "vocab_size"),
        ({"num_key_value_heads": 3}, ValueError, "multiple of num_key_value_heads"),
    ],
)
def test_bad_configs_are_refused_clearly(change, error, match):
    config = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 10,
        **change,
    }
    with pytest.raises(error, match=match):
        ModelArgs.from_hf_config(config)


def test_mistral_sliding_window_is_refused_unless_null():
    config = tiny_hf_config("mistral").to_dict()
    ModelArgs.from_hf_config(config)
    with pytest.raises(UnsupportedModelError, match='"sliding_window": null'):
        ModelArgs.from_hf_config({**config, "sliding_window": 4096})
