"""megarl: RL post-training for reasoning LLMs (PPO, GRPO, RLOO, REINFORCE++, PURE, PACS)."""

__version__ = "0.1.0"
