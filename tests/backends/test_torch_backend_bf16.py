"""The torch backend in bf16 (bf16 compute, fp32 masters) against transformers run in bf16 on
the same weights, not against fp32: bounds set by bf16 itself, tight enough that a 5%
temperature error or a wrong softmax normaliser fails them.

The tiny random models' logits are near uniform (std ~0.8), which hides such errors, so the
model's lm_head is scaled by 3 (logit std ~2.5, as in real LLMs). Workers:
tests/dist/torch_backend_bf16.py (one process, and 2 ranks for FSDP2 / TP2 / PP2).

Measured (AMD EPYC, 2 cores), logprob |diff| max / mean, gradient relative L2:
  one process, FSDP2, PP2: 0.030 / 0.0074, 0.008 (the same op order as transformers)
  TP2: 0.068 / 0.032, 0.015. TP sums bf16 partial products in another order: its distance to
       transformers' bf16 equals both bf16 runs' distance to fp32 (mean 0.036 and 0.038).
Planted in the reference (the distance a backend with that bug would have): temperature
1.05 T -> 0.81 / 0.38, gradients 0.061; a normaliser over half the vocabulary -> 2.7 / 0.64.
Every bound below fails on both (the mean bound by 7x, the gradient bound by 2x).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from warm_runs import run_script

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "torch_backend_bf16.py"
LP_MAX, LP_MEAN, GRAD_REL = 0.15, 0.05, 0.03


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("bf16_backend")
    model = make_tiny_hf_model(d / "m", "qwen3", attention_bias=True, tokenizer=False,
                               lm_head_scale=3.0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    out: dict = {}
    for nproc in (1, 2):
        path = d / f"{nproc}.json"
        # 2: as torchrun --standalone, the ranks forked from a warm interpreter
        proc = run_script([str(WORKER), str(model), str(path)], ROOT, env, timeout=600,
                          nproc=None if nproc == 1 else nproc)
        if proc.returncode != 0 or not path.is_file():
            pytest.fail(f"bf16 worker x{nproc} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        out.update(json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("layout", ["single", "fsdp2", "tp2", "pp2"])
def test_bf16_backend_matches_bf16_transformers(results, layout):
    r = results[layout]
    assert r["lp_max"] < LP_MAX and r["lp_mean"] < LP_MEAN, r
    assert r["grad_rel"] < GRAD_REL, r


def test_the_bounds_catch_the_planted_bugs(results):
    """The same measures for bugs planted in the reference: each breaks a bound."""
    planted = results["single"]["planted"]
    assert planted["temperature_1.05"]["lp_mean"] > LP_MEAN
    assert planted["temperature_1.05"]["grad_rel"] > GRAD_REL
    assert planted["half_vocab"]["lp_mean"] > LP_MEAN and planted["half_vocab"]["lp_max"] > LP_MAX
