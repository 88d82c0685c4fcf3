"""The bf16 engine's sampling logprobs against transformers run in bf16 (not fp32), on a model
whose logits have real spread, at bounds that a 5% temperature error or a wrong normaliser
breaks.

The reference decodes the engine's own tokens incrementally with transformers' KV cache in
bf16 (the engine's order of operations: a prefill, then one token at a time), then takes
log_softmax(logits / T) in float64. The tiny random models have near-uniform logits (std 0.8),
which hide a temperature error (the error of T' = 1.05 T is ~0.05 |z - E z|), so the lm_head is
scaled by 3 (logit std 2.5, as in real LLMs).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine

LM_HEAD_SCALE = 3.0
# Measured (qwen2, qwen3; T 1.0, 0.7; 2-core Xeon): engine vs reference max 0.071, mean 0.0067.
# Planted T' = 1.05 T moves the same logprobs by max 0.22-0.32, mean 0.048-0.072; a normaliser
# over half the vocabulary (a TP shard's own logsumexp) by mean 0.74-2.6.
MAX_BOUND, MEAN_BOUND = 0.15, 0.02


def spread_folder(tmp_path_factory, family: str):
    """A tiny random `family` LM folder with its lm_head scaled by LM_HEAD_SCALE."""
    from megarl.models.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp(f"bf16_{family}") / "m", family,
                              lm_head_scale=LM_HEAD_SCALE)


def hf_bf16_incremental_logits(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64 logits predicting each of `tokens`: transformers in bf16, the
    prompt in one forward, then one token at a time through its KV cache."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        rows = [out.logits[0, -1]]
        for t in tokens[:-1]:
            out = hf(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows).double()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_bf16_engine_logprobs_match_bf16_transformers(tmp_path_factory, family, temperature):
    """Engine (bf16) sampling logprobs = transformers (bf16) log_softmax(z / T) of the same
    tokens: max |diff| < 0.15 and mean |diff| < 0.02 (measured 0.071 / 0.0067). Planted
    bugs (applied to the reference on the same tokens): T' = 1.05 T -> mean 0.048-0.072 (fails
    the mean bound by 2.4x or more) and max 0.22-0.32; a normaliser over half the vocabulary
    -> mean 0.74-2.6. Planted in the engine's sampler (T' = 1.05 T): max 0.24-0.40, all four
    cases fail. A bound of 0.1 on the unscaled model would pass it (max 0.08 there)."""
    import transformers

    path = spread_folder(tmp_path_factory, family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=4, dtype=torch.bfloat16)
    assert engine.dtype == torch.bfloat16
    prompts = prompts_of([5, 9, 3], seed=6)
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, temperature=temperature,
                                                  seed=4))
    diffs, spread = [], []
    for c in out:
        logits = hf_bf16_incremental_logits(hf, prompts[c.prompt_index], c.token_ids)
        spread.append(logits.std(-1))
        ref = torch.log_softmax(logits / temperature, -1).gather(
            1, torch.tensor(c.token_ids)[:, None])[:, 0]
        diffs.append(c.logprobs.double() - ref)
    d = torch.cat(diffs).abs()
    assert float(torch.cat(spread).mean()) > 2.0  # the logits have real spread
    assert d.numel() >= 50
    assert float(d.max()) < MAX_BOUND, float(d.max())
    assert float(d.mean()) < MEAN_BOUND, float(d.mean())
