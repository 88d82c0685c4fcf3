"""megarl_kernels: memory-bounded LM-head log-prob / entropy and fused RL losses.

Standalone: imports nothing from ``megarl``. Public API::

    linear_logprob_entropy(hidden, weight, labels, temperature=1.0, tp_group=None, *,
                           impl="auto", chunk_size=None) -> (logprob [T], entropy [T])
    linear_logprob_stats(...same...) -> (logprob [T], entropy [T], sum_pi_squared [T])  # no grad
    fused_ppo_loss(hidden, weight, labels, old_logprob, advantages, *, loss_scale, ...)
    fused_pacs_loss(hidden, weight, labels, old_logprob, seq_index, group_index, scores, ...)
        -> (loss scalar, metrics dict of floats)
    loss_scale_from_agg(agg_mode, seq_index, ...)  -> per-token weights for fused_ppo_loss
    set_default_impl("auto" | "torch" | "triton" | None), available_impls()
    set_torch_compile(bool)   # torch.compile the per-tile math of the torch implementation

The Triton implementation (``megarl_kernels.triton_impl``) is imported only when chosen.
"""

from megarl_kernels._dispatch import available_impls, set_default_impl
from megarl_kernels.linear import linear_logprob_entropy, linear_logprob_stats
from megarl_kernels.losses import fused_pacs_loss, fused_ppo_loss, loss_scale_from_agg
from megarl_kernels.torch_impl import set_torch_compile

__all__ = [
    "available_impls",
    "fused_pacs_loss",
    "fused_ppo_loss",
    "linear_logprob_entropy",
    "linear_logprob_stats",
    "loss_scale_from_agg",
    "set_default_impl",
    "set_torch_compile",
]
