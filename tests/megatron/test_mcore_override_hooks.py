import mcore_testlib as lib
import torch
import transformers


def _hf(path, theta):
    config = transformers.AutoConfig.from_pretrained(path)
    config.rope_parameters["rope_theta"] = theta
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float64)


def test_megatron_hooks(zoo, mcore_dist, tmp_path):
    from megarl.backends.megatron import MegatronBackend
    path = lib.zoo_model(zoo, "qwen2_bias")
    batch = lib.make_batch(B=2, P=24, L=8, seed=3)
    _, _, ref = lib.hf_logprobs(_hf(path, 500.0), batch)
    tol = lib.fp32_tols(path, ref, batch.response_mask)["logits"]
    be = MegatronBackend("ref", str(path), hf_overrides={"model_config": {"rope_theta": 500.0}},
                         transformer_overrides={"attention_dropout": 0.3})
    assert lib.max_diff(be.logits(batch), ref) < tol
    assert be.config.attention_dropout == 0.3 and be.hf_config["rope_parameters"]["rope_theta"] == 500.0
    from megatron.core import dist_checkpointing

    from megarl.backends.megatron import cpu_compat
    (tmp_path / "d").mkdir()
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        dist_checkpointing.save(be.chunks[0].sharded_state_dict(), str(tmp_path / "d"))
    be2 = MegatronBackend("actor", str(path), hf_overrides={"rope_theta": 500.0},
                          dist_checkpoint=str(tmp_path / "d"))
    assert torch.equal(be2.logits(batch), be.logits(batch))


def test_torch_hooks(zoo):
    from megarl.backends.torch.backend import TorchBackend
    from megarl.rollout.torch.engine import TorchRolloutEngine
    path = lib.zoo_model(zoo, "qwen2_bias")
    lib.ensure_dist()
    batch = lib.make_batch(B=2, P=24, L=8, seed=3)
    _, _, ref = lib.hf_logprobs(_hf(path, 500.0), batch)
    be = TorchBackend("ref", str(path), hf_overrides={"rope_theta": 500.0}, dtype="fp32", device="cpu")
    lp, _ = be.logprobs(batch)
    ref_lp, _, _ = lib.hf_logprobs(_hf(path, 500.0), batch)
    assert lib.max_diff(lp, ref_lp) < 1e-4
    plain = TorchBackend("ref", str(path), dtype="fp32", device="cpu")
    assert lib.max_diff(plain.logprobs(batch)[0], ref_lp) > 1e-2
    eng = TorchRolloutEngine.from_pretrained(path, hf_overrides={"rope_theta": 500.0}, tokenizer=None)
    assert eng.model.args.rope_theta == 500.0
