"""Validation: greedy pass@1 (and mean@n when sampling n > 1) per data source.

Scored by the data source's verifier (the ``naive`` manager), whatever the training reward is,
so PRM-only runs report real accuracy too. Metric names:
  val/test_score/{data_source}      greedy pass@1 (PURE / verl's name)
  val/{data_source}/mean@{n}        mean accuracy of n sampled responses (val_kwargs.n > 1)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from megarl.rollout.protocol import RolloutEngine, SamplingParams
from megarl.trainer.rollout import Scorer, generate


def validate(
    engine: RolloutEngine,
    items: list[Any],
    scorer: Scorer,
    greedy: SamplingParams,
    sampled: SamplingParams | None,
    batch_size: int | None = None,
    tp_size: int = 1,
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    runs = [("test_score", greedy)] + ([("mean", sampled)] if sampled is not None else [])
    bs = batch_size or len(items)
    for name, params in runs:
        totals: dict[str, list[float]] = defaultdict(list)
        for start in range(0, len(items), bs):
            chunk = items[start:start + bs]
            samples = generate(engine, chunk, params, group_offset=start, tp_size=tp_size)
            scores, _ = scorer(samples)
            for s, v in zip(samples, scores.tolist()):
                totals[s.data_source].append(float(v >= 0.5) if name == "test_score" else v)
        for ds, vals in sorted(totals.items()):
            key = f"val/test_score/{ds}" if name == "test_score" else f"val/{ds}/mean@{params.n}"
            metrics[key] = sum(vals) / len(vals)
    return metrics
