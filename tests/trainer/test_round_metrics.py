"""Dynamic sampling's refill rounds report the reward metrics of every response generated in
the step, the same numbers as one reward-manager call over all of them."""

import random

import pytest

from megarl.metrics import Metric
from megarl.rewards.managers import _metrics as one_call_metrics
from megarl.rewards.pool import RewardResult
from megarl.trainer.generation import declare_reward_metrics, merge_round_metrics

SOURCES = ["arith", "gsm8k", "math"]


def _round(rng: random.Random, size: int) -> tuple[list[RewardResult], list[str], list[float]]:
    results, sources, penalties = [], [], []
    for _ in range(size):
        status = rng.choice(["ok", "ok", "ok", "timeout", "error"])
        results.append(RewardResult(rng.random() if status == "ok" else 0.0, {}, status))
        sources.append(rng.choice(SOURCES[: rng.randint(1, 3)]))
        penalties.append(-rng.random() if rng.random() < 0.3 else 0.0)
    return results, sources, penalties


def _scorer_metrics(results, sources, penalties, seconds):
    m = one_call_metrics(results, sources, 0, seconds)
    m["reward/overlong_penalty_mean"] = sum(penalties) / len(penalties)
    return m


def _scorer_round(results, sources, penalties, seconds) -> dict[str, Metric]:
    """What the Scorer reports for one call: the manager's metrics declared by
    `declare_reward_metrics`, the overlong penalty a mean over the call's responses."""
    m = declare_reward_metrics(one_call_metrics(results, sources, 0, seconds), sources)
    m["reward/overlong_penalty_mean"] = Metric.mean(sum(penalties) / len(penalties),
                                                    len(penalties))
    return m


@pytest.mark.parametrize("seed", range(5))
def test_merged_rounds_equal_one_call_over_all_responses(seed):
    rng = random.Random(seed)
    rounds = [_round(rng, rng.choice([16, 24, 40])) for _ in range(rng.randint(2, 4))]
    seconds = [rng.random() for _ in rounds]
    merged = merge_round_metrics([_scorer_round(res, src, pen, t)
                                  for (res, src, pen), t in zip(rounds, seconds)])
    everything = [sum((r[i] for r in rounds), []) for i in range(3)]
    expected = _scorer_metrics(*everything, sum(seconds))
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert merged[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_a_single_round_passes_through_unchanged():
    metrics = {"reward/score/mean": 0.1 + 0.2, "reward/timeouts": 3.0}
    assert merge_round_metrics([declare_reward_metrics(metrics, ["arith"] * 3)]) == metrics
