"""The actor's old-logprob pass (`megarl.trainer.advantage.old_logprob_pass`) on the torch
backend: ``sum_pi_squared`` [B, L] (what algorithm.adv_estimator=optimal_token_baseline reads)
against a float64 softmax of transformers' logits, through the fused kernel (torch
implementation, and Triton under TRITON_INTERPRET=1) and the naive head; the logprobs and
entropies equal a plain ``logprobs`` call; with R2 the same pass also records the routing
(the megatron backend: tests/megatron/test_mcore_sum_pi_squared.py).

Planted: sum_pi_squared scattered with the logprob's entries (the sum of pi^2 replaced by
pi_label): fails the float64 comparison; the recording pass dropped when the stats are asked
for too (no routed_experts): fails the R2 case."""

from __future__ import annotations

import os

import pytest
import torch

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch import TorchBackend
from megarl.trainer.advantage import old_logprob_pass
from megarl.utils import dist as mdist

torch.set_num_threads(1)
T = 0.7


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    mdist.init_distributed(torch.device("cpu"))
    root = tmp_path_factory.mktemp("olp")
    return {"dense": make_tiny_hf_model(root / "dense", "qwen2", lm_head_scale=3.0),
            "moe": make_tiny_hf_model(root / "moe", "qwen3_moe")}


def batch(B: int = 5, P: int = 6, L: int = 7, seed: int = 2) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (B, P + L), generator=g)
    mask = torch.zeros(B, P + L, dtype=torch.long)
    for i in range(B):
        p, r = int(torch.randint(1, P + 1, (1,), generator=g)), int(
            torch.randint(1, L + 1, (1,), generator=g))
        mask[i, P - p:P + r] = 1
    return SequenceBatch(input_ids=ids * mask, attention_mask=mask, response_length=L,
                         tensors={"response_mask": mask[:, P:].float()})


def hf_sum_pi_squared(path, seq: SequenceBatch) -> torch.Tensor:
    """[B, L] float64 sum of squared softmax probabilities of transformers' logits / T."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    L = seq.response_length
    P = seq.input_ids.shape[1] - L
    out = torch.zeros(seq.batch_size, L, dtype=torch.float64)
    with torch.no_grad():
        for i in range(seq.batch_size):  # one unpadded row at a time
            cols = seq.attention_mask[i].bool()
            first = int(cols.nonzero()[0])
            logits = model(seq.input_ids[i, cols][None]).logits[0] / T
            n = int(seq.attention_mask[i, P:].sum())
            rows = logits[P - 1 - first: P - 1 - first + n]
            out[i, :n] = torch.softmax(rows, -1).square().sum(-1)
    return out


def _impls():
    out = [(True, "torch"), (False, "auto")]
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append((True, "triton"))
    return out


@pytest.mark.parametrize("fused,impl", _impls())
def test_sum_pi_squared_matches_float64(paths, fused, impl):
    seq = batch()
    be = TorchBackend("actor", str(paths["dense"]), device="cpu", dtype="fp32",
                      use_fused_kernels=fused, kernel_impl=impl, optim={"lr": 1e-3})
    res = old_logprob_pass(be, seq, T, sum_pi_squared=True)
    want = hf_sum_pi_squared(paths["dense"], seq)
    torch.testing.assert_close(res["sum_pi_squared"].double(), want, rtol=2e-5, atol=1e-6)
    mask = seq.tensors["response_mask"].bool()
    assert float(want[mask].max()) > 0.5 and float(want[mask].min()) < 0.2  # spread
    lp, ent = be.logprobs(seq, temperature=T, with_entropy=True)
    torch.testing.assert_close(res["old_logprob"], lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(res["entropy"], ent, rtol=0, atol=1e-5)
    assert set(res) == {"old_logprob", "entropy", "sum_pi_squared"}
    plain = old_logprob_pass(be, seq, T)
    assert set(plain) == {"old_logprob", "entropy"}


def test_r2_and_sum_pi_squared_in_one_pass(paths):
    from megarl.backends.torch.moe import record_logprobs

    seq = batch()
    be = TorchBackend("actor", str(paths["moe"]), device="cpu", dtype="fp32",
                      router_replay=True, optim={"lr": 1e-3})
    res = old_logprob_pass(be, seq, T, sum_pi_squared=True, record_routing=True)
    lp, _, routed = record_logprobs(be, seq, T)
    assert torch.equal(res["routed_experts"], routed)
    torch.testing.assert_close(res["old_logprob"], lp, rtol=0, atol=1e-6)
    assert res["sum_pi_squared"].shape == lp.shape


@pytest.mark.dist
@pytest.mark.e2e
def test_fsdp2_and_ulysses_on_two_ranks(paths, tmp_path):
    """FSDP2 (rows split over the DP ranks, gathered back): the R2 recording equals one
    process's and the row loop's; sum_pi_squared equals transformers' float64 at FSDP2 (MoE)
    and Ulysses (dense; each rank's sequence shard summed over the group)."""
    from pathlib import Path

    from test_routing_replay_r2 import row_by_row
    from torchrun import run_torchrun

    seq = batch()
    torch.save({"seq": seq, "temperature": T, "moe": str(paths["moe"]),
                "dense": str(paths["dense"])}, tmp_path / "in.pt")
    worker = Path(__file__).resolve().parents[1] / "dist" / "torch_r2_otb_worker.py"
    run_torchrun(worker, 2, [str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], timeout=400,
                 env={"TRITON_INTERPRET": None})
    got = torch.load(tmp_path / "out.pt")
    one = TorchBackend("actor", str(paths["moe"]), device="cpu", dtype="fp32",
                       router_replay=True, optim={"lr": 1e-3})
    want = old_logprob_pass(one, seq, T, sum_pi_squared=True, record_routing=True)
    assert torch.equal(got["fsdp2"]["routed_experts"], want["routed_experts"])
    assert torch.equal(want["routed_experts"].long(), row_by_row(one, seq))
    for key in ("old_logprob", "sum_pi_squared"):
        torch.testing.assert_close(got["fsdp2"][key], want[key], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["ulysses2"]["sum_pi_squared"].double(),
                               hf_sum_pi_squared(paths["dense"], seq), rtol=2e-5, atol=1e-6)
