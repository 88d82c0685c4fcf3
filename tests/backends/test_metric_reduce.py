"""The one metric reducer (`megarl.backends.metrics.reduce_metrics`) when ranks report different
keys, directly and inside both backends' ``train_step`` (2 gloo ranks, DP=2; ~40 s on 2 cores).

The brute force below is independent of the reducer: for every key any rank reported, the exact
(fractions.Fraction) sum over ranks of each rank's micro-batch sum (0 where the rank never
reported the key), halved. The worker's values are dyadic rationals, so float64 reproduces it
exactly: the comparison is equality, and every rank must hold the same result.

Planted (the former megatron reduction, an all-reduce of each rank's own ``sorted(keys)``): the
worker did not finish within the timeout (``dp_same_count`` had already come back wrong:
``a = 1.125``, the mean of rank 0's ``a`` and rank 1's ``b``, instead of 0.125; then the
all-reduce of 2 values against 4 in ``dp_diff_count`` never returned).
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrun import run_torchrun  # noqa: E402

pytestmark = pytest.mark.dist
WORKER = Path(__file__).resolve().parents[1] / "dist" / "metric_reduce_worker.py"
STEP_KEYS = {"grad_norm", "lr", "skipped"}  # added by the optimizer step after the reduction


def brute_force(inputs: list[list[dict]], last_stage_only: bool = False) -> dict[str, float]:
    """{key: mean over ranks of the rank's sum over micro-batches (0 where absent)}; on a
    pipeline every rank gets the last stage's sums."""
    if last_stage_only:
        return {k: float(sum(Fraction(d.get(k, 0)) for d in inputs[-1]))
                for k in {k for d in inputs[-1] for k in d}}
    keys = {k for rank in inputs for d in rank for k in d}
    return {k: float(sum(Fraction(d.get(k, 0)) for rank in inputs for d in rank) / len(inputs))
            for k in keys}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from megarl.models.testing import make_tiny_hf_model

    models = tmp_path_factory.mktemp("models")
    make_tiny_hf_model(models / "llama", family="llama")
    out = tmp_path_factory.mktemp("out")
    run_torchrun(WORKER, 2, [str(models), str(out)], timeout=300)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case", ["dp_same_count", "dp_diff_count", "pp", "torch", "megatron"])
def test_union_of_keys_equals_brute_force(results, case):
    res = results[case]
    expected = brute_force(res["inputs"], last_stage_only=case == "pp")
    assert len({k for rank in res["inputs"] for d in rank for k in d}) > len(
        {k for d in res["inputs"][0] for k in d}), "the ranks must report different keys"
    for rank, got in enumerate(res["outputs"]):
        got = {k: v for k, v in got.items() if k not in STEP_KEYS}
        assert got == expected, (case, rank)
