"""Our mixture-of-experts decoder against transformers' Qwen3MoeForCausalLM / Qwen2MoeForCausalLM.

Folders are written by transformers (`make_tiny_hf_model`: 4 experts, top-2, head_dim 32, every
parameter random) and loaded by transformers as the reference. Bound 1e-5 (fp32); measured:
logits 9.5e-7 (qwen3_moe) / 8.3e-7 (qwen2_moe), gradients with the aux loss 2.1e-7 / 1.8e-7
(relative to max(1, |g|)), aux loss equal to transformers' in every printed digit.

Planted bugs (run by hand against the same tiny models): the top-k weights not renormalised
(``norm_topk_prob`` ignored in `moe.route`): qwen3_moe logits off by 0.61; top-k on the logits
without the softmax: 3.4 / 4.3; the shared expert's sigmoid gate dropped (qwen2_moe): 1.45;
the aux loss divided by k (f_e over token-slots instead of tokens): 1.05 instead of 2.10 and
gradients off by 0.047 / 0.055 relative. Each fails the tests below.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.models import load_model, save_model
from megarl.models.args import ModelArgs
from megarl.models.moe import MoEBlock, capture_router_logits
from megarl.models.moe_metrics import load_balancing_loss
from megarl.models.state_dict_adapter import hf_sort_key
from megarl.models.testing import hf_grads_by_checkpoint_name

ATOL = 1e-5

CASES = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "tie_word_embeddings": True}),
    # layers 0 and 2 dense (mlp_only_layers / decoder_sparse_step), 1 and 3 sparse
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [2]}),
    ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 3, "attention_bias": True}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [0]}),
]
IDS = [f"{fam}-" + "-".join(f"{k}={v}" for k, v in ov.items()) for fam, ov in CASES]


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def padded_batch(lengths, seq_len, vocab: int = 128, seed: int = 0):
    """Left-padded (ids [B, T], mask [B, T]) with random tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, seq_len - n :] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, seq_len - n :] = 1
    return ids, mask


def load_pair(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), load_model(folder)


def hf_grads(ref) -> dict[str, torch.Tensor]:
    """transformers' gradients under checkpoint (per-expert) names."""
    return hf_grads_by_checkpoint_name(ref)


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=IDS)
def test_logits_and_aux_loss_match_transformers(hf_folder, family, overrides):
    ref, ours = load_pair(hf_folder(family, **overrides))
    ids, mask = padded_batch([12, 5, 9], 12)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, position_ids=hf_positions(mask),
                  output_router_logits=True)
        with capture_router_logits(ours) as router:
            got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - out.logits[real]).abs().max() <= ATOL
    assert out.logits[real].abs().max() > 0.5
    sparse = [i for i in range(ours.args.num_hidden_layers) if ours.args.is_moe_layer(i)]
    assert sorted(router) == sparse and len(out.router_logits) == len(sparse)
    for i, hf_logits in zip(sparse, out.router_logits, strict=True):  # padding rows differ
        assert (router[i] - hf_logits)[real.reshape(-1)].abs().max() <= ATOL
    aux = load_balancing_loss(list(router.values()), ours.args.num_experts,
                              ours.args.num_experts_per_tok, mask)
    assert abs(float(aux) - float(out.aux_loss)) <= ATOL


@pytest.mark.parametrize(("family", "overrides"), CASES[:1] + CASES[4:5], ids=IDS[:1] + IDS[4:5])
def test_grads_with_aux_loss_match_transformers(hf_folder, family, overrides):
    """LM loss + router_aux_loss_coef * aux (HF's own combination, ``labels=``): every
    parameter's gradient (experts, routers, shared expert) within 1e-5 of transformers'."""
    folder = hf_folder(family, **overrides)
    ref, ours = load_pair(folder)
    ref.config.router_aux_loss_coef = ours.args.router_aux_loss_coef = 0.5  # visible in grads
    ref.router_aux_loss_coef = 0.5
    ids, mask = padded_batch([10, 10], 10, seed=3)  # no padding: HF's label shift is plain
    ref(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()

    with capture_router_logits(ours) as router:
        logits = ours(ids)
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    aux = load_balancing_loss(list(router.values()), ours.args.num_experts,
                              ours.args.num_experts_per_tok)
    (lm + ours.args.router_aux_loss_coef * aux).backward()

    expected = hf_grads(ref)
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == set(expected)
    for name, p in ours_params.items():
        g_ref = expected[name]
        assert p.grad is not None, f"no gradient reached {name}"
        assert (p.grad - g_ref).abs().max() <= ATOL * max(1.0, g_ref.abs().max().item()), name
    router_grad = ours_params["model.layers.0.mlp.gate.weight"].grad
    assert router_grad.abs().max() > 1e-3  # the routers do learn (aux loss and top-k weights)


def test_unchosen_expert_gets_zero_gradient_not_none(hf_folder):
    """Every expert takes part in every call (FSDP ranks reduce the same gradients)."""
    ours = load_model(hf_folder("qwen3_moe"))
    ids = torch.tensor([[5]])
    ours(ids).sum().backward()
    block = ours.model.layers["0"].mlp
    grads = [e.gate_proj.weight.grad for e in block.experts]
    assert all(g is not None for g in grads)
    assert sum(int(g.abs().sum() == 0) for g in grads) == 2  # 1 token, top-2 of 4


def test_hf_safetensors_round_trip_bit_exact(hf_folder, tmp_path):
    """HF folder -> our model -> save_model: the same tensor names and bits as transformers'
    file, and transformers loads our folder to the same logits."""
    folder = hf_folder("qwen2_moe")
    ours = load_model(folder)
    out = save_model(ours, tmp_path / "out")
    a, b = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in a
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids, _ = padded_batch([7], 7, seed=4)
    with torch.no_grad():
        assert (again(input_ids=ids).logits - ours(ids)).abs().max() <= ATOL
    assert again.config.num_experts == 4 and again.config.shared_expert_intermediate_size == 80


def test_sharded_save_streams_experts_in_numeric_order(hf_folder, tmp_path):
    ours = load_model(hf_folder("qwen3_moe", num_experts=12))
    names = sorted(ours.state_dict(), key=hf_sort_key)
    layer0 = [n.removeprefix("model.layers.0.") for n in names if n.startswith("model.layers.0.")]
    experts = [n for n in layer0 if n.startswith("mlp.experts.")]
    assert experts[:3] == [f"mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj",
                                                                 "down_proj")]
    assert experts[-1] == "mlp.experts.11.down_proj.weight" and len(experts) == 36
    assert layer0.index("mlp.gate.weight") < layer0.index(experts[0])
    out = save_model(ours, tmp_path / "sharded", max_shard_size_bytes="40KB")
    back = load_model(out)
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_layer_kinds_follow_transformers_rule():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
    )
    ref = transformers.Qwen3MoeForCausalLM(cfg)
    args = ModelArgs.from_hf_config(cfg.to_dict())
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.model.layers]
    assert [args.is_moe_layer(i) for i in range(6)] == hf_sparse == [
        False, True, False, False, False, True
    ]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok must be in"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_bad_moe_configs_are_refused(hf_folder, change, match):
    import json

    config = json.loads((hf_folder("qwen3_moe") / "config.json").read_text())
    config.update(change)
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(config)


def test_moe_block_is_its_own_module(hf_folder):
    ours = load_model(hf_folder("qwen3_moe"))
    assert isinstance(ours.model.layers["1"].mlp, MoEBlock)
    assert ours.args.is_moe and ours.args.num_experts == 4  # read from num_local_experts
