"""verl's override blocks on the megatron backend: ``model.override_config`` (the HF config the
backend builds from; logits against transformers in float64 with the same override),
``megatron.override_transformer_config`` (set on megatron-core's TransformerConfig and, from
it, on the built modules) and ``optim.override_optimizer_config`` (megatron-core's
OptimizerConfig). Names megatron-core does not have, and fields megarl sets itself, are refused
naming the key."""

from __future__ import annotations

import dataclasses

import mcore_testlib as lib
import pytest
import torch
import transformers

from megarl.errors import UserInputError

TF_KEY = "actor_rollout_ref.actor.megatron.override_transformer_config"
OPT_KEY = "actor_rollout_ref.actor.optim.override_optimizer_config"


def _te() -> bool:
    from megarl.backends.megatron.model import te_available

    return te_available()


def test_backend_built_from_the_overridden_config_matches_transformers(zoo, mcore_dist):
    """The config the backend reads (``read_hf_config(path, override_config)``) with rope_theta
    500: logits within the fp32 bound of transformers' float64 model with the same RoPE base.
    Measured on the 2-core Xeon: 1.8e-6 (bound 1.1e-5); without the override 1.4 away."""
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.weights import load_hf_into_chunks
    from megarl.models import read_hf_config

    path = lib.zoo_model(zoo, "qwen2_bias")
    batch = lib.make_batch(B=2, P=24, L=8, seed=3)
    config = transformers.AutoConfig.from_pretrained(path)
    config.rope_parameters["rope_theta"] = 500.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, config=config,
                                                           dtype=torch.float64)
    _, _, ref_logits = lib.hf_logprobs(hf, batch)
    tol = lib.fp32_tols(path, ref_logits, batch.response_mask)["logits"]
    diffs = []
    for override in ({"model_config": {"rope_theta": 500.0}}, None):
        be = MegatronBackend("ref", None, hf_config=read_hf_config(path, override))
        load_hf_into_chunks(be.chunks, path, be.args, "ref", None, seed=1)
        diffs.append(lib.max_diff(be.logits(batch), ref_logits))
    assert diffs[0] < tol
    assert diffs[1] > 100 * tol  # the override matters


def _base_config(recompute=None):
    from megarl.backends.megatron.model import Layout, transformer_config
    from megarl.models import ModelArgs
    from megarl.models.testing import tiny_hf_config

    args = ModelArgs.from_hf_config(tiny_hf_config("qwen2").to_dict())
    return args, transformer_config(args, Layout(), dtype=torch.float32, recompute=recompute)


def _fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def test_transformer_overrides_reach_the_config_and_the_modules(mcore_dist):
    """attention_dropout reaches the built attention's dropout module; every other field keeps
    megarl's value (megatron-core's __post_init__ runs again on dataclasses.replace)."""
    from megatron.core.transformer.enums import AttnBackend

    from megarl.backends.megatron.config import apply_transformer_overrides
    from megarl.backends.megatron.model import Layout, build_model_chunks

    args, base = _base_config({"granularity": "selective"})
    override = {"attention_dropout": 0.25, "recompute_modules": ["core_attn", "mlp"],
                "apply_rope_fusion": False,
                "hidden_size": base.hidden_size}  # megarl's own value: accepted
    config = apply_transformer_overrides(base, override)
    assert config.attention_dropout == 0.25
    assert config.recompute_modules == ["core_attn", "mlp"]
    before, after = _fields(base), _fields(config)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"attention_dropout", "recompute_modules"}
    assert apply_transformer_overrides(base, {}) is base
    # verl's recompute lines (when given here rather than as megatron.recompute_*)
    full = apply_transformer_overrides(_base_config()[1], {
        "recompute_granularity": "full", "recompute_method": "uniform",
        "recompute_num_layers": 1})
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == (
        "full", "uniform", 1)
    # verl writes the attention backend as a string; megatron-core's field is an enum (not
    # built into modules here: megatron-core pins it process-wide through NVTE_* variables)
    assert apply_transformer_overrides(base, {"attention_backend": "flash"}
                                       ).attention_backend == AttnBackend.flash
    model = build_model_chunks("ref", args, config, Layout(), pp_rank=0, num_labels=None,
                               use_te=False)[0]
    drops = [m.attention_dropout.p for m in model.modules() if hasattr(m, "attention_dropout")
             and isinstance(m.attention_dropout, torch.nn.Dropout)]
    assert drops and set(drops) == {0.25}


def test_transformer_override_refusals(mcore_dist):
    """Planted: without the name check, a typo would reach dataclasses.replace as a TypeError
    without the key; without the megarl-field check, tensor_model_parallel_size=2 would build
    a config that disagrees with the process groups."""
    from megarl.backends.megatron.config import apply_transformer_overrides

    _, base = _base_config()
    with pytest.raises(UserInputError) as err:
        apply_transformer_overrides(base, {"attention_dropuot": 0.1})
    msg = str(err.value)
    assert msg.startswith(f"{TF_KEY}.attention_dropuot: megatron-core ")
    assert "has no field 'attention_dropuot' (did you mean attention_dropout" in msg
    with pytest.raises(UserInputError, match=(
            r"^critic\.megatron\.override_transformer_config\.tensor_model_parallel_size=2: "
            r"megarl sets tensor_model_parallel_size itself \(1 here\); use "
            r"critic\.parallel\.tensor_model_parallel_size$")):
        apply_transformer_overrides(base, {"tensor_model_parallel_size": 2}, role="critic")
    with pytest.raises(UserInputError, match=rf"^{TF_KEY}\.num_layers_in_last_pipeline_stage=1"
                       r": megarl sets .* evenly"):
        apply_transformer_overrides(base, {"num_layers_in_last_pipeline_stage": 1})
    with pytest.raises(UserInputError, match=rf"^{TF_KEY}\.hidden_size=128: .* config\.json"):
        apply_transformer_overrides(base, {"hidden_size": 128})
    with pytest.raises(UserInputError, match=rf"^{TF_KEY}\.moe_grouped_gemm=True: megarl sets "
                       r"moe_grouped_gemm itself \(False here\); megarl builds the routed "
                       r"experts as megatron-core's SequentialMLP"):
        apply_transformer_overrides(base, {"moe_grouped_gemm": True})
    with pytest.raises(UserInputError, match=r"attention_backend='flashy': expected one of"):
        apply_transformer_overrides(base, {"attention_backend": "flashy"})


def test_a_fusion_megatron_core_cannot_run_here_is_a_clear_error(mcore_dist):
    """apply_rope_fusion needs TransformerEngine's fused RoPE: megatron-core's own check
    refuses it without TE, and the error names the key; gradient_accumulation_fusion likewise
    (TE or APEX)."""
    from megarl.backends.megatron.config import apply_transformer_overrides

    _, base = _base_config()
    if _te():
        assert apply_transformer_overrides(base, {"apply_rope_fusion": True}).apply_rope_fusion
        return
    with pytest.raises(UserInputError, match=(
            rf"^{TF_KEY}: megatron-core refuses apply_rope_fusion=True: .*(TransformerEngine|install TE)")):
        apply_transformer_overrides(base, {"apply_rope_fusion": True})
    # verl's examples set this one in 9 lines: megatron-core's ColumnParallelLinear raises a
    # RuntimeError at model build without TE / APEX (measured); refused here instead
    with pytest.raises(UserInputError, match=rf"^{TF_KEY}\.gradient_accumulation_fusion=True: "
                       "megatron-core's linear layers need TransformerEngine"):
        apply_transformer_overrides(base, {"gradient_accumulation_fusion": True})


def test_optimizer_overrides_reach_megatron_cores_optimizer_config():
    """verl's example fields are megatron-core 0.16.1's own and are carried as set (the rest of
    megarl's config unchanged). use_precision_aware_optimizer: megatron-core's __post_init__
    checks TransformerEngine's version (is_te_min_version) before anything else, so without
    TE it is refused (here: alone and with optimizer_cpu_offload), with TE carried."""
    from megarl.backends.megatron.optim import optimizer_config
    from megarl.backends.optim_settings import OptimSettings

    plain = optimizer_config(OptimSettings(lr=3e-6), bf16=False, distributed=True)
    override = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
                "overlap_cpu_optimizer_d2h_h2d": True}
    if _te():
        override["use_precision_aware_optimizer"] = True
    config = optimizer_config(OptimSettings(lr=3e-6, override_optimizer_config=override),
                              bf16=False, distributed=True)
    for k, v in override.items():
        assert getattr(config, k) == v and getattr(plain, k) != v, k
    unchanged = {f.name for f in dataclasses.fields(plain) if f.init} - set(override)
    assert {k for k in unchanged if getattr(plain, k) != getattr(config, k)} == set()
    for extra in ({}, {"optimizer_cpu_offload": True}):
        aware = OptimSettings(override_optimizer_config={"use_precision_aware_optimizer": True,
                                                         **extra})
        if _te():
            assert optimizer_config(aware, bf16=True, distributed=True
                                    ).use_precision_aware_optimizer
            continue
        with pytest.raises(UserInputError, match=rf"^{OPT_KEY}: megatron-core's OptimizerConfig "
                           r"refuses .*(TransformerEngine is not installed|install TE|transformer-engine)"):
            optimizer_config(aware, bf16=True, distributed=True)


def test_optimizer_override_refusals():
    from megarl.backends.megatron.optim import optimizer_config
    from megarl.backends.optim_settings import OptimSettings

    def build(override, **kw):
        return optimizer_config(OptimSettings(override_optimizer_config=override, **kw),
                                bf16=False, distributed=True)

    with pytest.raises(UserInputError) as err:
        build({"optimizer_cpu_ofload": True})
    msg = str(err.value)
    assert msg.startswith(f"{OPT_KEY}.optimizer_cpu_ofload: megatron-core's OptimizerConfig "
                          "has no field 'optimizer_cpu_ofload' (did you mean "
                          "optimizer_cpu_offload")
    assert "its fields: " in msg and "optimizer_offload_fraction" in msg
    with pytest.raises(UserInputError, match=rf"^{OPT_KEY}\.lr=0\.1: megarl sets lr itself "
                       r"\(1e-06 here\); use optim\.lr"):
        build({"lr": 0.1})
    assert build({"lr": 1e-6}).lr == 1e-6  # megarl's own value is accepted
    with pytest.raises(UserInputError, match=r"^critic\.optim\.override_optimizer_config\."
                       r"clip_grad=5: megarl sets clip_grad .*use grad_clip"):
        build({"clip_grad": 5}, override_key="critic.optim.override_optimizer_config")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU boundary of megatron-core's "
                    "CPU offload; on CUDA the optimizer builds")
def test_cpu_offload_optimizer_does_not_build_without_cuda(zoo, mcore_dist):
    """What runs here: megatron-core's HybridDeviceOptimizer (optimizer_cpu_offload) fails to
    build on a machine without CUDA ('can't optimize a non-leaf Tensor' in torch's
    add_param_group); the error names the key and says so."""
    from megarl.backends.megatron import MegatronBackend

    path = lib.zoo_model(zoo, "qwen2_bias")
    with pytest.raises(UserInputError, match=(
            rf"^{OPT_KEY}: megatron-core could not build its optimizer with .*without CUDA, "
            r"megatron-core's optimizer_cpu_offload \(HybridDeviceOptimizer\) does not build")):
        MegatronBackend("actor", str(path), optim={
            "override_optimizer_config": {"optimizer_cpu_offload": True,
                                          "optimizer_offload_fraction": 1.0}})
