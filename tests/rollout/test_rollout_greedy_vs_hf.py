"""Greedy generation equals transformers' greedy ``generate`` token for token, per family."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.models.testing import FAMILIES
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine


def _hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family, tiny_folder, hf_model):
    path = tiny_folder(family)
    hf = hf_model(path)
    prompts = prompts_of([5, 2, 11, 7, 3, 9], seed=1)
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=3)  # fewer slots than prompts
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=24))
    assert [c.prompt_index for c in out] == list(range(len(prompts)))
    for prompt, c in zip(prompts, out):
        ref = _hf_greedy(hf, prompt, 24)
        assert c.token_ids == ref, (family, prompt)
        # HF stops at eos (2) and includes it; so must we, with the right reason
        assert c.finish_reason == ("stop" if ref[-1] == 2 else "length")
        assert c.logprobs.shape == (len(ref),) and c.logprobs.dtype == torch.float32


def test_greedy_tied_embeddings_and_temperature_zero(tiny_folder, hf_model):
    path = tiny_folder("llama", tie_word_embeddings=True)
    hf = hf_model(path)
    prompts = prompts_of([4, 8], seed=2)
    engine = TorchRolloutEngine.from_pretrained(path)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert [c.token_ids for c in out] == [_hf_greedy(hf, p, 16) for p in prompts]


def test_generate_validates_input(tiny_folder):
    engine = TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"), max_model_len=16)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 16], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 500]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1, 5]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="top_k"):
        engine.generate([[1, 5]], SamplingParams(top_k=-3))
    with pytest.raises(ValueError, match="n must"):
        engine.generate([[1, 5]], SamplingParams(n=0))
    assert engine.generate([], SamplingParams()) == []
