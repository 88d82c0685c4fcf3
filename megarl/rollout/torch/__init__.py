"""Pure-PyTorch rollout engine on megarl's own model (see `TorchRolloutEngine`)."""

from megarl.rollout.torch.engine import TorchRolloutEngine
from megarl.rollout.torch.weights import WeightUpdateError, load_weight_stream

__all__ = ["TorchRolloutEngine", "WeightUpdateError", "load_weight_stream"]
