"""`megarl.metrics` (the Metric value and its one combine) and the backend wire format built on
it (`megarl.backends.metrics.contributions` / `average_union`).

The references are exact: fractions.Fraction over the same parts, and values chosen dyadic so
float64 holds every partial result exactly (the comparisons are equalities; the one bound is
the contributions' mean, whose shares t / total x dp round). Where a test pins the documented
float order itself, the values are chosen so that another order, or the exact sum, gives
another number.

Planted, each failing tests here: the MEAN's parts weighted 1 instead of their weight (21
fail); the merged weight only the first part's (29); MAX taking the first part (1); ``merge``
leaving out a part that lacks a name although ``missing`` is given (2); a MEAN's contribution
without its share (9).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from megarl.backends.metrics import average_union, contributions, share
from megarl.metrics import Metric, Reduce, combine, means, merge, prefixed, values


def _dyadic(rng: random.Random) -> float:
    return rng.randint(-64, 64) / 16


@pytest.mark.parametrize("seed", range(20))
def test_mean_is_the_weighted_mean(seed):
    rng = random.Random(seed)
    parts = [Metric.mean(_dyadic(rng), rng.randint(0, 9)) for _ in range(rng.randint(1, 6))]
    parts.append(Metric.mean(_dyadic(rng), 4))  # total weight > 0
    got = combine(parts)
    num = sum(Fraction(p.value) * p.weight for p in parts)
    den = sum(Fraction(p.weight) for p in parts)
    assert got.value == float(num / den)
    assert got.weight == float(den) and got.reduce is Reduce.MEAN


def test_sum_max_min_last_and_weights():
    parts = [Metric(3.0, 2.0, Reduce.SUM), Metric.sum(-1.5), Metric.sum(4.25)]
    assert combine(parts) == Metric(5.75, 4.0, Reduce.SUM)
    xs = [0.5, 7.0, -2.0, 1.0]
    assert combine([Metric.max(x) for x in xs]) == Metric(7.0, 4.0, Reduce.MAX)
    assert combine([Metric.min(x) for x in xs]) == Metric(-2.0, 4.0, Reduce.MIN)
    assert combine([Metric.last(x) for x in xs]) == Metric(1.0, 4.0, Reduce.LAST)
    assert combine([Metric.mean(2.5, 0.0), Metric.mean(1.0, 0.0)]).value == 0.0  # no weight


def test_sums_run_left_to_right_from_zero():
    """The documented order, not the exact sum (runs are compared bitwise): 1e16 + 1 rounds to
    1e16, so left to right gives 0; the exact sum (and math.fsum) is 1, and right to left 2."""
    xs = [1e16, 1.0, -1e16, 1.0]
    assert math.fsum(xs) == 2.0
    assert combine([Metric.sum(x) for x in xs]).value == 1.0
    assert combine([Metric.mean(x, 1) for x in xs]).value == 0.25
    # a single MEAN part is recomputed, (0 + v w) / w, as when other parts lack the name
    assert combine([Metric.mean(0.1, 3)]).value == (0.1 * 3) / 3 != 0.1


def test_one_metric_reduces_one_way():
    with pytest.raises(ValueError, match=r"actor/x: .*\['mean', 'sum'\]"):
        combine([Metric.mean(1.0), Metric.sum(1.0)], "actor/x")
    with pytest.raises(ValueError, match="nothing to combine"):
        combine([])


def test_merge_union_of_names_with_and_without_missing():
    a = {"x": Metric.mean(1.0), "y": Metric.sum(2.0)}
    b = {"x": Metric.mean(0.5), "z": Metric.max(-1.0)}
    c = {"y": Metric.sum(0.25)}
    got = merge([a, b, c])
    assert list(got) == ["x", "y", "z"]
    assert values(got) == {"x": 0.75, "y": 2.25, "z": -1.0}
    ranks = [{"x": Metric.mean(1.0)}, {}, {"x": Metric.mean(0.5)}, {"w": Metric.mean(2.0)}]
    assert values(merge(ranks, missing=Metric.mean(0.0))) == {"w": 0.5, "x": 0.375}


def test_means_values_and_prefixed():
    assert means({"a": 1, "b": 0.5}, 3.0) == {"a": Metric(1.0, 3.0), "b": Metric(0.5, 3.0)}
    assert prefixed({"loss": 1.0, "grad_norm": 2.0, "actor/pg_loss": 3.0}, "actor") == {
        "actor/loss": 1.0, "actor/grad_norm": 2.0, "actor/pg_loss": 3.0}


def test_average_union_is_the_rank_mean_with_absent_as_zero():
    per_rank = [{"loss": 1.5, "a": 0.25}, {"loss": 0.5, "b": 2.0, "c": -1.25}]
    assert average_union(per_rank) == {"a": 0.125, "b": 1.0, "c": -0.625, "loss": 1.0}


@pytest.mark.parametrize("seed", range(10))
def test_contributions_summed_and_rank_averaged_give_the_mini_batch_mean(seed):
    """A token MEAN reported per micro-batch (value x share), summed over each rank's
    micro-batches and averaged over the DP ranks, is the token-weighted mean over the whole
    mini-batch; a SUM (a normalised loss) passes as it is."""
    rng = random.Random(seed)
    dp = rng.choice([1, 2, 4])
    ranks = [[(_dyadic(rng), rng.randint(0, 8)) for _ in range(rng.randint(1, 3))]
             for _ in range(dp)]
    total = sum(t for r in ranks for _, t in r) or 1
    per_rank = [{} for _ in range(dp)]
    for sums, mbs in zip(per_rank, ranks):
        for v, t in mbs:
            for k, x in contributions({"m": Metric.mean(v, t), "loss": Metric.sum(v)},
                                      total, dp).items():
                sums[k] = sums.get(k, 0.0) + x
    got = average_union(per_rank)
    want = sum(Fraction(v) * t for r in ranks for v, t in r) / total
    assert got["m"] == pytest.approx(float(want), rel=1e-12, abs=1e-12)
    assert got["loss"] == float(sum(Fraction(v) for r in ranks for v, _ in r) / dp)
    assert share(14.0, 40, 2) == 0.7 and share(3.0, 0, 2) == 6.0
    with pytest.raises(ValueError, match="m: .*'max'"):
        contributions({"m": Metric.max(1.0)}, 1, 1)
