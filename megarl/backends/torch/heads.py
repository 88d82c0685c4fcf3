"""What the loss function sees (`TorchHeadOutputs`) and the LM-head logprob / entropy path.

Tensor-parallel contract (the one of ``megarl_kernels.linear_logprob_entropy``): ``hidden`` is
replicated on every TP rank, ``weight`` is this rank's vocabulary shard ``[V/tp, H]`` (rows
``[r V/tp, (r+1) V/tp)``), and the function all-reduces the gradient of ``hidden`` over the TP
group itself; the weight shard gets its local gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch.packing import Packed
from megarl.utils.dist import sum_over_group

logger = logging.getLogger(__name__)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherVocab(torch.autograd.Function):
    """[N, V/tp] -> [N, V] all-gathered along the vocabulary; backward keeps this rank's slice
    (the loss downstream is computed identically on every TP rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        lo = ctx.rank * ctx.width
        return g[..., lo : lo + ctx.width].contiguous(), None


def naive_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [N], entropy [N]) float32 through full ``[N, V]`` float32 logits and
    ``log_softmax`` (use_fused_kernels=False; also the fallback when megarl_kernels is absent)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp > 1:
        hidden = _CopyToTP.apply(hidden, tp_group)
    logits = (hidden.float() @ weight.float().t()) / temperature
    if tp > 1:
        logits = _GatherVocab.apply(logits, tp_group)
    logp = F.log_softmax(logits, dim=-1)
    logprob = logp.gather(-1, labels.long()[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return logprob, entropy


def naive_sum_pi_squared(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[N] float32 ``sum_v softmax(hidden @ weight.T / temperature)_v^2`` through full ``[N, V]``
    float32 logits (the vocabulary gathered over ``tp_group``); no gradient."""
    with torch.no_grad():
        logits = (hidden.float() @ weight.float().t()) / temperature
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            logits = _GatherVocab.apply(logits, tp_group)
        return torch.exp(2.0 * F.log_softmax(logits, dim=-1)).sum(-1)


_KERNEL_MISSING_LOGGED = False


def logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    *,
    fused: bool = True,
    impl: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one place that picks the logprob/entropy implementation: ``megarl_kernels``
    (memory-bounded, never forms [N, V]) when ``fused`` and importable, else the naive path."""
    global _KERNEL_MISSING_LOGGED
    if fused:
        try:
            from megarl_kernels import linear_logprob_entropy
        except ImportError:
            if not _KERNEL_MISSING_LOGGED:
                logger.warning("megarl_kernels is not importable; using naive log_softmax")
                _KERNEL_MISSING_LOGGED = True
        else:
            return linear_logprob_entropy(
                hidden, weight, labels, temperature, tp_group, impl=impl, chunk_size=chunk_size
            )
    return naive_logprob_entropy(hidden, weight, labels, temperature, tp_group)


def logprob_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    *,
    fused: bool = True,
    impl: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """No-grad (logprob [N], entropy [N], sum_pi_squared [N]) float32, by the implementation
    `logprob_entropy` picks: ``megarl_kernels.linear_logprob_stats`` or the naive path."""
    if fused:
        try:
            from megarl_kernels import linear_logprob_stats
        except ImportError:
            pass
        else:
            return linear_logprob_stats(hidden, weight, labels, temperature, tp_group, impl=impl,
                                        chunk_size=chunk_size)
    with torch.no_grad():
        lp, ent = naive_logprob_entropy(hidden, weight, labels, temperature, tp_group)
        return lp, ent, naive_sum_pi_squared(hidden, weight, temperature, tp_group)


class TorchHeadOutputs:
    """`HeadOutputs` of one micro-batch (see megarl.backends.protocol).

    hidden [N, H]: final hidden states predicting the N response tokens (packed, replicated
    over TP); weight [V or V/tp, H]: the LM-head weight (local vocabulary shard under TP);
    labels [N]; flat_index (rows [N], cols [N]) into [b, L]; tp_group; temperature.
    logprob / entropy [b, L] float32 are computed lazily (once) and are differentiable, 0 outside
    the response. ``values`` [b, L] float32 is set for critics (read at column P + j - 1).
    sp_group (Ulysses): ``packed`` holds this rank's entries only; the [b, L] tensors are summed
    over the group (`megarl.utils.dist.sum_over_group`), so every rank sees the whole micro-batch.
    """

    def __init__(
        self,
        packed: Packed,
        *,
        temperature: float = 1.0,
        tp_group: dist.ProcessGroup | None = None,
        hidden: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        sp_group: dist.ProcessGroup | None = None,
        fused: bool = True,
        impl: str = "auto",
        chunk_size: int | None = None,
    ) -> None:
        self.temperature = float(temperature)
        self.tp_group = tp_group
        self.hidden = hidden
        self.weight = weight
        self.labels = packed.labels
        self.flat_index = (packed.rows, packed.cols)
        self.shape = (packed.batch_size, packed.response_length)
        self.sp_group = sp_group
        self.values = sum_over_group(values, sp_group) if values is not None else None
        self._kernel = {"fused": fused, "impl": impl, "chunk_size": chunk_size}
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sum_sq: torch.Tensor | None = None

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None:
            if self.hidden is None or self.weight is None:
                raise AttributeError("logprob/entropy need an LM head (actor or ref role)")
            lp, ent = logprob_entropy(
                self.hidden, self.weight, self.labels, self.temperature, self.tp_group,
                **self._kernel,
            )
            self._cache = (sum_over_group(self.scatter(lp), self.sp_group),
                           sum_over_group(self.scatter(ent), self.sp_group))
        return self._cache

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """[N] -> [b, L] float32, zero outside the N positions (differentiable)."""
        out = flat.new_zeros(self.shape, dtype=torch.float32)
        return out.index_put(self.flat_index, flat.float())

    @property
    def logprob(self) -> torch.Tensor:
        return self._compute()[0]

    @property
    def entropy(self) -> torch.Tensor:
        return self._compute()[1]

    @property
    def sum_pi_squared(self) -> torch.Tensor:
        """[b, L] float32 ``sum_v pi_v^2`` of the policy at each response token's position
        (the Optimal Token Baseline's input), 0 outside the response; no gradient. Computed
        with the logprob and entropy in one call (they are cached for the other properties)."""
        if self._sum_sq is None:
            if self.hidden is None or self.weight is None:
                raise AttributeError("sum_pi_squared needs an LM head (actor or ref role)")
            lp, ent, sq = logprob_stats(self.hidden, self.weight, self.labels, self.temperature,
                                        self.tp_group, **self._kernel)
            if self._cache is None:
                self._cache = (sum_over_group(self.scatter(lp), self.sp_group),
                               sum_over_group(self.scatter(ent), self.sp_group))
            self._sum_sq = sum_over_group(self.scatter(sq), self.sp_group)
        return self._sum_sq


def lm_outputs(
    hidden: torch.Tensor, packed: Packed, weight: torch.Tensor, **kwargs
) -> TorchHeadOutputs:
    """HeadOutputs of an LM model from its final hidden states ``[1, T, H]``."""
    picked = hidden[0].index_select(0, packed.pred_pos)
    return TorchHeadOutputs(packed, hidden=picked, weight=weight, **kwargs)


def value_outputs(logits: torch.Tensor, packed: Packed, **kwargs) -> TorchHeadOutputs:
    """HeadOutputs of a critic from its token-classification logits ``[1, T, 1]``: the value of
    response token j is read at the column before it."""
    v = logits[0, :, 0].index_select(0, packed.pred_pos).float()
    values = v.new_zeros((packed.batch_size, packed.response_length))
    values = values.index_put((packed.rows, packed.cols), v)
    return TorchHeadOutputs(packed, values=values, **kwargs)


def token_scores(logits: torch.Tensor, packed: Packed) -> torch.Tensor:
    """[b, L, num_labels] float32 PRM logits read at each response token's own column."""
    s = logits[0].index_select(0, packed.cls_pos).float()
    out = s.new_zeros((packed.batch_size, packed.response_length, s.shape[-1]))
    return out.index_put((packed.cls_rows, packed.cls_cols), s)


def logprob_stats_of(backend: Any, batch: SequenceBatch, temperature: float = 1.0,
                     micro_batches: Sequence[Sequence[int]] | None = None
                     ) -> dict[str, torch.Tensor]:
    """No-grad ``logprob``, ``entropy`` and ``sum_pi_squared`` [B, L] float32 of ``batch``
    under a `TorchBackend` (actor / ref) in one forward: its ``logprobs`` pass with the sum of
    the squared probabilities added (what ``algorithm.adv_estimator=optimal_token_baseline``
    reads). Collective like ``logprobs``; ``micro_batches`` as there."""
    if backend.role not in ("actor", "ref"):
        raise TypeError(f"logprob_stats needs an LM head; this backend's role is "
                        f"{backend.role!r}")

    def collect(out: torch.Tensor, p: Packed) -> torch.Tensor:
        heads = backend._head_outputs(out, p, temperature)
        sq = heads.sum_pi_squared
        return torch.stack([heads.logprob, heads.entropy, sq], -1)

    res = backend._forward_no_grad(batch, collect, 3, micro_batches)
    return {"logprob": res[..., 0], "entropy": res[..., 1], "sum_pi_squared": res[..., 2]}
