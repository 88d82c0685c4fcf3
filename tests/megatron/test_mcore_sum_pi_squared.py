"""The megatron backend's old-logprob pass with ``sum_pi_squared`` (what
algorithm.adv_estimator=optimal_token_baseline reads; `megarl.trainer.advantage.
old_logprob_pass`) against a float64 softmax of transformers' logits, through the fused kernel
and the PyTorch fallback head; the logprobs equal a plain ``logprobs`` call; with R2 on an MoE
policy the same pass also records the routing. Vocabulary-parallel TP=2 of both head paths:
tests/kernels/test_sum_pi_squared.py (tests/dist/sum_pi_squared_tp.py).

Planted: the fallback's shards not summed over TP (covered by the TP=2 worker); the kernel's
second sweep without the factor 2 (sum of pi, = 1): fails here."""

import mcore_testlib as lib
import pytest
import torch

pytestmark = pytest.mark.usefixtures("mcore_dist")
T = 0.7


@pytest.mark.parametrize("fused", [True, False])
def test_sum_pi_squared_matches_float64(tmp_path, fused):
    from megarl.backends.megatron import MegatronBackend
    from megarl.trainer.advantage import old_logprob_pass

    path = lib.make_model(tmp_path / "dense", "qwen2", "lm")
    be = MegatronBackend("actor", str(path), use_fused_kernels=fused,
                         optim=lib.RESHARD_OPTIM, use_distributed_optimizer=False)
    batch = lib.make_batch(B=4, seed=3)
    res = old_logprob_pass(be, batch, T, sum_pi_squared=True)
    _, _, logits = lib.hf_logprobs(lib.hf_model(path), batch, temperature=T)
    mask = batch.response_mask.bool()
    want = torch.softmax(logits.detach(), -1).square().sum(-1) * mask
    torch.testing.assert_close(res["sum_pi_squared"].double(), want, rtol=2e-5, atol=1e-6)
    lp, ent = be.logprobs(batch, temperature=T, with_entropy=True)
    torch.testing.assert_close(res["old_logprob"], lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(res["entropy"], ent, rtol=0, atol=1e-5)


def test_r2_and_sum_pi_squared_in_one_pass(tmp_path):
    import moe_testlib as ml

    from megarl.backends.megatron import MegatronBackend, replay
    from megarl.trainer.advantage import old_logprob_pass

    path = ml.moe_model(tmp_path, "qwen3_moe")
    be = MegatronBackend("actor", str(path), router_replay=True,
                         optim=lib.RESHARD_OPTIM, use_distributed_optimizer=False)
    batch = lib.make_batch(B=4, seed=3)
    res = old_logprob_pass(be, batch, T, sum_pi_squared=True, record_routing=True)
    lp, _, routed = replay.record_logprobs(be, batch, T)
    assert torch.equal(res["routed_experts"], routed)
    torch.testing.assert_close(res["old_logprob"], lp, rtol=0, atol=1e-6)
    real = batch.attention_mask.bool()
    assert (routed[real] >= 0).all() and (routed[~real] == -1).all()
