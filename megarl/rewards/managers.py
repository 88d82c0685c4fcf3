"""Reward managers: a batch of decoded responses -> one verifiable score per response.

`naive`: the data source's built-in verifier (`compute_score`) or the custom function.
`prime`: PURE's verifiable reward, 1.0 if verified correct else 0.0, for every data source
with a ground truth (math verification unless the source has its own verifier).
`blank`: all zeros, no scoring at all (PURE's PRM-only mode).
`dapo`: `naive`, plus the mean of each number a score function returns beside its score.

Scores are per response; the trainer places them on the last valid token. Managers are
rank-agnostic: whichever rank calls one gets the scores, broadcasting is the trainer's job.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.rewards.pool import DEFAULT_FN, RewardFnSpec, RewardPool, RewardRequest, RewardResult
from megarl.rewards.scoring import _unknown, has_builtin_rule, load_custom_reward_fn

logger = logging.getLogger(__name__)

_MISSING = RewardResult(0.0, {"error": "missing ground truth"}, "error")


def _is_missing(gt: Any) -> bool:
    if gt is None:
        return True
    if isinstance(gt, str):
        return not gt.strip()
    if isinstance(gt, float):
        return math.isnan(gt)
    if isinstance(gt, Sequence | Mapping):
        return len(gt) == 0
    return False


class RewardManager:
    """`manager(responses, data_sources, ground_truths, extra_infos) -> (scores, metrics)`.

    scores: float32 tensor [B]; metrics: reward/timeouts, reward/errors,
    reward/missing_ground_truth (counts in this batch), reward/score/mean,
    reward/score/{data_source} (mean per source), reward/time_s.
    `last_results` keeps the per-response RewardResult list of the last call.
    A missing ground truth scores 0 and is counted (logged) unless strict_ground_truth, where it
    raises. Custom functions get the ground truth as it is, missing or not.
    """

    name = "base"

    def __init__(self, pool: RewardPool | None, fn: RewardFnSpec = DEFAULT_FN, strict_ground_truth: bool = False):
        if pool is None:
            raise ValueError(
                f"reward manager {self.name!r} needs a RewardPool; build one with "
                "make_reward_pool(kind, num_workers, timeout_s, memory_mb)"
            )
        self.pool, self.fn, self.strict_ground_truth = pool, fn, strict_ground_truth
        self.last_results: list[RewardResult] = []

    def has_rule(self, data_source: str) -> bool:
        """Whether responses of ``data_source`` have a rule reward here (the built-in verifiers
        know only some sources, code sources only with a sandbox url in the function's kwargs;
        a custom function or PURE's math check scores every one)."""
        return self.fn.kind != "default" or has_builtin_rule(data_source, self.fn.kwargs)

    def _check_source(self, data_source: str) -> None:
        if not self.has_rule(data_source):
            raise _unknown(data_source)

    def __call__(
        self,
        responses: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    ):
        import torch

        t0 = time.perf_counter()
        b = len(responses)
        extra_infos = [None] * b if extra_infos is None else extra_infos
        for field, seq in (("data_sources", data_sources), ("ground_truths", ground_truths), ("extra_infos", extra_infos)):
            if len(seq) != b:
                raise ValueError(f"reward manager: len({field})={len(seq)} but len(responses)={b}")
        results: list[RewardResult | None] = [None] * b
        requests, where = [], []
        missing = 0
        for i in range(b):
            ds, gt = str(data_sources[i]), ground_truths[i]
            if self.fn.kind != "custom" and _is_missing(gt):
                if self.strict_ground_truth:
                    raise ValueError(
                        f"response {i} (data_source={ds!r}) has no ground truth. Fix: give every "
                        "sample a reward_model.ground_truth, or turn off reward_model.strict_ground_truth "
                        "to score such samples 0 (counted in reward/missing_ground_truth)."
                    )
                results[i] = _MISSING
                missing += 1
                continue
            self._check_source(ds)
            requests.append(RewardRequest(ds, str(responses[i]), gt, extra_infos[i], self.fn))
            where.append(i)
        if missing:
            logger.warning("reward: %d of %d responses have no ground truth; scored 0", missing, b)
        for i, r in zip(where, self.pool.score(requests) if requests else []):
            results[i] = r
        self.last_results = results  # type: ignore[assignment]
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        return scores, _metrics(results, [str(d) for d in data_sources], missing, time.perf_counter() - t0)


def _metrics(results, data_sources: list[str], missing: int, seconds: float) -> dict[str, float]:
    per_source: dict[str, list[float]] = defaultdict(list)
    for r, ds in zip(results, data_sources):
        per_source[ds].append(r.score)
    timeouts = sum(r.status == "timeout" for r in results)
    errors = sum(r.status == "error" for r in results) - missing
    m = {
        "reward/timeouts": float(timeouts),
        "reward/errors": float(errors),
        "reward/missing_ground_truth": float(missing),
        "reward/score/mean": sum(r.score for r in results) / max(1, len(results)),
        "reward/time_s": seconds,
    }
    for ds, s in sorted(per_source.items()):
        m[f"reward/score/{ds}"] = sum(s) / len(s)
    return m


class NaiveRewardManager(RewardManager):
    """Built-in verifier by data source (`compute_score`), or the custom function."""

    name = "naive"


class PrimeRewardManager(RewardManager):
    """PURE's verifiable reward in {0, 1} (`prime_compute_score`), or the custom function."""

    name = "prime"

    def __init__(self, pool: RewardPool | None, fn: RewardFnSpec | None = None, strict_ground_truth: bool = False):
        super().__init__(pool, fn or RewardFnSpec(kind="prime"), strict_ground_truth)


class BlankRewardManager(RewardManager):
    """All-zero verifiable reward (PRM-only training); never calls a pool."""

    name = "blank"

    def __init__(self, pool: RewardPool | None = None, fn: RewardFnSpec | None = None, strict_ground_truth: bool = False):
        self.pool, self.fn, self.strict_ground_truth = pool, fn or DEFAULT_FN, strict_ground_truth
        self.last_results = []

    def __call__(self, responses, data_sources, ground_truths, extra_infos=None):
        import torch

        b = len(responses)
        self.last_results = [RewardResult(0.0, {}, "ok")] * b
        return torch.zeros(b, dtype=torch.float32), _metrics(self.last_results, [str(d) for d in data_sources], 0, 0.0)


class DapoRewardManager(NaiveRewardManager):
    """verl's `dapo` manager: the naive manager's score, plus the mean of every number the score
    function returns beside it (``{"score", "acc", "pred"}`` -> reward/acc/mean). DAPO's
    overlong-buffer penalty is applied on top by the trainer when
    reward_model.overlong_buffer.enable (verl: reward_kwargs.overlong_buffer_cfg.enable)."""

    name = "dapo"

    def __call__(self, responses, data_sources, ground_truths, extra_infos=None):
        scores, metrics = super().__call__(responses, data_sources, ground_truths, extra_infos)
        extras: dict[str, list[float]] = defaultdict(list)
        for r in self.last_results:
            for key, value in r.extra.items():
                if isinstance(value, bool | int | float) and key != "score":
                    extras[key].append(float(value))
        for key, values in sorted(extras.items()):
            metrics[f"reward/{key}/mean"] = sum(values) / len(values)
        return scores, metrics


MANAGERS = {"naive": NaiveRewardManager, "prime": PrimeRewardManager, "blank": BlankRewardManager,
            "dapo": DapoRewardManager}


def _as_spec(custom_fn) -> RewardFnSpec | None:
    if custom_fn is None or isinstance(custom_fn, RewardFnSpec):
        return custom_fn
    if isinstance(custom_fn, Mapping):
        if not custom_fn.get("path"):
            return None
        return RewardFnSpec(
            kind="custom",
            path=str(custom_fn["path"]),
            name=custom_fn.get("name") or "compute_score",
            kwargs=dict(custom_fn.get("reward_kwargs") or custom_fn.get("kwargs") or {}),
        )
    raise TypeError(
        "custom_fn must be None, a RewardFnSpec or a mapping {path, name, reward_kwargs} "
        f"(reward_model.custom_reward_function); got {type(custom_fn).__name__}"
    )


def make_reward_manager(
    name: str,
    pool: RewardPool | None = None,
    custom_fn: RewardFnSpec | Mapping[str, Any] | None = None,
    strict_ground_truth: bool = False,
) -> RewardManager:
    """Build reward_model.reward_manager `name` ("naive" | "prime" | "blank" | "dapo") over `pool`.

    custom_fn: reward_model.custom_reward_function ({path, name, reward_kwargs}, path null =
    none) or a RewardFnSpec. It is imported here once so a bad path/name fails at startup.
    """
    if name not in MANAGERS:
        raise ValueError(f"reward_model.reward_manager={name!r}; use one of {sorted(MANAGERS)}")
    spec = _as_spec(custom_fn)
    if spec is not None and spec.kind == "custom":
        load_custom_reward_fn(spec.path, spec.name, spec.kwargs)
    if name in ("naive", "dapo"):
        return MANAGERS[name](pool, spec or DEFAULT_FN, strict_ground_truth)
    return MANAGERS[name](pool, spec, strict_ground_truth)


class RuleRewardBesideModel:
    """A reward manager next to an outcome reward model (whose score is the training reward, as
    verl's): responses of data sources without a rule reward (``has_rule``; e.g. verl's
    hh_rlhf preference data) score 0 instead of failing the step, said once per source; the
    others are scored by ``inner`` as usual (its metrics cover those)."""

    def __init__(self, inner: RewardManager) -> None:
        self.inner = inner
        self.name = inner.name
        self._said: set[str] = set()

    def __call__(self, responses: Sequence[str], data_sources: Sequence[str],
                 ground_truths: Sequence[Any],
                 extra_infos: Sequence[Mapping[str, Any] | None] | None = None):
        import torch

        n = len(responses)
        keep = [i for i in range(n) if self.inner.has_rule(str(data_sources[i]))]
        for source in sorted({str(d) for d in data_sources} - {str(data_sources[i]) for i in keep}):
            if source not in self._said:
                self._said.add(source)
                logger.warning("data_source=%r has no rule reward: the outcome reward model's "
                               "score alone rewards it (its reward/score metrics are left out)",
                               source)
        scores = torch.zeros(n, dtype=torch.float32)
        if not keep:
            return scores, {}

        def pick(seq):
            return None if seq is None else [seq[i] for i in keep]

        part, metrics = self.inner(pick(responses), pick(data_sources), pick(ground_truths),
                                   pick(extra_infos))
        scores[keep] = part.to(torch.float32)
        return scores, metrics
