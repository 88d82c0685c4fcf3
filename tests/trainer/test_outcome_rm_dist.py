"""An outcome reward model (HF *ForSequenceClassification, no score bias) on 2 ranks of each
backend (torch: tensor parallel over both, FSDP2 over both; megatron: tensor parallel over
both), in one world: its scores equal transformers' float64 scores of each sequence alone.

The worker is this file: ``torchrun --nproc_per_node=2 tests/trainer/test_outcome_rm_dist.py
MODEL OUT_DIR``; rank 0 saves one ``LAYOUT.pt`` per layout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"torch-tp2": {"tp": 2}, "torch-fsdp2": {"dp_shard": 2}, "megatron-tp2": {"tp": 2}}
ROWS = [  # (prompt ids, response ids) of the tiny character tokenizer
    ([1, 40, 41, 42, 43, 2, 1, 50], [60, 61, 62, 63, 64, 65, 2]),
    ([1, 44, 45, 2], [70, 71, 72]),
    ([1, 46, 47, 48, 49, 51, 52, 53, 54, 2, 1], [80]),
    ([1, 55, 56], [81, 82, 83, 84, 2]),
]


def _worker(model: str, out_dir: str) -> None:
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.torch import TorchBackend
    from megarl.models.testing import make_tiny_tokenizer
    from megarl.trainer.outcome_rm import OutcomeRewardModel
    from megarl.utils.dist import destroy, init_distributed, rank

    init_distributed(torch.device("cpu"))
    for name, kw in LAYOUTS.items():
        backend = (MegatronBackend("prm", model, **kw) if name.startswith("megatron")
                   else TorchBackend("prm", model, device="cpu", **kw))
        orm = OutcomeRewardModel(backend, make_tiny_tokenizer())
        scores = orm.score([p for p, _ in ROWS], [r for _, r in ROWS])
        if rank() == 0:
            torch.save(scores, os.path.join(out_dir, f"{name}.pt"))
    destroy()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    from warm_runs import run_script

    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("orm_dist")
    model = make_tiny_hf_model(d / "rm", "llama", head="seq_cls", seed=11)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = run_script([str(Path(__file__)), str(model), str(d)], ROOT, env, timeout=600, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        model, dtype=torch.float64).eval()
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p + r])).logits[0, 0] for p, r in ROWS])
    return d, want


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outcome_rm_scores_on_two_ranks(results, layout):
    d, want = results
    got = torch.load(d / f"{layout}.pt").double()
    assert torch.allclose(got, want, atol=1e-5), (layout, got, want)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
