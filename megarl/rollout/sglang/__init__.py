"""SGLang behind the RolloutEngine protocol (colocated, memory release). SGLang is imported
only when an engine is built: megarl imports and runs without it (pip install megarl[sglang])."""

from megarl.rollout.sglang.engine import SGLangEngine, to_sglang_params

__all__ = ["SGLangEngine", "to_sglang_params"]
