"""vLLM behind the RolloutEngine protocol (colocated, sleep mode). vLLM is imported only when
an engine is built: megarl imports and runs without it (pip install megarl[vllm])."""

from megarl.rollout.vllm.engine import VLLMEngine, to_vllm_kwargs

__all__ = ["VLLMEngine", "to_vllm_kwargs"]
