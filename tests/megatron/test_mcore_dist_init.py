"""Initial weights from a megatron-core dist checkpoint (`megarl.backends.megatron.dist_init`,
verl's ``megatron.use_dist_checkpointing``): a model's ``sharded_state_dict()`` saved with
megatron-core's own ``dist_checkpointing.save`` (the layout verl's converter writes) loads into
a freshly initialised model of the same config, which then computes the saved model's logits
(and transformers' within the fp32 bound)."""

from __future__ import annotations

import mcore_testlib as lib
import pytest
import torch

from megarl.errors import UserInputError


def _save(chunks, folder, prefix=""):
    from megatron.core import dist_checkpointing

    from megarl.backends.megatron import cpu_compat

    folder.mkdir()
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        dist_checkpointing.save(chunks[0].sharded_state_dict(prefix=prefix), str(folder))


@pytest.mark.parametrize(("name", "prefix"), [("qwen2_bias", ""), ("llama_tied_gqa", "m.")])
def test_fresh_model_loads_a_dist_checkpoint(zoo, mcore_dist, tmp_path, name, prefix):
    """Planted: skipping the load leaves the fresh model's random weights (logits 2.5 to 2.7
    away); a wrong prefix is refused naming the path key."""
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.dist_init import load_dist_checkpoint
    from megarl.models import read_hf_config

    path = lib.zoo_model(zoo, name)
    saved = MegatronBackend("ref", str(path))
    _save(saved.chunks, tmp_path / "dist", prefix)
    batch = lib.make_batch(seed=4)
    expected = saved.logits(batch)
    fresh = MegatronBackend("ref", None, hf_config=read_hf_config(path), seed=7)
    assert lib.max_diff(fresh.logits(batch), expected) > 0.1
    load_dist_checkpoint(fresh.chunks, tmp_path / "dist", prefix=prefix)
    assert torch.equal(fresh.logits(batch), expected)
    _, _, ref_logits = lib.hf_logprobs(lib.hf_model(path), batch)
    assert lib.max_diff(fresh.logits(batch), ref_logits) < lib.fp32_tols(
        path, ref_logits, batch.response_mask)["logits"]
    with pytest.raises(UserInputError, match=r"^actor_rollout_ref\.actor\.megatron\."
                       r"dist_checkpointing_path=.*does not fit this model"):
        load_dist_checkpoint(fresh.chunks, tmp_path / "dist", prefix=prefix + "x.")


def test_missing_path_or_folder_is_a_clear_error(mcore_dist, tmp_path):
    from megarl.backends.megatron.dist_init import load_dist_checkpoint

    with pytest.raises(UserInputError, match=r"^critic\.megatron\.use_dist_checkpointing=true "
                       r"needs critic\.megatron\.dist_checkpointing_path"):
        load_dist_checkpoint([], None, role="critic")
    with pytest.raises(UserInputError, match=r"dist_checkpointing_path=.*metadata\.json is "
                       "missing"):
        load_dist_checkpoint([], tmp_path)


@pytest.mark.dist
def test_tp1_checkpoint_loads_at_tp2(zoo, mcore_dist, tmp_path):
    """A TP=1 dist checkpoint (verl's converter writes TP=1 ones too) loaded by 2 ranks at
    TP=2: megatron-core reshards, and the logits are transformers' within the fp32 bound.
    Measured on the 2-core Xeon: 2.4e-6 (bound 1.2e-5); before the load 2.6 away."""
    from megarl.backends.megatron import MegatronBackend

    path = lib.zoo_model(zoo, "qwen2_bias")
    _save(MegatronBackend("ref", str(path)).chunks, tmp_path / "dist")
    lib.run_torchrun("megatron_dist_init.py", 2,
                     [str(path), str(tmp_path / "dist"), str(tmp_path / "res.json")])
    res = lib.read_results(tmp_path / "res.json")
    assert res["after"] < res["tol"] < 0.1 < res["before"], res


def test_value_model_loads_its_head_and_skips_the_lm_output(zoo, mcore_dist, tmp_path):
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.dist_init import load_dist_checkpoint
    from megarl.models import read_hf_config

    path = lib.zoo_model(zoo, "qwen2_critic")
    saved = MegatronBackend("critic", str(path), train=False)
    _save(saved.chunks, tmp_path / "dist")
    batch = lib.make_batch(seed=2)
    fresh = MegatronBackend("critic", None, hf_config=read_hf_config(path), train=False, seed=5)
    assert lib.max_diff(fresh.values(batch), saved.values(batch)) > 1e-3
    load_dist_checkpoint(fresh.chunks, tmp_path / "dist", value_model=True, role="critic")
    assert torch.equal(fresh.values(batch), saved.values(batch))
    # a checkpoint of an LM (no score head) into the critic: the body is the LM's, the head
    # stays the critic's (verl keeps its fresh value head the same way)
    lm = MegatronBackend("ref", str(lib.zoo_model(zoo, "qwen2_bias")))
    _save(lm.chunks, tmp_path / "lm")
    other = MegatronBackend("critic", None, hf_config=read_hf_config(path), train=False, seed=9)
    head = other.chunks[0].score.weight.detach().clone()
    emb = "embedding.word_embeddings.weight"
    assert not torch.equal(other.chunks[0].state_dict()[emb], lm.chunks[0].state_dict()[emb])
    load_dist_checkpoint(other.chunks, tmp_path / "lm", value_model=True, role="critic")
    assert torch.equal(other.chunks[0].score.weight, head)
    assert torch.equal(other.chunks[0].state_dict()[emb], lm.chunks[0].state_dict()[emb])
