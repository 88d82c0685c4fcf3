"""The smallest valid config file of the config tests (a user's own YAML, no recipe)."""

MINIMAL = """
data:
  train_files: train.parquet
  train_batch_size: 32
actor_rollout_ref:
  model: {path: some/model}
  actor: {ppo_mini_batch_size: 16}
  rollout: {n: 4}
algorithm: {adv_estimator: grpo}
"""
