"""SGLang behind the RolloutEngine protocol (colocated, memory release). SGLang is imported
only when an engine is built, and must be a release in `SUPPORTED_SGLANG`: megarl imports and
runs without it (pip install megarl[sglang])."""

from megarl.rollout.sglang.engine import SUPPORTED_SGLANG, SGLangEngine, to_sglang_params

__all__ = ["SUPPORTED_SGLANG", "SGLangEngine", "to_sglang_params"]
