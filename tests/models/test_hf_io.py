"""HF folder I/O: round trips are bit-identical, shards match transformers', errors are clear."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from huggingface_hub import split_torch_state_dict_into_shards
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from megarl.models import (
    CheckpointMismatchError,
    UnsupportedModelError,
    iter_hf_tensors,
    load_hf_state_dict,
    load_model,
    read_hf_config,
    save_hf_checkpoint,
    save_model,
)
from megarl.models.testing import make_tiny_hf_model

INDEX = "model.safetensors.index.json"


def weight_files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def assert_same_weights(a, b):
    """Same weight files, and per file the same names, dtypes, shapes and bits (read with
    safetensors directly, not with our loader)."""
    assert weight_files(a) == weight_files(b)
    for f in weight_files(a):
        ta, tb = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
        assert list(sorted(ta)) == list(sorted(tb)), f
        for name in ta:
            assert ta[name].dtype == tb[name].dtype, name
            assert torch.equal(ta[name], tb[name]), name
    if os.path.exists(os.path.join(a, INDEX)):
        with open(os.path.join(a, INDEX)) as fa, open(os.path.join(b, INDEX)) as fb:
            assert json.load(fa) == json.load(fb)


@pytest.mark.parametrize(
    ("family", "head", "shard", "dtype", "overrides"),
    [
        ("qwen2", "lm", None, torch.float32, {}),
        ("llama", "lm", None, torch.bfloat16, {"tie_word_embeddings": True}),
        ("qwen3", "lm", "20KB", torch.float32, {}),
        ("qwen2", "token_cls", "15KB", torch.bfloat16, {}),
        ("llama3", "lm", "9KB", torch.float32, {"tie_word_embeddings": True}),  # oversize tensors
    ],
)
def test_round_trip_bit_identical(tmp_path, family, head, shard, dtype, overrides):
    src = make_tiny_hf_model(
        tmp_path / "src", family, head, max_shard_size=shard, dtype=dtype, **overrides
    )
    assert (shard is None) == (not os.path.exists(src / INDEX))
    tensors = load_hf_state_dict(src)
    assert all(t.dtype == dtype for t in tensors.values())
    out = save_hf_checkpoint(
        tmp_path / "out",
        tensors,
        read_hf_config(src),
        max_shard_size_bytes=shard or 5 * 10**9,
        source_dir=src,
    )
    assert_same_weights(src, out)
    assert read_hf_config(out) == read_hf_config(src)
    aux = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    aux += ["generation_config.json"] if head == "lm" else []
    for name in aux:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    # streaming save from an iterator of our loader gives the same folder
    streamed = save_hf_checkpoint(
        tmp_path / "streamed",
        iter_hf_tensors(src),
        read_hf_config(src),
        max_shard_size_bytes=shard or 5 * 10**9,
    )
    assert_same_weights(src, streamed)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp leftovers


@pytest.mark.parametrize(
    ("family", "head", "num_labels", "overrides", "shard"),
    [
        ("qwen2", "lm", 2, {"tie_word_embeddings": True}, None),
        ("qwen3", "lm", 2, {}, "25KB"),
        ("llama3", "token_cls", 1, {}, None),
        ("mistral", "token_cls", 2, {}, "30KB"),
    ],
)
def test_saved_model_loads_in_transformers(tmp_path, family, head, num_labels, overrides, shard):
    src = make_tiny_hf_model(tmp_path / "src", family, head, num_labels, **overrides)
    ours = load_model(src, head=head)
    out = save_model(ours, tmp_path / "out", source_dir=src, max_shard_size_bytes=shard or "5GB")
    if shard is None:
        assert_same_weights(src, out)  # same single file as save_pretrained
    auto = (
        transformers.AutoModelForCausalLM
        if head == "lm"
        else transformers.AutoModelForTokenClassification
    )
    ref, info = auto.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ref.eval()
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ref(input_ids=ids).logits - ours(ids)).abs().max() <= 1e-5
    if head == "lm" and overrides.get("tie_word_embeddings"):
        assert "lm_head.weight" not in load_file(out / "model.safetensors")


def test_shard_assignment_matches_transformers_for_our_model(tmp_path):
    """Saving our model (not a loaded dict) with the same limit reproduces save_pretrained."""
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", max_shard_size="12KB")
    ours = load_model(src)
    out = save_model(ours, tmp_path / "out", max_shard_size_bytes="12KB")
    assert len(weight_files(out)) > 3
    assert_same_weights(src, out)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    limit=st.integers(4, 120),
)
def test_sharding_rule_matches_huggingface_hub(tmp_path_factory, sizes, limit):
    tensors = {f"t{i:02d}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}
    expected = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    out = save_hf_checkpoint(
        tmp_path_factory.mktemp("s") / "o", tensors, {}, max_shard_size_bytes=limit
    )
    if not expected.is_sharded:
        assert weight_files(out) == ["model.safetensors"]
        return
    with open(out / INDEX) as f:
        index = json.load(f)
    assert index["weight_map"] == expected.tensor_to_filename
    assert index["metadata"]["total_size"] == expected.metadata["total_size"]
    for file, names in expected.filename_to_tensors.items():
        assert sorted(load_file(out / file)) == sorted(names)


def test_refuses_to_overwrite_and_is_atomic(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", tokenizer=False)
    tensors, config = load_hf_state_dict(src), read_hf_config(src)
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf_checkpoint(target, tensors, config)
    assert os.listdir(target) == ["keep.txt"]

    def failing():
        yield from list(tensors.items())[:3]
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        save_hf_checkpoint(target, failing(), config, overwrite=True)
    assert os.listdir(target) == ["keep.txt"]  # the old folder is untouched

    save_hf_checkpoint(target, tensors, config, overwrite=True)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    save_hf_checkpoint(empty, tensors, config)  # an empty directory is fine
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_dtype_cast_on_save_updates_config(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", tokenizer=False)
    out = save_hf_checkpoint(
        tmp_path / "bf16", load_hf_state_dict(src), read_hf_config(src), dtype=torch.bfloat16
    )
    assert read_hf_config(out)["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def _rewrite_without(folder, drop=(), add=None):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "qwen3", tokenizer=False)
    _rewrite_without(
        src,
        drop=["model.layers.1.self_attn.k_norm.weight"],
        add={"model.layers.0.mlp.extra.weight": torch.zeros(2)},
    )
    with pytest.raises(CheckpointMismatchError) as err:
        load_model(src)
    msg = str(err.value)
    assert "model.layers.1.self_attn.k_norm.weight" in msg and "missing" in msg
    assert "model.layers.0.mlp.extra.weight" in msg and "unexpected" in msg


def test_shape_mismatch_is_named(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "llama", tokenizer=False)
    config = read_hf_config(src)
    config["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError, match=r"mlp\.gate_proj\.weight: checkpoint"):
        load_model(src)


def test_head_mismatch_needs_allow_new_head(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", tokenizer=False)
    with pytest.raises(CheckpointMismatchError, match="allow_new_head") as err:
        load_model(src, head="token_cls", num_labels=1)
    assert "score.weight" in str(err.value) and "lm_head.weight" in str(err.value)
    critic = load_model(src, head="token_cls", num_labels=1, allow_new_head=True)
    actor = load_model(src)
    assert critic.score.weight.shape == (1, 64) and torch.equal(critic.score.bias, torch.zeros(1))
    assert 0.0 < critic.score.weight.std() < 0.1  # N(0, initializer_range), not garbage
    for (name, a), (_, b) in zip(critic.model.named_parameters(), actor.model.named_parameters()):
        assert torch.equal(a, b), name
    # the head-less body of a token-classification checkpoint does not become an LM silently
    prm = make_tiny_hf_model(tmp_path / "prm", "qwen2", "token_cls", tokenizer=False)
    with pytest.raises(CheckpointMismatchError, match="lm_head.weight"):
        load_model(prm)
    assert load_model(prm, allow_new_head=True).lm_head.weight.shape == (128, 64)
    # a tied LM needs no new head from a token-classification checkpoint: it is the embedding
    tied_prm = make_tiny_hf_model(
        tmp_path / "tied_prm", "qwen2", "token_cls", tokenizer=False, tie_word_embeddings=True
    )
    with pytest.raises(CheckpointMismatchError, match="unexpected.*score.bias"):
        load_model(tied_prm)
    lm = load_model(tied_prm, allow_new_head=True)
    assert torch.equal(
        lm.lm_head.weight, load_file(tied_prm / "model.safetensors")["model.embed_tokens.weight"]
    )


def test_tied_checkpoint_without_lm_head(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", tokenizer=False, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(src / "model.safetensors")  # as HF writes it
    ours = load_model(src)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.output_weight() is ours.model.embed_tokens.weight
    assert sum(1 for _ in ours.parameters()) == len(load_file(src / "model.safetensors"))


def test_unsupported_model_type_is_clear(tmp_path):
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", tokenizer=False)
    config = read_hf_config(src)
    config["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(src)


def test_missing_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    src = make_tiny_hf_model(tmp_path / "src", "qwen2", tokenizer=False)
    os.remove(src / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_state_dict(src)
