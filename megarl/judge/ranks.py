"""The generative judge in an SPMD run: every rank scores a share of the step's responses.

Every rank holds the same step batch and its own judge engine (built at start-up on its own
device). Rank r scores the contiguous slice ``share(B, W, r)`` of the B responses; the ranks'
scores are gathered in rank order, so every rank ends with the same B scores. The metrics are
merged as if one judge had scored all B (means weighted by what each is a mean over; the time
is the slowest rank's).

An error of one rank's judge (`JudgeTimeoutError` past ``reward_model.rollout.timeout_s``) is
gathered with the scores, so every rank raises it at the same point instead of the others
waiting forever in the gather: the run then ends through its normal error path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.judge.judge import Judge, JudgeTimeoutError
from megarl.metrics import Metric, merge
from megarl.utils import dist as mdist

# reward/judge_* metrics that are means over the responses judged (prompt within
# prompt_length); the others are means over all responses
PER_JUDGED = ("reward/judge_unparsed_ratio", "reward/judge_truncated_ratio",
              "reward/judge_verdict_tokens/mean")
TIME = "reward/judge_time_s"


def share(n: int, world: int, rank: int) -> range:
    """Indices of the ``n`` responses rank ``rank`` of ``world`` judges (contiguous slices,
    sizes differing by at most one)."""
    return range(rank * n // world, (rank + 1) * n // world)


def declared(metrics: dict[str, float], b: int) -> dict[str, Metric]:
    """One rank's `Judge.score` metrics over its ``b`` responses, with the weight each mean
    stands for (the judged count for `PER_JUDGED`, else ``b``) and the time as a MAX."""
    judged = b - round(metrics.get("reward/judge_overlong_ratio", 0.0) * b)
    out: dict[str, Metric] = {}
    for key, value in metrics.items():
        if key == TIME:
            out[key] = Metric.max(value)
        else:
            out[key] = Metric.mean(value, judged if key in PER_JUDGED else b)
    return out


def judge_samples(judge: Judge, samples: Sequence[Any], tokenizer: Any,
                  ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """(scores float32 [B], metrics) of rollout ``samples`` (``.prompt_ids``,
    ``.response_ids``, ``.ground_truth``) by the generative judge; collective (every rank
    calls it with the same samples). The question is the decoded prompt as the policy saw it,
    the response its decoded text (special tokens dropped). Metrics: the judge's
    reward/judge_* (`Judge.score`), MEANs over the B responses (or over those judged), and
    reward/judge_time_s, the slowest rank's seconds, a SUM (generation rounds add up)."""
    n, world, rank = len(samples), mdist.world_size(), mdist.rank()
    mine = [samples[i] for i in share(n, world, rank)]
    result: tuple[str, Any] | None
    try:
        if mine:
            prompts = tokenizer.batch_decode([list(s.prompt_ids) for s in mine],
                                             skip_special_tokens=True)
            responses = tokenizer.batch_decode([list(s.response_ids) for s in mine],
                                               skip_special_tokens=True)
            scores, metrics = judge.score(prompts, responses,
                                          [getattr(s, "ground_truth", None) for s in mine])
            result = ("ok", (scores.tolist(), declared(metrics, len(mine))))
        else:
            result = ("ok", ([], {}))
    except Exception as err:  # every rank raises it after the gather (module doc)
        result = ("error", (type(err).__name__, str(err)))
        local = err
    else:
        local = None
    gathered = mdist.all_gather_objects(result)
    if local is not None:
        raise local
    for r, (status, payload) in enumerate(gathered):
        if status == "error":
            kind, text = payload
            cls = JudgeTimeoutError if kind == JudgeTimeoutError.__name__ else RuntimeError
            raise cls(f"rank {r}'s {'' if cls is JudgeTimeoutError else kind + ' in the '}"
                      f"generative judge: {text}")
    scores = [v for _, (part, _) in gathered for v in part]
    parts = [m for _, (_, m) in gathered if m]
    out = merge(parts) if parts else {}
    if TIME in out:  # the round's wall time; generation rounds add up
        out[TIME] = Metric.sum(out[TIME].value)
    return torch.tensor(scores, dtype=torch.float32), out
