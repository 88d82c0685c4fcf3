"""One metric value and the one way metrics are merged.

A `Metric` is a value, the weight it stands for, and how it reduces when the same metric of
several parts is merged (micro-batches, mini-batches and epochs, generation rounds, ranks):

    MEAN  weighted mean, sum(value x weight) / sum(weight); the weight counts what the value is
          a mean over (tokens, responses, optimizer steps, ranks)
    SUM   counts and seconds: sum(value)
    MAX   largest value;  MIN  smallest value;  LAST  the last part's value

A metric declares its reduction once, where it is made; `combine` (one name) and `merge`
(dicts of metrics, the union of their names) are the only code that reduces metrics. The
merged weight of every kind is the sum of the parts' weights.

The arithmetic is part of the contract (runs are compared bitwise across versions): sums start
at 0.0 and add the parts one at a time in the order given (``total += value * weight``), in
float64; a mean divides the weighted sum by the summed weight once, and is computed even for a
single part (so a name's value does not depend on how many parts hold it). No reordering, no
pairwise or compensated summation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum


class Reduce(str, Enum):
    """How a metric merges over parts (module docstring)."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    LAST = "last"


@dataclass(frozen=True)
class Metric:
    """``value`` (float), the ``weight`` it stands for (>= 0; a MEAN's count of tokens,
    responses, steps or ranks; 1 when unweighted) and its reduction ``reduce``."""

    value: float
    weight: float = 1.0
    reduce: Reduce = Reduce.MEAN

    @classmethod
    def mean(cls, value: float, weight: float = 1.0) -> Metric:
        """A mean over ``weight`` tokens / responses / steps."""
        return cls(value, weight, Reduce.MEAN)

    @classmethod
    def sum(cls, value: float) -> Metric:
        """A count or a duration: merged parts add up."""
        return cls(value, 1.0, Reduce.SUM)

    @classmethod
    def max(cls, value: float) -> Metric:
        return cls(value, 1.0, Reduce.MAX)

    @classmethod
    def min(cls, value: float) -> Metric:
        return cls(value, 1.0, Reduce.MIN)

    @classmethod
    def last(cls, value: float) -> Metric:
        return cls(value, 1.0, Reduce.LAST)


def combine(parts: Sequence[Metric], name: str = "metric") -> Metric:
    """The parts of one metric, in order, as one (module docstring for the arithmetic). A MEAN
    of total weight 0 is the weighted sum (0.0 for finite values). All parts must reduce the
    same way; ``name`` names the metric in that error."""
    if not parts:
        raise ValueError(f"{name}: nothing to combine")
    kind = parts[0].reduce
    if any(p.reduce is not kind for p in parts):
        kinds = sorted({p.reduce.value for p in parts})
        raise ValueError(f"{name}: its parts reduce in different ways {kinds}; a metric "
                         "declares one reduction")
    weight = 0.0
    for p in parts:
        weight += p.weight
    if kind is Reduce.MEAN:
        total = 0.0
        for p in parts:
            total += p.value * p.weight
        return Metric(total / weight if weight else total, weight, kind)
    if kind is Reduce.SUM:
        total = 0.0
        for p in parts:
            total += p.value
        return Metric(total, weight, kind)
    if kind is Reduce.MAX:
        return Metric(max(p.value for p in parts), weight, kind)
    if kind is Reduce.MIN:
        return Metric(min(p.value for p in parts), weight, kind)
    return Metric(parts[-1].value, weight, kind)


def merge(parts: Sequence[Mapping[str, Metric]],
          missing: Metric | None = None) -> dict[str, Metric]:
    """{name: `combine` of the parts holding it, in the parts' order} over the union of the
    parts' names, sorted. ``missing``: what a part lacking a name contributes in its place
    (e.g. 0 for a rank that reported nothing of a sum); None: such a part is left out."""
    names = sorted({name for part in parts for name in part})
    if missing is None:
        return {n: combine([part[n] for part in parts if n in part], n) for n in names}
    return {n: combine([part.get(n, missing) for part in parts], n) for n in names}


def means(values: Mapping[str, float], weight: float = 1.0) -> dict[str, Metric]:
    """Plain numbers as MEAN metrics of one ``weight`` each (e.g. one optimizer step's)."""
    return {name: Metric.mean(float(v), weight) for name, v in values.items()}


def values(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """{name: value}: what the step's record and the sinks take."""
    return {name: m.value for name, m in metrics.items()}


def prefixed(metrics: Mapping[str, float], scope: str) -> dict[str, float]:
    """Names without a scope (no ``/``: a backend's own ``loss``, ``grad_norm``, ``lr``,
    ``skipped``) put under ``scope/``; scoped names (``actor/pg_loss``) kept."""
    return {(name if "/" in name else f"{scope}/{name}"): v for name, v in metrics.items()}
