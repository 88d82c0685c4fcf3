"""``linear_logprob_entropy``: per-token log-probability of the label and entropy of
``softmax(hidden @ weight.T / temperature)`` without ever forming the ``[T, V]`` logits.

One ``torch.autograd.Function`` serves both implementations. Its forward asks the implementation
for partial softmax statistics of the local weight shard, combines them (and all-reduces them over
``tp_group``) and saves only ``hidden, weight, labels, lse, entropy``. Its backward recomputes the
logits tile by tile and returns ``dh`` (summed over the TP group, since ``hidden`` is replicated
there) and the local ``dW`` shard.
"""

from __future__ import annotations

import torch

from megarl_kernels import _dispatch
from megarl_kernels._common import all_reduce_sum_, combine_partials, tp_rank_world

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def normalize_chunk(chunk_size) -> tuple[int | None, int | None]:
    """``chunk_size``: None (defaults), an int (tokens per chunk) or (tokens, vocab) per tile."""
    if chunk_size is None:
        return None, None
    if isinstance(chunk_size, int):
        pair = (chunk_size, None)
    else:
        pair = tuple(chunk_size)
        if len(pair) != 2:
            raise ValueError(f"chunk_size must be an int or (tokens, vocab), got {chunk_size!r}")
    for v in pair:
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"chunk_size entries must be positive ints or None, got {chunk_size!r}")
    return pair


def check_inputs(hidden, weight, labels, temperature, tp_group) -> tuple[int, int]:
    """Validate shapes/dtypes/devices/label range; return (vocab_start, global vocab size)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a [T, H] tensor, got {getattr(hidden, 'shape', hidden)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a [V or V/tp, H] tensor, got {getattr(weight, 'shape', weight)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, H] and weight [V, H] disagree on H: {tuple(hidden.shape)} vs {tuple(weight.shape)}"
        )
    for name, x in (("hidden", hidden), ("weight", weight)):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32/bfloat16/float16, got {x.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must have one dtype, got {hidden.dtype} and {weight.dtype} "
            "(cast the hidden states to the LM-head dtype)"
        )
    if not isinstance(labels, torch.Tensor) or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"labels must be a [T] tensor matching hidden's T={hidden.shape[0]}, got "
            f"{getattr(labels, 'shape', labels)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, "
            f"{weight.device}, {labels.device}"
        )
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weight.shape[0] < 1:
        raise ValueError("weight has no vocabulary rows")
    rank, world = tp_rank_world(tp_group)
    vocab = weight.shape[0] * world
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        raise ValueError(
            f"labels must be global token ids in [0, {vocab}) (V/tp={weight.shape[0]} x tp={world}); "
            f"got range [{int(labels.min())}, {int(labels.max())}]"
        )
    return rank * weight.shape[0], vocab


def local_stats(impl_mod, hidden, weight, local_labels, inv_temp, chunks, tp_group):
    """(logprob, entropy, lse), each float32 [T], reduced over the TP group."""
    m, s, t, zl = impl_mod.forward_stats(hidden, weight, local_labels, inv_temp, *chunks)
    return combine_partials(m, s, t, zl, tp_group)


def grads(impl_mod, hidden, weight, local_labels, lse, entropy, glp, gent, inv_temp, need_dh,
          need_dw, chunks, tp_group):
    """(dh in hidden's dtype or None, local dW or None); dh is summed over the TP group."""
    glp = None if glp is None else glp.float().contiguous()
    gent = None if gent is None else gent.float().contiguous()
    dh, dw = impl_mod.backward_grads(
        hidden, weight, local_labels, lse, entropy, glp, gent, inv_temp, need_dh, need_dw, *chunks
    )
    if dh is not None:
        dh = all_reduce_sum_(dh, tp_group).to(hidden.dtype)
    return dh, dw


class LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, impl, chunks):
        vocab_start, _ = check_inputs(hidden, weight, labels, temperature, tp_group)
        impl_mod = _dispatch.load(impl)
        inv_temp = 1.0 / float(temperature)
        local_labels = labels.long() - vocab_start
        logprob, entropy, lse = local_stats(
            impl_mod, hidden, weight, local_labels, inv_temp, chunks, tp_group
        )
        ctx.save_for_backward(hidden, weight, local_labels, lse, entropy)
        ctx.impl_mod, ctx.inv_temp, ctx.chunks, ctx.tp_group = impl_mod, inv_temp, chunks, tp_group
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, glp, gent):
        hidden, weight, local_labels, lse, entropy = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh, dw = grads(
            ctx.impl_mod, hidden, weight, local_labels, lse, entropy, glp, gent, ctx.inv_temp,
            need_dh, need_dw, ctx.chunks, ctx.tp_group,
        )
        return dh, dw, None, None, None, None, None


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    *,
    impl: str = "auto",
    chunk_size: int | tuple[int | None, int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` and entropy under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: ``[T, H]`` float32/bf16/fp16 final hidden states (differentiable).
        weight: ``[V, H]`` LM-head weight, or under tensor parallelism this rank's vocabulary
            shard ``[V/tp, H]`` holding rows ``[r*V/tp, (r+1)*V/tp)`` (differentiable).
        labels: ``[T]`` integer global token ids in ``[0, V)``.
        temperature: logits are divided by it (entropy is that of the scaled distribution).
        tp_group: process group over which the vocabulary is sharded, or None.
        impl: ``"auto"`` | ``"torch"`` | ``"triton"`` (see ``set_default_impl``).
        chunk_size: tile size, an int (tokens) or ``(tokens, vocab)``; None for defaults.

    Returns:
        ``(logprob [T], entropy [T])`` float32, in nats. Gradients flow to ``hidden`` (summed over
        the TP group) and to the local ``weight`` shard; either output may receive no gradient.
    """
    chunks = normalize_chunk(chunk_size)
    name = _dispatch.resolve(impl, hidden.device)
    return LinearLogprobEntropy.apply(hidden, weight, labels, float(temperature), tp_group, name, chunks)


@torch.no_grad()
def linear_logprob_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    *,
    impl: str = "auto",
    chunk_size: int | tuple[int | None, int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_logprob_entropy``'s outputs plus ``sum_v p_v^2`` per token, without gradient.

    Same arguments and tensor-parallel contract as ``linear_logprob_entropy``. Returns
    ``(logprob [T], entropy [T], sum_pi_squared [T])`` float32, the last being the sum over the
    whole vocabulary (all TP ranks) of the squared probabilities of
    ``softmax(hidden @ weight.T / temperature)`` (in (0, 1]; the Optimal Token Baseline's
    ``sum pi^2``). A second sweep over the local weight shard, given the first's log-sum-exp,
    computes it; memory stays that of one tile.
    """
    chunks = normalize_chunk(chunk_size)
    vocab_start, _ = check_inputs(hidden, weight, labels, temperature, tp_group)
    impl_mod = _dispatch.load(_dispatch.resolve(impl, hidden.device))
    inv_temp = 1.0 / float(temperature)
    logprob, entropy, lse = local_stats(
        impl_mod, hidden, weight, labels.long() - vocab_start, inv_temp, chunks, tp_group
    )
    sq = impl_mod.sum_sq_probs(hidden, weight, lse.contiguous(), inv_temp, *chunks)
    return logprob, entropy, all_reduce_sum_(sq, tp_group)
