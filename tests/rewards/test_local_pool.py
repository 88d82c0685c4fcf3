"""The local pool under hostile inputs: bounded time and memory, crash retry, order, metrics."""

import random
import sys
import time

import pytest
from reward_cases import MIXED

from megarl.rewards import (
    RewardFnSpec,
    RewardRequest,
    compute_score,
    make_reward_manager,
    make_reward_pool,
)

pytestmark = pytest.mark.timeout(180)


def _mixed_requests(path):
    spec = RewardFnSpec(kind="custom", path=path, name="compute")
    return [RewardRequest("math", resp, gt, {"mode": mode}, spec) for mode, resp, gt, _, _ in MIXED]


def test_order_and_reuse_on_a_large_batch(pool2):
    rng = random.Random(0)
    reqs, expected = [], []
    for _ in range(300):
        a, b = rng.randint(-999, 999), rng.randint(-999, 999)
        ans = a + b if rng.random() < 0.5 else a + b + rng.choice([-1, 1])
        reqs.append(RewardRequest("arith", f"{a} + {b} = \\boxed{{{ans}}}", str(a + b)))
        expected.append(1.0 if ans == a + b else 0.0)
    t0 = time.perf_counter()
    first = pool2.score(reqs)
    second = pool2.score(reqs)  # the same warm workers answer again
    assert time.perf_counter() - t0 < 30
    assert [r.score for r in first] == expected == [r.score for r in second]
    assert all(r.status == "ok" for r in first)
    # Independent of the pool: the in-process function gives the same numbers.
    assert [compute_score(r.data_source, r.solution_str, r.ground_truth) for r in reqs[:50]] == expected[:50]


def test_hostile_model_outputs_score_zero_and_pool_survives(pool2, tmp_path):
    tower = "\\boxed{9^{9^{9^{9}}}}"
    pwned = tmp_path / "pwned"  # created only if a scorer executed the model's code
    inject = f"__import__('os').system('touch {pwned}')"
    hostile = [
        ("countdown", "<answer>10**10**10</answer>", {"target": 1, "numbers": [10, 10, 10]}),
        ("countdown", "<answer>9**9**9**9</answer>", {"target": 1, "numbers": [9, 9, 9, 9]}),
        ("countdown", f"<answer>{inject}</answer>", {"target": 1, "numbers": [1]}),
        ("countdown", "<answer>" + "(" * 10000 + "1" + ")" * 10000 + "</answer>", {"target": 1, "numbers": [1]}),
        ("math", "\\boxed{10^{10^{10}}}", "5"),
        ("math", tower, "5"),
        ("math", f"\\boxed{{{inject}}}", "0"),
        ("math", "\\boxed{" + "(" * 10000 + "1" + ")" * 10000 + "}", "1"),
        ("math", "x" * 2**20 + "\\boxed{" + "7" * 2**20 + "}", "5"),
        ("math", "\\boxed{" + "(" * 500 + "1" + ")" * 500 + "}", "2"),  # slow LaTeX parse
        ("math", "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}", "2"),
        ("gsm8k", "#### " + "9" * 2**20, "1"),
    ]
    reqs = [RewardRequest(*h) for h in hostile] + [RewardRequest("math", "\\boxed{\\frac{2}{4}}", "0.5")]
    t0 = time.perf_counter()
    res = pool2.score(reqs)
    elapsed = time.perf_counter() - t0
    assert [r.score for r in res[:-1]] == [0.0] * len(hostile)
    assert all(r.status in ("ok", "timeout") for r in res)
    assert res[-1] == (1.0, {}, "ok")
    assert not pwned.exists()
    # Slow cases are cut by math-verify's 2 s alarm or the pool's 3 s timeout, 2 workers.
    assert elapsed < 3.0 * len(hostile) / 2 + 10
    assert pool2.score([RewardRequest("arith", "\\boxed{3}", "3")])[0].score == 1.0


def test_math_verify_timeout_counts_as_a_timeout(pool2):
    # math-verify's own alarm (2 s) ends this before the pool's 3 s kill; either way the worker
    # reports "timeout" and the pool counts it, and the worker keeps serving.
    before = dict(pool2.stats)
    res = pool2.score([RewardRequest("math", "\\boxed{9^{9^{9}}}", "1"),
                       RewardRequest("math", "\\boxed{\\frac{2}{4}}", "0.5")])
    assert [(r.score, r.status) for r in res] == [(0.0, "timeout"), (1.0, "ok")]
    assert pool2.stats["reward/timeouts"] - before["reward/timeouts"] == 1
    assert pool2.stats["reward/errors"] == before["reward/errors"]


# A custom function that scores with megarl's math verifier while math-verify's sympy
# comparison is broken (a planted fault inside math-verify).
MATH_VERIFY_FAULT_FN = """
import math_verify.grader

from megarl.rewards import compute_score


def _fault(*args, **kwargs):
    raise ZeroDivisionError("planted fault inside math-verify")


def compute(data_source, solution_str, ground_truth, extra_info=None):
    real = math_verify.grader.sympy_expr_eq
    math_verify.grader.sympy_expr_eq = _fault
    try:
        return compute_score(data_source, solution_str, ground_truth, extra_info)
    finally:
        math_verify.grader.sympy_expr_eq = real
"""


def test_math_verify_fault_is_counted_as_an_error(pool2, tmp_path):
    """A fault inside math-verify reaches the pool's and the manager's reward/errors with status
    "error"; the same right answer (1/2 = 0.5, decided by math-verify) scores 1.0 "ok" without the
    fault. Planted bug: math_verify_equal catching the fault as False -> (0.0, "ok"), errors +0."""
    path = tmp_path / "mv_fault.py"
    path.write_text(MATH_VERIFY_FAULT_FN)
    spec = RewardFnSpec(kind="custom", path=str(path), name="compute")
    right = ("math", "\\boxed{\\frac{2}{4}}", "0.5")
    before = dict(pool2.stats)
    res = pool2.score([RewardRequest(*right, None, spec), RewardRequest(*right)])
    assert [(r.score, r.status) for r in res] == [(0.0, "error"), (1.0, "ok")]
    assert "AnswerCheckError" in res[0].extra["error"]
    assert pool2.stats["reward/errors"] - before["reward/errors"] == 1
    mgr = make_reward_manager("naive", pool2, {"path": str(path), "name": "compute"})
    scores, metrics = mgr([right[1], "\\boxed{7}"], ["math", "math"], [right[2], "8"], [{}, {}])
    assert scores.tolist() == [0.0, 0.0]
    assert metrics["reward/errors"] == 1  # the fault; 7 vs 8 is a wrong answer, not an error


def test_pool_timeout_bounds_the_wall_time_of_a_slow_answer():
    """The pool's timeout is a bound on wall time. `9^{9^{9}}` keeps math-verify busy until its
    own 2 s alarm (2.0 s in a worker, 3.0 s in-process); a pool with timeout_s=0.5 must cut it
    at 0.5 s + 1.0 s slack (kill, reap, fork a replacement; measured 0.52-0.54 s on a 2-core
    Xeon). Planted bug: the pool's deadline 10x late -> 2.0-2.1 s (math-verify's alarm ends it,
    still status "timeout") and only the wall-time bound fails."""
    slow = RewardRequest("math", "\\boxed{9^{9^{9}}}", "1")
    with make_reward_pool("local", num_workers=1, timeout_s=0.5, memory_mb=512) as pool:
        assert pool.score([RewardRequest("math", "\\boxed{\\frac{2}{4}}", "0.5")])[0].score == 1.0
        t0 = time.perf_counter()
        res = pool.score([slow])
        elapsed = time.perf_counter() - t0
        assert (res[0].score, res[0].status) == (0.0, "timeout")
        assert "timed out after 0.5 s" in res[0].extra["error"]
        assert elapsed < 0.5 + 1.0, f"{elapsed:.2f} s"
        assert pool.score([RewardRequest("math", "\\boxed{3}", "3")])[0] == (1.0, {}, "ok")


def test_hostile_functions_identical_for_one_and_two_workers(pool2, hostile_path):
    reqs = _mixed_requests(hostile_path)
    with make_reward_pool("local", num_workers=1, timeout_s=3.0, memory_mb=512) as pool1:
        before = dict(pool1.stats)
        res1 = pool1.score(reqs)
        assert pool1.stats["reward/timeouts"] - before["reward/timeouts"] == 1
        assert pool1.stats["reward/errors"] - before["reward/errors"] == 4
        assert pool1.stats["reward/crash_retries"] - before["reward/crash_retries"] == 3  # alloc, exit, segv
        assert pool1.score(reqs[:1])[0] == (1.0, {}, "ok")  # still serving
    res2 = pool2.score(reqs)
    assert [(r.score, r.status) for r in res1] == [(r.score, r.status) for r in res2]
    assert [(r.score, r.status) for r in res2] == [(m[3], m[4]) for m in MIXED]
    by_mode = {m[0]: r for m, r in zip(MIXED, res2)}
    assert "MemoryError" in by_mode["alloc"].extra["error"]
    assert "SIGSEGV" in by_mode["segv"].extra["error"]
    assert "code 7" in by_mode["exit"].extra["error"]
    assert "after one retry" in by_mode["exit"].extra["error"]
    assert "custom function failed" in by_mode["raise"].extra["error"]
    assert by_mode["dict"].extra == {"acc": 1, "note": "hi"}


def test_manager_counts_metrics(pool2, hostile_path):
    mgr = make_reward_manager("naive", pool2, {"path": hostile_path, "name": "compute", "reward_kwargs": {"bonus": 0.25}})
    modes = [m[0] for m in MIXED]
    scores, metrics = mgr([m[1] for m in MIXED], ["math"] * len(MIXED), [m[2] for m in MIXED], [{"mode": x} for x in modes])
    expected = [m[3] + (0.25 if m[4] == "ok" else 0.0) for m in MIXED]
    assert scores.tolist() == pytest.approx(expected)
    assert metrics["reward/timeouts"] == 1
    assert metrics["reward/errors"] == 4
    assert metrics["reward/missing_ground_truth"] == 0
    assert metrics["reward/score/math"] == pytest.approx(sum(expected) / len(expected))


def test_worker_that_cannot_start_is_a_clear_error(monkeypatch):
    # Neither the zygote nor a directly started worker can run: after 3 failed starts the pool
    # stops with an error that names the knobs, instead of retrying forever.
    monkeypatch.setattr(sys, "executable", "/bin/false")
    pool = make_reward_pool("local", num_workers=1, timeout_s=2.0, memory_mb=512)
    with pytest.raises(RuntimeError, match="failed to start 3 times.*memory_mb"):
        pool.score([RewardRequest("arith", "\\boxed{1}", "1")])
    pool.close()


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="reward_model.pool"):
        make_reward_pool("threads")
    with pytest.raises(ValueError, match="num_workers"):
        make_reward_pool("local", num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        make_reward_pool("local", timeout_s=0)
