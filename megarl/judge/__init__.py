"""A generative judge as the reward: a frozen model served by a rollout engine (megarl's or
vLLM) grades each response through a prompt template and a strict verdict parser.

- `megarl.judge.judge`: `Judge` (template -> engine -> verdict -> score, bounded in tokens and
  time) and `judge_from_section`;
- `megarl.judge.engine`: the judge's engine, built through `megarl.rollout.build`;
- `megarl.judge.ranks`: each rank judges its share of a step's samples;
- `megarl.judge.template`, `megarl.judge.parse`: the prompt template and the verdict parser.

It sits above `megarl.rollout` (it runs an engine) and `megarl.rewards` (its scores feed the
reward managers), below the trainer.
"""
