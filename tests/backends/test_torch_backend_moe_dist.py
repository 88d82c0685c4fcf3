"""TorchBackend on mixture-of-experts policies (Qwen3-MoE, Qwen2-MoE with a shared expert)
under FSDP2 on 2 gloo ranks: experts are sharded like every parameter and the results equal the
plain single-process model (tests/dist/torch_backend_moe_worker.py); TP>1 is refused clearly.

Bound 1e-5 as the dense layouts (fp32 reduction order). Planted bugs (run by hand): skipping
experts that no token of a rank chose (transformers' loop) leaves their gradients None on that
rank while the other rank has them: FSDP2's backward then dies (gloo "Connection reset by
peer", rank 0 aborted); the metrics forward without the packed row's segment ids (sequences
attending across each other) moves expert loads by 10 / 11 tokens (``metrics_err``) and fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun import run_torchrun

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "torch_backend_moe_worker.py"
TOL = 1e-5
ACTOR_CHECKS = ("export_exact", "logprob_err", "entropy_err", "grad_err", "tokens_metric_err",
                "bit_identical", "adamw3_err", "grad_norm_err")
MODELS = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("moe_backend")
    models = {fam: str(make_tiny_hf_model(d / fam, fam, tokenizer=False)) for fam in MODELS}
    out = d / "results.json"
    run_torchrun(WORKER, 2, ["--models", json.dumps(models), "--work", str(d), "--out", str(out)],
                 timeout=400, env={"TRITON_INTERPRET": None})
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("check", ACTOR_CHECKS)
def test_fsdp2_matches_single_process(results, family, check):
    key = f"{family}_fsdp2/{check}"
    value = results[key]
    if isinstance(value, bool):
        assert value, key
    else:
        assert isinstance(value, float) and value <= TOL, f"{key} = {value} > {TOL}"


@pytest.mark.parametrize("family", MODELS)
def test_routing_metrics_from_backend(results, family):
    """Load / entropy / aux loss of the backend's packed forward equal the plain model's on the
    padded batch (padding excluded on both sides)."""
    assert results[f"{family}/metrics_keys"] is True
    assert results[f"{family}/metrics_err"] <= 1e-5
    assert results[f"{family}/load_sum_ok"] is True


@pytest.mark.parametrize("family", MODELS)
def test_tp_is_refused_with_a_clear_error(results, family):
    msg = results[f"{family}/tp_error"]
    assert msg.startswith("MoE with TP>1 on the torch backend is not supported"), msg
    assert "tensor_model_parallel_size=1" in msg and "FSDP2" in msg
