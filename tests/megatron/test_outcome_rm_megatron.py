"""An outcome reward model (HF *ForSequenceClassification: ``score`` without bias) on the
megatron backend's ``prm`` role: its score at the last token equals transformers' float64
score of each sequence alone."""

from __future__ import annotations

import pytest
import torch

ROWS = [  # (prompt ids, response ids) of the tiny character tokenizer
    ([1, 40, 41, 42, 43, 2, 1, 50], [60, 61, 62, 63, 64, 65, 2]),
    ([1, 44, 45, 2], [70, 71, 72]),
    ([1, 46, 47, 48, 49, 51, 52, 53, 54, 2, 1], [80]),
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_megatron_outcome_rm_scores_like_transformers(tmp_path, mcore_dist, family):
    import transformers

    from megarl.backends.megatron import MegatronBackend
    from megarl.models.testing import make_tiny_hf_model, make_tiny_tokenizer
    from megarl.trainer.outcome_rm import OutcomeRewardModel

    path = make_tiny_hf_model(tmp_path / family, family, head="seq_cls", seed=3)
    backend = MegatronBackend("prm", str(path))
    assert backend.chunks[0].score.bias is None
    got = OutcomeRewardModel(backend, make_tiny_tokenizer()).score(
        [p for p, _ in ROWS], [r for _, r in ROWS]).double()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float64).eval()
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p + r])).logits[0, 0] for p, r in ROWS])
    assert torch.allclose(got, want, atol=1e-5), (got, want)
