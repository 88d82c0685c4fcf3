"""LoRA on megatron-core layers (TP = PP = 1, this process) against PEFT on transformers, both in
float64: logits and every adapter gradient of a GQA Llama and a Qwen2 (q/k/v biases) agree, the
fused q/k/v and gate/up projections carry one adapter per HF module, and the exported PEFT folder
loads in PEFT with the same logits. Plus the module selection of verl's keys and the refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

RANK, ALPHA = 4, 8.0
CASES = {  # family: (target_modules, exclude_modules, adapted leaves of every layer)
    "llama": ("all-linear", None, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj")),
    # verl's megatron names next to HF ones; k_proj excluded from the fused qkv
    "qwen2": (["linear_qkv", "linear_fc1_up", "down_proj"], ["k_proj"],
              ("q_proj", "v_proj", "up_proj", "down_proj")),
}


def _random_adapter(specs, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        out[f"{s.module}.lora_A.weight"] = torch.randn(RANK, s.in_features, generator=g,
                                                       dtype=torch.float64) * 0.3
        out[f"{s.module}.lora_B.weight"] = torch.randn(s.out_features, RANK, generator=g,
                                                       dtype=torch.float64) * 0.3
    return out


def _float64_chunk(path, args, layout):
    from megarl.backends.megatron import cpu_compat
    from megarl.backends.megatron.model import build_model_chunks, transformer_config
    from megarl.backends.megatron.weights import load_hf_into_chunks

    with cpu_compat.cuda_to_cpu():
        config = transformer_config(args, layout, dtype=torch.float64)
        (chunk,) = build_model_chunks("actor", args, config, layout, pp_rank=0, num_labels=None,
                                      use_te=False)
        load_hf_into_chunks([chunk], path, args, "actor", None, seed=1)
    return chunk


def _logits(chunk, ids, pos, weights):
    """Logits [b, s, V] of ``chunk`` (TP = PP = 1) and the backward of sum(logits * weights)."""
    from megarl.backends.megatron import cpu_compat

    with cpu_compat.cuda_to_cpu():
        hidden = chunk(ids, pos, None)  # [s, b, h]
        logits = (hidden @ chunk.lm_head_weight().t()).transpose(0, 1)
        (logits * weights).sum().backward()
    return logits.detach()


@pytest.mark.parametrize("family", list(CASES))
def test_float64_megatron_lora_matches_peft(tmp_path, family):
    """Three float64 references:

    1. megatron's own base layers loaded with PEFT's merge (``merge_and_unload``) of the same
       adapters: logits within 1e-9, and the adapter gradients within 1e-9 of the chain rule
       on the merged weights' gradients (dL/dB = s G A^T, dL/dA = s B^T G): the adapters' math
       alone, exactly;
    2. PEFT on transformers: logits within 5e-6 and adapter gradients within 2e-5 of the
       largest. Measured: logits 3.3e-6 (Llama) and 1.3e-6 (Qwen2) of 2.9; gradients up to
       5.1e-6 (layer 0's q_proj A). That is the two float64 base models' own gap (without
       adapters megatron's layers and transformers differ by about 5e-7 on the logits here),
       carried through the adapted layers: part 1 shows the adapters add nothing to it;
    3. the exported PEFT folder loaded by PEFT gives the same logits.

    Planted: q and k adapters swapped inside the fused qkv (or the GQA group interleave
    ignored), gate/up swapped, scaling alpha instead of alpha / r: logits off by > 1e-2."""
    import peft

    from megarl.backends.megatron import cpu_compat, parallel
    from megarl.backends.megatron.lora import gather_adapters, install, set_adapters
    from megarl.backends.megatron.model import Layout
    from megarl.backends.megatron.weights import chunk_entries, hf_from_shards
    from megarl.models.args import ModelArgs
    from megarl.models.hf_io import read_hf_config
    from megarl.models.lora import LoraSettings, save_peft_adapter

    lib.ensure_dist()
    parallel.reset_model_parallel()
    parallel.ensure_model_parallel(1, 1, seed=1)
    target, exclude, leaves = CASES[family]
    path = lib.make_model(tmp_path / family, family, "lm", num_key_value_heads=2,
                          num_attention_heads=4, tie_word_embeddings=False)
    args = ModelArgs.from_hf_config(read_hf_config(path))
    assert args.n_rep == 2  # GQA: two query heads per KV group
    layout = Layout()
    settings = LoraSettings(rank=RANK, alpha=ALPHA, target_modules=target,
                            exclude_modules=exclude)
    chunk = _float64_chunk(path, args, layout)
    specs = install([chunk], args, layout, settings, seed=1)
    names = [s.module for s in specs]
    kind = {x: "self_attn" if x[0] in "qkvo" else "mlp" for x in leaves}
    assert sorted(names) == sorted(f"model.layers.{i}.{kind[x]}.{x}"
                                   for i in range(args.num_hidden_layers) for x in leaves)
    assert {n for n, p in chunk.named_parameters() if p.requires_grad} == {
        f"lora.pairs.{s.key}.lora_{ab}" for s in specs for ab in "AB"}
    adapter = _random_adapter(specs)
    assert set_adapters([chunk], adapter, 0, 1) == len(adapter)

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, args.vocab_size, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9)
    weights = torch.randn(2, 9, args.vocab_size, generator=g, dtype=torch.float64)
    logits = _logits(chunk, ids, pos, weights)

    hf = lib.hf_model(path, dtype=torch.float64)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=names))
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for n, t in adapter.items():
            module, ab = n.rsplit(".lora_", 1)
            params[f"base_model.model.{module}.lora_{ab[0]}.default.weight"].copy_(t)
    want = pm(input_ids=ids, position_ids=pos).logits
    (want * weights).sum().backward()
    peft_grads = {s.module: {ab: params[f"base_model.model.{s.module}.lora_{ab}.default.weight"]
                             .grad.clone() for ab in "AB"} for s in specs}
    merged = pm.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")

    # 1. the adapters' math against megatron's base layers holding the merged weights
    base = _float64_chunk(tmp_path / "merged", args, layout)
    base_logits = _logits(base, ids, pos, weights)
    assert (logits - base_logits).abs().max() <= 1e-9
    grads = {}
    for entry in chunk_entries(base, args):
        param = dict(base.named_parameters())[entry.mcore]
        grads.update(hf_from_shards(entry, [param.grad], args))
    s_ = ALPHA / RANK
    for s in specs:
        G = grads[f"{s.module}.weight"]
        A, B = adapter[f"{s.module}.lora_A.weight"], adapter[f"{s.module}.lora_B.weight"]
        pair = chunk.lora.pairs[s.key]
        assert (pair.lora_A.grad - s_ * B.t() @ G).abs().max() <= 1e-9, s.module
        assert (pair.lora_B.grad - s_ * G @ A.t()).abs().max() <= 1e-9, s.module
    # 2. PEFT on transformers
    assert (logits - want).abs().max() <= 5e-6 * want.abs().max()
    for s in specs:
        for ab in "AB":
            got = getattr(chunk.lora.pairs[s.key], f"lora_{ab}").grad
            ref = peft_grads[s.module][ab]
            assert float(ref.abs().max()) > 0
            assert (got - ref).abs().max() <= 2e-5 * ref.abs().max(), (s.module, ab)
    # 3. the exported PEFT folder: PEFT loads it onto the same base and gives the same logits
    with cpu_compat.cuda_to_cpu():
        exported = dict(gather_adapters([chunk], specs, args, layout, RANK))
    for n, t in adapter.items():
        assert torch.equal(exported[n], t), n
    save_peft_adapter(tmp_path / "adapter", exported, settings)
    loaded = peft.PeftModel.from_pretrained(lib.hf_model(path, dtype=torch.float64),
                                            tmp_path / "adapter")
    with torch.no_grad():
        again = loaded(input_ids=ids, position_ids=pos).logits
    assert torch.equal(again, want.detach())
    parallel.reset_model_parallel()


@pytest.mark.parametrize("position", ["pre", "post"])
def test_float64_megatron_lora_dropout_drops_what_one_process_drops(tmp_path, position):
    """lora_dropout 0.3 in train mode, from the same generator state: megatron's logits and
    adapter gradients equal the reference's: PEFT's ``lora_dropout`` for ``pre`` (the same masks:
    each adapter's mask drawn whole, batch-first, in HF's module order), megarl's torch
    `LoRALinear` for ``post`` (Megatron-Bridge's; PEFT has none). Tolerances as
    `test_float64_megatron_lora_matches_peft` (the two float64 base models' own gap). In eval
    mode nothing is dropped. Planted: masks drawn in megatron's [s, b, h] order, or the
    post mask applied to the input: logits off by > 1e-2."""
    import peft
    from policy_batch import seed_megatron_dropout

    from megarl.backends.megatron import parallel
    from megarl.backends.megatron.lora import install, set_adapters
    from megarl.backends.megatron.model import Layout
    from megarl.models import load_model
    from megarl.models.args import ModelArgs
    from megarl.models.hf_io import read_hf_config
    from megarl.models.lora import LoraSettings, apply_lora

    lib.ensure_dist()
    parallel.reset_model_parallel()
    parallel.ensure_model_parallel(1, 1, seed=1)
    path = lib.make_model(tmp_path / "llama", "llama", "lm", num_key_value_heads=2,
                          num_attention_heads=4, tie_word_embeddings=False)
    args = ModelArgs.from_hf_config(read_hf_config(path))
    settings = LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.3, dropout_position=position)
    chunk = _float64_chunk(path, args, Layout())
    specs = install([chunk], args, Layout(), settings, seed=1)
    adapter = _random_adapter(specs)
    set_adapters([chunk], adapter, 0, 1)
    names = [s.module for s in specs]

    if position == "pre":
        ref = peft.get_peft_model(lib.hf_model(path, dtype=torch.float64), peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.3, target_modules=names))
        prefix, suffix = "base_model.model.", ".default.weight"
    else:
        ref = load_model(path, dtype=torch.float64)
        apply_lora(ref, RANK, ALPHA, names, None, 0.3, dropout_position="post")
        prefix, suffix = "", ".weight"
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, t in adapter.items():
            module, ab = n.rsplit(".lora_", 1)
            params[f"{prefix}{module}.lora_{ab[0]}{suffix}"].copy_(t)
    ref.train()
    chunk.train()

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, args.vocab_size, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9)
    weights = torch.randn(2, 9, args.vocab_size, generator=g, dtype=torch.float64)
    seed_megatron_dropout(21)
    logits = _logits(chunk, ids, pos, weights)
    torch.manual_seed(21)
    want = (ref(input_ids=ids, position_ids=pos).logits if position == "pre"
            else ref(ids, position_ids=pos))
    (want * weights).sum().backward()
    assert (logits - want).abs().max() <= 5e-6 * want.abs().max()
    for s in specs:
        for ab in "AB":
            got = getattr(chunk.lora.pairs[s.key], f"lora_{ab}").grad
            r = params[f"{prefix}{s.module}.lora_{ab}{suffix}"].grad
            assert float(r.abs().max()) > 0
            assert (got - r).abs().max() <= 2e-5 * r.abs().max(), (s.module, ab)
    chunk.eval()
    ref.eval()
    from megarl.backends.megatron import cpu_compat

    with torch.no_grad(), cpu_compat.cuda_to_cpu():
        whole = (chunk(ids, pos, None) @ chunk.lm_head_weight().t()).transpose(0, 1)
        whole_ref = (ref(input_ids=ids, position_ids=pos).logits if position == "pre"
                     else ref(ids, position_ids=pos))
    assert (whole - whole_ref).abs().max() <= 5e-6 * whole_ref.abs().max()
    assert (whole - logits).abs().max() > 1e-2  # train mode did drop
    parallel.reset_model_parallel()


def test_megatron_lora_refusals():
    from megarl.backends.megatron.lora import adapter_specs, check_lora_supported
    from megarl.errors import UserInputError
    from megarl.models.args import ModelArgs
    from megarl.models.lora import LoraSettings
    from megarl.models.testing import tiny_hf_config

    moe = ModelArgs.from_hf_config(tiny_hf_config("qwen2_moe").to_dict())
    with pytest.raises(UserInputError, match="mixture-of-experts"):
        check_lora_supported(moe, LoraSettings(rank=4, alpha=8.0))
    dense = ModelArgs.from_hf_config(tiny_hf_config("llama").to_dict())
    with pytest.raises(UserInputError, match="target_modules"):
        adapter_specs(dense, LoraSettings(rank=4, alpha=8.0, target_modules=["lm_head"]))
    # shell wildcards over megatron's names, as verl's megatron block writes them
    only0 = adapter_specs(dense, LoraSettings(rank=4, alpha=8.0,
                                              target_modules=["*.layers.0.*.linear_qkv"]))
    assert [s.module for s in only0] == [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]


def test_bf16_lora_checkpoint_rebuilds_and_resumes(tmp_path):
    """bf16 actor with LoRA on q_proj and megatron's linear_fc2: a checkpoint (adapters and
    their optimizer only) rebuilds the backend alone (`from_checkpoint`: the base from the
    source folder, the saved dtype) with the same adapters, and the next update is the same bit
    for bit; a run with other LoRA settings is refused naming the keys. Planted: the rebuilt
    backend in fp32 (the saved dtype ignored): adapters differ by ~1e-5."""
    from policy_batch import loss_fn, make_batch

    from megarl.backends.megatron import MegatronBackend, parallel
    from megarl.errors import UserInputError
    from megarl.models.lora import LoraSettings

    lib.ensure_dist()
    parallel.reset_model_parallel()
    path = lib.make_model(tmp_path / "qwen2", "qwen2", "lm")
    lora = LoraSettings(rank=RANK, alpha=ALPHA, target_modules=["q_proj", "linear_fc2"])
    kw = {"use_fused_kernels": False, "optim": {"lr": 1e-2}}
    a = MegatronBackend("actor", str(path), lora=lora, dtype="bf16", **kw)
    assert a.adapted_modules() == [f"model.layers.{i}.{m}" for i in range(2)
                                   for m in ("self_attn.q_proj", "mlp.down_proj")]
    a.train_step([make_batch(1)], loss_fn)
    a.save(str(tmp_path / "ck"))
    b = MegatronBackend.from_checkpoint(str(tmp_path / "ck"), train=True, **kw)
    assert b.lora == LoraSettings(**{**lora.__dict__, "target_modules": list(lora.target_modules)})
    before = dict(a.export_adapter())
    assert all(t.dtype == torch.bfloat16 for t in before.values())
    for n, t in b.export_adapter():
        assert torch.equal(t, before[n]), n
    a.train_step([make_batch(2)], loss_fn)
    b.train_step([make_batch(2)], loss_fn)
    after = dict(a.export_adapter())
    assert any(not torch.equal(after[n], t) for n, t in before.items())
    for n, t in b.export_adapter():
        assert torch.equal(t, after[n]), n
    other = MegatronBackend("actor", str(path), lora=LoraSettings(rank=RANK, alpha=ALPHA),
                            dtype="bf16", **kw)
    with pytest.raises(UserInputError, match="lora_rank"):
        other.load(str(tmp_path / "ck"))
    parallel.reset_model_parallel()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_adapters_train_under_activation_recompute(tmp_path, dropout):
    """With megatron's full activation recompute (verl's enable_gradient_checkpointing) the
    adapters get the same update as without it, with adapter dropout too (the recomputed
    forward draws the masks the first one drew). Planted: the frozen embedding's output left
    without requires_grad (the reentrant checkpoint then passes no gradient): the adapters do
    not move; the masks drawn from a generator recompute does not restore: the updates differ
    by ~lr."""
    from policy_batch import loss_fn, make_batch, seed_megatron_dropout

    from megarl.backends.megatron import MegatronBackend, parallel
    from megarl.models.lora import LoraSettings

    lib.ensure_dist()
    path = lib.make_model(tmp_path / "qwen2", "qwen2", "lm")
    lora = LoraSettings(rank=RANK, alpha=ALPHA, target_modules="all-linear", init_b="normal",
                        dropout=dropout)
    kw = {"use_fused_kernels": False, "optim": {"lr": 1e-2}, "dtype": "fp32"}
    updates = {}
    for recompute in (None, "full"):
        parallel.reset_model_parallel()
        actor = MegatronBackend("actor", str(path), lora=lora, recompute=recompute, **kw)
        before = {n: t.clone() for n, t in actor.export_adapter()}
        seed_megatron_dropout(5)
        actor.train_step([make_batch(3)], loss_fn)
        updates[recompute] = {n: t - before[n] for n, t in actor.export_adapter()}
    parallel.reset_model_parallel()
    plain, recomputed = updates[None], updates["full"]
    assert all(float(d.abs().max()) > 1e-4 for d in plain.values())
    for n, d in recomputed.items():
        torch.testing.assert_close(d, plain[n], rtol=1e-4, atol=1e-6, msg=n)
