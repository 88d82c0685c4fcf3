"""A step's reward of each response, assembled in one place.

The rule reward (the reward manager over the verifiers, `megarl.trainer.generation.Scorer`)
scores every response; an outcome reward model's score replaces it (verl's reward model, a
sequence classifier: `megarl.trainer.outcome_rm`), and a generative judge's replaces it likewise
(`megarl.judge`). The result is the step's ``verifiable`` score [N] that the algorithms place
(`megarl.trainer.advantage.place_rewards`). PURE's process reward model adds step scores beside
it (`megarl.trainer.prm`), not in place of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.judge.ranks import judge_samples
from megarl.metrics import Metric
from megarl.trainer.generation import Scorer
from megarl.trainer.metrics import Timer
from megarl.trainer.outcome_rm import OutcomeRewardModel, prompt_messages, score_samples


@dataclass
class RewardAssembly:
    """The run's reward sources: ``scorer`` (the rule reward), and at most one of
    ``outcome_rm`` and ``judge`` whose score replaces it; ``tokenizer`` decodes for the judge."""

    scorer: Scorer
    outcome_rm: OutcomeRewardModel | None = None
    judge: Any = None  # megarl.judge.judge.Judge
    tokenizer: Any = None

    @property
    def model_scores(self) -> bool:
        """A reward model's score (outcome RM or judge) replaces the rule reward: the PRM's
        step scores are then not read."""
        return self.outcome_rm is not None or self.judge is not None

    def score(self, samples: Sequence[Any], items: Sequence[Any] | None = None,
              group_offset: int = 0, timer: Timer | None = None
              ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """(scores [len(samples)] float32, reward metrics) of rollout ``samples``; ``items``:
        the dataset items they answer (sample group - ``group_offset`` = the item's position),
        whose chat messages an outcome RM with its own template re-renders. Timed as
        ``reward``, ``rm``, ``judge``. Collective with a judge."""
        timer = timer if timer is not None else Timer()
        with timer("reward"):
            scores, metrics = self.scorer(samples)
        if self.outcome_rm is not None:  # verl: the RM's scores replace the rule reward
            messages = (prompt_messages(samples, items, group_offset) if items is not None
                        else None)
            with timer("rm"):
                scores, rm_metrics = score_samples(self.outcome_rm, samples, messages)
            metrics.update(rm_metrics)
        if self.judge is not None:  # the generative judge's scores replace it likewise
            with timer("judge"):
                scores, judge_metrics = judge_samples(self.judge, samples, self.tokenizer)
            metrics.update(judge_metrics)
        return scores, metrics

    def final_scores(self, samples: Sequence[Any]) -> torch.Tensor:
        """[len(samples)] float32: only the score that counts (the judge's, else the outcome
        RM's, else the rule reward), for responses whose metrics nobody reads (greedy
        baselines). Collective with a judge."""
        if self.judge is not None:
            return judge_samples(self.judge, samples, self.tokenizer)[0]
        if self.outcome_rm is not None:
            return score_samples(self.outcome_rm, samples)[0]
        return self.scorer(samples)[0]
