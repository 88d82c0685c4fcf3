"""Heads on megatron's final hidden states: LM logprob / entropy (vocab-parallel) and the
token-classification ``score`` head of critics and PRMs.

Tensor-parallel gradient contract (shared with ``megarl_kernels.linear_logprob_entropy``): the
vocab-parallel logprob/entropy function receives the hidden states replicated on every TP rank
and all-reduces their gradient over ``tp_group`` itself. So `full_sequence` hands out the
hidden states of the whole sequence without any reduction of their gradient (under sequence
parallelism it all-gathers them and its backward only splits the gradient back). The score
head is replicated over TP: every rank computes the same full gradient, nothing to reduce.

Context parallelism (``cp_group``): the micro-batch holds the rank's own entries only
(`megarl.backends.megatron.context_parallel.shard`); every [b, L] output is summed over the
group (`megarl.utils.dist.sum_over_group`: exact, the pieces are disjoint; identity backward).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megarl.backends.megatron.batching import MicroBatch
from megarl.backends.protocol import SequenceBatch
from megarl.utils.dist import sum_over_group

logger = logging.getLogger(__name__)
_KERNEL_WARNED = False


def full_sequence(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[s, b, h] hidden states of the whole sequence (all-gathered under SP)."""
    if not sequence_parallel:
        return hidden
    return tensor_parallel.gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=False
    )


def torch_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference / fallback: (logprob [N], entropy [N]) of ``labels`` under
    ``softmax(hidden @ weight.T / temperature)`` with the vocab split over ``tp_group``
    (``weight`` is this rank's [V/tp, H] shard). Float32 math; materialises [N, V/tp] logits.
    The logprob goes through megatron's ``vocab_parallel_cross_entropy``."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp > 1:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    logits = (hidden @ weight.t()).float() / temperature  # [N, V/tp]
    if tp > 1:
        # megatron's function modifies fp32 logits in place (subtracts the row max): clone.
        logprob = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
    else:
        logprob = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    row_max = logits.detach().max(-1).values
    if tp > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max[:, None]
    e = shifted.exp()
    sum_e = e.sum(-1)
    sum_ez = (e * shifted).sum(-1)
    if tp > 1:
        sum_e = tensor_parallel.reduce_from_tensor_model_parallel_region(sum_e, group=tp_group)
        sum_ez = tensor_parallel.reduce_from_tensor_model_parallel_region(sum_ez, group=tp_group)
    entropy = sum_e.log() - sum_ez / sum_e
    return logprob, entropy


def torch_sum_pi_squared(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """[N] float32 ``sum_v softmax(hidden @ weight.T / temperature)_v^2`` with the vocabulary
    split over ``tp_group`` (``weight`` this rank's [V/tp, H] shard): each rank sums its shard's
    ``exp(2 (z - lse))`` with the global log-sum-exp, then the shards' sums are added. No
    gradient; materialises [N, V/tp] logits."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    with torch.no_grad():
        logits = (hidden @ weight.t()).float() / temperature
        row_max = logits.max(-1).values
        if tp > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        shifted = logits - row_max[:, None]
        sum_e = shifted.exp().sum(-1)
        if tp > 1:
            dist.all_reduce(sum_e, group=tp_group)
        sq = torch.exp(2.0 * (shifted - sum_e.log()[:, None])).sum(-1)
        if tp > 1:
            dist.all_reduce(sq, group=tp_group)
    return sq


def kernel_logprob_stats():
    """``megarl_kernels.linear_logprob_stats`` when importable, else None."""
    try:
        from megarl_kernels import linear_logprob_stats
    except ImportError:
        return None
    return linear_logprob_stats


def kernel_logprob_entropy():
    """``megarl_kernels.linear_logprob_entropy`` when importable, else None (warns once)."""
    global _KERNEL_WARNED
    try:
        from megarl_kernels import linear_logprob_entropy
    except ImportError:
        if not _KERNEL_WARNED:
            warnings.warn(
                "megarl_kernels.linear_logprob_entropy is not available; the megatron backend "
                "uses its PyTorch fallback (full [N, V/tp] logits)",
                stacklevel=2,
            )
            _KERNEL_WARNED = True
        return None
    return linear_logprob_entropy


class MegatronHeadOutputs:
    """`HeadOutputs` of one micro-batch (see megarl.backends.protocol).

    hidden [N, H]: final hidden states predicting the N response tokens (packed);
    weight [V/tp, H]; labels [N]; flat_index (rows [N], cols [N]) into [b, L];
    logprob / entropy [b, L] lazily, differentiable, 0 outside the response;
    values [b, L] for critics, scores [b, L, num_labels] for PRMs.
    cp_group (context parallelism): hidden / labels / flat_index hold this rank's entries;
    the [b, L] tensors are summed over the group, so every rank sees the whole micro-batch.
    """

    def __init__(
        self,
        *,
        mb: MicroBatch,
        temperature: float,
        tp_group: dist.ProcessGroup,
        hidden: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        use_kernel: bool = True,
        values: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ):
        self.temperature = float(temperature)
        self.tp_group = tp_group
        self.cp_group = cp_group
        self.hidden = hidden
        self.weight = weight
        self.labels = mb.labels
        self.flat_index = (mb.rows, mb.resp_cols)
        self.shape = (mb.batch_size, mb.response_length)
        self.values = self.group_sum(values)
        self.scores = self.group_sum(scores)
        self._use_kernel = use_kernel
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sum_sq: torch.Tensor | None = None

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None:
            if self.hidden is None:
                raise AttributeError("logprob/entropy need an LM head (actor or ref role)")
            fn = kernel_logprob_entropy() if self._use_kernel else None
            if fn is None:
                fn = torch_logprob_entropy
            lp, ent = fn(self.hidden, self.weight, self.labels, self.temperature, self.tp_group)
            self._cache = (self._scatter(lp), self._scatter(ent))
        return self._cache

    def _scatter(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat.new_zeros(self.shape, dtype=torch.float32)
        return self.group_sum(out.index_put(self.flat_index, flat.float()))

    def group_sum(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` (this rank's entries, zeros elsewhere) summed over the context-parallel
        group; ``t`` itself without context parallelism."""
        if t is None or self.cp_group is None:
            return t
        return sum_over_group(t, self.cp_group)

    @property
    def logprob(self) -> torch.Tensor:
        return self._compute()[0]

    @property
    def entropy(self) -> torch.Tensor:
        return self._compute()[1]

    @property
    def sum_pi_squared(self) -> torch.Tensor:
        """[b, L] float32 ``sum_v pi_v^2`` at each response token's position (vocab-parallel:
        summed over the TP shards), 0 outside the response; no gradient. Computed with the
        logprob and entropy (cached for the other properties) by the kernel when in use."""
        if self._sum_sq is None:
            if self.hidden is None:
                raise AttributeError("sum_pi_squared needs an LM head (actor or ref role)")
            fn = kernel_logprob_stats() if self._use_kernel else None
            if fn is not None:
                lp, ent, sq = fn(self.hidden, self.weight, self.labels, self.temperature,
                                 self.tp_group)
                if self._cache is None:
                    self._cache = (self._scatter(lp), self._scatter(ent))
            else:
                sq = torch_sum_pi_squared(self.hidden, self.weight, self.temperature,
                                          self.tp_group)
            self._sum_sq = self._scatter(sq)
        return self._sum_sq


def lm_outputs(
    hidden: torch.Tensor,
    mb: MicroBatch,
    weight: torch.Tensor,
    *,
    temperature: float,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup,
    use_kernel: bool,
    cp_group: dist.ProcessGroup | None = None,
) -> MegatronHeadOutputs:
    """HeadOutputs of an LM-head model from its final hidden states [s(/cp)(/tp), b, h]."""
    full = full_sequence(hidden, sequence_parallel)
    picked = full[mb.pred_cols, mb.rows].to(weight.dtype)  # [N, H]
    return MegatronHeadOutputs(
        mb=mb,
        temperature=temperature,
        tp_group=tp_group,
        hidden=picked,
        weight=weight,
        use_kernel=use_kernel,
        cp_group=cp_group,
    )


def value_outputs(
    hidden: torch.Tensor,
    mb: MicroBatch,
    score: torch.nn.Linear,
    *,
    role: str,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup | None = None,
) -> MegatronHeadOutputs:
    """HeadOutputs of a critic (``values`` [b, L] read at the column before each token) or a
    PRM (``scores`` [b, L, num_labels] read at the token's own column)."""
    full = full_sequence(hidden, sequence_parallel)
    b, L = mb.batch_size, mb.response_length
    if role == "critic":
        picked = full[mb.pred_cols, mb.rows].to(score.weight.dtype)
        v = score(picked)[:, 0].float()
        values = v.new_zeros((b, L)).index_put((mb.rows, mb.resp_cols), v)
        return MegatronHeadOutputs(mb=mb, temperature=1.0, tp_group=tp_group, values=values,
                                   cp_group=cp_group)
    picked = full[mb.cls_tok_cols, mb.cls_rows].to(score.weight.dtype)
    s = score(picked).float()
    scores = s.new_zeros((b, L, s.shape[-1])).index_put((mb.cls_rows, mb.cls_resp_cols), s)
    return MegatronHeadOutputs(mb=mb, temperature=1.0, tp_group=tp_group, scores=scores,
                               cp_group=cp_group)


def logprob_stats_of(backend: Any, batch: SequenceBatch, temperature: float = 1.0
                     ) -> dict[str, torch.Tensor]:
    """No-grad ``logprob``, ``entropy`` and ``sum_pi_squared`` [B, L] float32 of ``batch``
    under a `MegatronBackend` (actor / ref) in one forward: its ``logprobs`` pass with the sum
    of the squared probabilities added (what ``algorithm.adv_estimator=optimal_token_baseline``
    reads). Collective like ``logprobs``."""
    if backend.role not in ("actor", "ref"):
        raise TypeError(f"logprob_stats needs an LM head; this backend's role is "
                        f"{backend.role!r}")

    def collect(outputs: MegatronHeadOutputs) -> torch.Tensor:
        sq = outputs.sum_pi_squared
        return torch.stack([outputs.logprob, outputs.entropy, sq])

    out = backend._forward_no_grad(batch, collect, temperature, width=3)
    return {"logprob": out[0], "entropy": out[1], "sum_pi_squared": out[2]}
