"""Validation: one pass over the held-out prompts with ``rollout.val_kwargs``' sampling, as verl.

Greedy (``do_sample=false``, the default) generates one response per prompt; ``do_sample=true``
samples ``n`` responses per prompt at the validation temperature / top-k / top-p, for any n
(n=1 with a temperature is DAPO's avg@1). Scored by the data source's verifier (the ``naive``
manager), whatever the training reward is, so PRM-only runs report real accuracy too.

Metric names, per data source ``ds`` (reward = the verifier's score of a response):
  val-core/{ds}/reward/mean@{n}      mean reward of all responses (verl's headline name)
  val/test_score/{ds}                fraction of responses scored correct (>= 0.5): greedy
                                     pass@1, or the mean accuracy of the samples (PURE's name)
  val-aux/{ds}/reward/std@{n}        per-prompt std of the n rewards, averaged   (n > 1)
  val-aux/{ds}/reward/best@{n}/mean  per-prompt best of the n rewards, averaged  (n > 1)
  val-aux/{ds}/reward/worst@{n}/mean per-prompt worst of the n rewards, averaged (n > 1)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from megarl.rollout.protocol import RolloutEngine, SamplingParams
from megarl.trainer.generation import AgentRollout, Scorer, generate


def validate(
    engine: RolloutEngine,
    items: list[Any],
    scorer: Scorer,
    params: SamplingParams,
    batch_size: int | None = None,
    tp_size: int = 1,
    on_scored: Callable[[list[Any], list[float]], None] | None = None,
    agent: AgentRollout | None = None,
) -> dict[str, float]:
    """Generate ``params.n`` responses per item (``batch_size`` prompts at a time) and score them.

    Returns the metrics above; ``n`` in their names is ``params.n``. ``on_scored(samples,
    scores)`` receives every response and its reward at the end (to dump them). ``agent``:
    multi-turn rollouts with tools (the agent loop), as in training."""
    by_prompt: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    bs = batch_size or len(items)
    all_samples: list[Any] = []
    all_scores: list[float] = []
    for start in range(0, len(items), bs):
        chunk = items[start:start + bs]
        samples = generate(engine, chunk, params, group_offset=start, tp_size=tp_size,
                           agent=agent)
        scores, _ = scorer(samples)
        for s, v in zip(samples, scores.tolist()):
            by_prompt[s.data_source][s.group].append(float(v))
        if on_scored is not None:
            all_samples += samples
            all_scores += scores.tolist()
    if on_scored is not None:
        on_scored(all_samples, all_scores)
    return reward_metrics(by_prompt, params.n)


def reward_metrics(by_prompt: dict[str, dict[int, list[float]]], n: int) -> dict[str, float]:
    """The metrics above from {data source: {prompt: [reward of each of its n responses]}}."""
    metrics: dict[str, float] = {}
    for ds, groups in sorted(by_prompt.items()):
        rewards = [v for vals in groups.values() for v in vals]
        metrics[f"val-core/{ds}/reward/mean@{n}"] = sum(rewards) / len(rewards)
        metrics[f"val/test_score/{ds}"] = sum(v >= 0.5 for v in rewards) / len(rewards)
        if n > 1:
            per = list(groups.values())
            metrics[f"val-aux/{ds}/reward/std@{n}"] = statistics.fmean(
                statistics.pstdev(v) for v in per)
            metrics[f"val-aux/{ds}/reward/best@{n}/mean"] = statistics.fmean(max(v) for v in per)
            metrics[f"val-aux/{ds}/reward/worst@{n}/mean"] = statistics.fmean(
                min(v) for v in per)
    return metrics
