"""The pure-PyTorch training backend: megarl's own model (`megarl.models`) with FSDP2, DTensor
tensor (+ sequence) parallelism and torch.distributed.pipelining (1F1B). See `backend.py`."""

from megarl.backends.torch.backend import TorchBackend
from megarl.backends.torch.heads import TorchHeadOutputs, logprob_entropy, naive_logprob_entropy
from megarl.backends.torch.optim import OptimSettings
from megarl.backends.torch.packing import interleave_rank_splits, pack

__all__ = [
    "OptimSettings",
    "TorchBackend",
    "TorchHeadOutputs",
    "interleave_rank_splits",
    "logprob_entropy",
    "naive_logprob_entropy",
    "pack",
]
