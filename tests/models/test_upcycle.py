"""Sparse upcycling (`megarl.models.upcycle`): the Qwen2-MoE it writes computes the dense Qwen2's
function. Reference: transformers' Qwen2ForCausalLM on the dense folder against transformers'
Qwen2MoeForCausalLM on the upcycled one (both loaded by transformers from safetensors, fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.models import ModelArgs, Transformer, read_hf_config, save_model
from megarl.models.upcycle import upcycle_qwen2_config, upcycle_qwen2_state


def _upcycle(dense_dir, out_dir, **kwargs):
    dense = load_file(next(dense_dir.glob("*.safetensors")))
    cfg = upcycle_qwen2_config(read_hf_config(dense_dir), 4, 2)
    state = upcycle_qwen2_state(dense, cfg, **kwargs)
    model = Transformer(ModelArgs.from_hf_config(cfg), head="lm")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    save_model(model, out_dir)
    return state


def _logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(ids).logits


@pytest.fixture()
def dense(hf_folder):
    return hf_folder("qwen2", tie_word_embeddings=True)


def test_upcycled_moe_computes_the_dense_function(dense, tmp_path):
    """Max |logit difference| over 3 x 24 random tokens < 1e-5 (measured 1.2e-6; mean |logit|
    0.67): whatever the random router picks, the k routed copies (weights summing to 1) give half the
    dense MLP and the shared expert (gate sigmoid(0) = 1/2) the other half. Planted: routed
    experts without the 1/2 on down_proj give 1.5x the MLP: difference 1.04."""
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (3, 24))
    _upcycle(dense, tmp_path / "moe")
    name_d, a = _logits(dense, ids)
    name_m, b = _logits(tmp_path / "moe", ids)
    assert (name_d, name_m) == ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    assert float((a - b).abs().max()) < 1e-5


def test_noise_makes_the_experts_differ(dense, tmp_path):
    """With noise the routed experts are distinct tensors (so routing matters), the function
    moves a little, and the same seed gives the same weights."""
    s1 = _upcycle(dense, tmp_path / "a", noise=0.05, seed=3)
    s2 = upcycle_qwen2_state(load_file(next(dense.glob("*.safetensors"))),
                             upcycle_qwen2_config(read_hf_config(dense), 4, 2), noise=0.05, seed=3)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    e0, e1 = (s1[f"model.layers.0.mlp.experts.{j}.up_proj.weight"] for j in (0, 1))
    assert not torch.equal(e0, e1)
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    diff = float((_logits(dense, ids)[1] - _logits(tmp_path / "a", ids)[1]).abs().max())
    assert 1e-5 < diff < 0.5, diff


def test_bad_input_is_named(dense):
    cfg = read_hf_config(dense)
    with pytest.raises(ValueError, match="top_k must be in"):
        upcycle_qwen2_config(cfg, 4, 5)
    with pytest.raises(ValueError, match="takes a qwen2 config"):
        upcycle_qwen2_config({**cfg, "model_type": "llama"}, 4, 2)
    with pytest.raises(ValueError, match="noise and router_std must be >= 0"):
        upcycle_qwen2_state({}, upcycle_qwen2_config(cfg, 4, 2), noise=-1)
