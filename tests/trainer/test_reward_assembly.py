"""megarl.trainer.reward_assembly: the rule reward scores every response, an outcome RM's score
replaces it (with each sample's prompt messages), every source's metrics and time are kept.
The sources are small stand-ins of megarl's own classes (the real ones are run by
tests/trainer/test_outcome_rm_trainer.py and test_judge_trainer.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megarl.metrics import Metric
from megarl.trainer.metrics import Timer
from megarl.trainer.reward_assembly import RewardAssembly

SAMPLES = [SimpleNamespace(group=g, prompt_ids=[g], response_ids=[g, g]) for g in (5, 5, 6)]
ITEMS = [SimpleNamespace(raw_prompt=[{"role": "user", "content": "five"}]),
         SimpleNamespace(raw_prompt=[{"role": "user", "content": "six"}])]


def rule(samples):
    rule.calls += 1
    return torch.tensor([1.0, 0.0, 1.0]), {"reward/rule/mean": Metric.mean(2 / 3, 3)}


class OutcomeRM:
    """Scores a response by its prompt's first id / 10; records the messages it was given."""

    def __init__(self):
        self.messages = "unset"

    def score(self, prompts, responses, messages):
        self.messages = messages
        return torch.tensor([p[0] / 10 for p in prompts])


def test_rule_reward_alone():
    rule.calls = 0
    timer = Timer()
    scores, metrics = RewardAssembly(rule).score(SAMPLES, ITEMS, 5, timer)
    assert scores.tolist() == [1.0, 0.0, 1.0] and set(metrics) == {"reward/rule/mean"}
    assert set(timer.times) == {"reward"} and rule.calls == 1
    assert not RewardAssembly(rule).model_scores


def test_an_outcome_rm_replaces_the_rule_reward_and_reads_the_prompt_messages():
    """Sample group g answers item g - 5 (the round's offset): planted bugs, the offset not
    subtracted (index out of range) or the RM's metrics dropped, fail here."""
    rule.calls, rm = 0, OutcomeRM()
    timer = Timer()
    rewards = RewardAssembly(rule, outcome_rm=rm)
    scores, metrics = rewards.score(SAMPLES, ITEMS, 5, timer)
    assert rewards.model_scores and rule.calls == 1  # the rule reward still runs (its metrics)
    torch.testing.assert_close(scores, torch.tensor([0.5, 0.5, 0.6]))
    assert rm.messages == [ITEMS[0].raw_prompt, ITEMS[0].raw_prompt, ITEMS[1].raw_prompt]
    assert set(metrics) == {"reward/rule/mean", "reward/rm_score/mean"}
    assert set(timer.times) == {"reward", "rm"}
    # without items (greedy baselines) the RM gets no messages, and the rule reward is skipped
    rule.calls = 0
    torch.testing.assert_close(rewards.final_scores(SAMPLES), torch.tensor([0.5, 0.5, 0.6]))
    assert rm.messages is None and rule.calls == 0
    assert RewardAssembly(rule).final_scores(SAMPLES).tolist() == [1.0, 0.0, 1.0]
