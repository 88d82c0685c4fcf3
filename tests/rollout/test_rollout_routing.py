"""Routed experts recorded by the torch engine (``return_routed_experts``) for routing replay.

Reference: transformers' forward of each whole sequence (prompt + generated tokens, no KV
cache) with ``output_router_logits=True``; the experts a token was routed to in a sparse layer
are the top-k of the softmax of its router logits there (transformers' Qwen3MoeTopKRouter /
Qwen2-MoE router: softmax, then top-k). Greedy decoding, 2 sparse layers, 4 experts, top-2:
every recorded prompt and response row equals transformers' choice, in order; the last
response token's row is -1 (the engine never runs it). The recording does not depend on
continuous batching (3 slots with sequences retiring and moving) nor on sharing a prefill
among the n samples of a prompt.

Planted bugs (run by hand): decode rows dealt to the active sequences in reverse order: the
first completion already differs from transformers (both families) and from the one-by-one
run; every prompt's prefill rows taken from the chunk's first (shortest) prompt: prompt 0
differs; the first recorded row dropped: the engine's length check raises (16 rows for a
sequence of 17). Each fails below.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.models.moe import routing_dtype
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine

FAMILIES = ("qwen3_moe", "qwen2_moe")
SP = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)


def hf_experts(hf, ids: list[int]) -> torch.Tensor:
    """[T, n_sparse, k] experts transformers routes each token of ``ids`` to."""
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    per_layer = [torch.softmax(r.float(), -1).topk(k, dim=-1).indices for r in out.router_logits]
    return torch.stack(per_layer, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_experts_equal_transformers_routing(family, tiny_folder, hf_model):
    path = tiny_folder(family)
    hf = hf_model(path)
    prompts = prompts_of([5, 2, 11, 7], seed=1)
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3,
                                                return_routed_experts=True)
    completions = engine.generate(prompts, SP)
    assert [c.token_ids for c in completions] == [
        c.token_ids for c in TorchRolloutEngine.from_pretrained(path).generate(prompts, SP)]
    response_rows = 0
    for c in completions:
        seq = prompts[c.prompt_index] + c.token_ids
        got = c.routed_experts
        assert got.dtype == routing_dtype(4) and tuple(got.shape) == (len(seq), 2, 2)
        assert (got[-1] == -1).all()
        want = hf_experts(hf, seq)
        assert torch.equal(got[:-1].long(), want[:-1]), c.prompt_index
        response_rows += len(c.token_ids) - 1
    assert response_rows == 4 * (SP.max_new_tokens - 1)


def test_samples_sharing_a_prefill_and_one_by_one(tiny_folder):
    """n=3 seeded samples per prompt (one shared prefill each), 2 slots: each completion's
    routing equals generating that prompt alone, one slot."""
    path = tiny_folder("qwen3_moe")
    prompts = prompts_of([6, 9], seed=4)
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_new_tokens=8, ignore_eos=True)
    batched = TorchRolloutEngine.from_pretrained(path, max_num_seqs=2, return_routed_experts=True)
    alone = TorchRolloutEngine.from_pretrained(path, max_num_seqs=1, return_routed_experts=True)
    got = batched.generate(prompts, sp)
    assert len({tuple(c.token_ids) for c in got}) > 2  # the samples differ
    for i, p in enumerate(prompts):
        ref = alone.generate([p], sp, prompt_keys=[i])
        for c, r in zip(got[3 * i: 3 * i + 3], ref, strict=True):
            assert c.token_ids == r.token_ids
            assert torch.equal(c.routed_experts, r.routed_experts)
            assert torch.equal(c.routed_experts[: len(p)], ref[0].routed_experts[: len(p)])


def test_off_by_default_and_refused_for_dense(tiny_folder):
    path = tiny_folder("qwen3_moe")
    (c,) = TorchRolloutEngine.from_pretrained(path).generate([[1, 5, 6]], SP)
    assert c.routed_experts is None
    with pytest.raises(ValueError, match="return_routed_experts needs a mixture-of-experts"):
        TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"), return_routed_experts=True)
