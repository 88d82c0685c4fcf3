"""Loss functions handed to ``Backend.train_step``: actor (the PPO family's registered policy
losses, or an algorithm's own objective) and critic.

Each factory closes over the mini-batch's global normalisation (``norm``: dp_size,
batch_num_tokens, global_batch_size, loss_scale_factor) so that summing micro-batch losses and
averaging over data-parallel ranks gives exactly the loss of the whole mini-batch (verl's new
engine semantics). Metrics are `megarl.metrics.Metric` values declaring their reduction:
losses, already normalised, are SUMs; ratios (clip fractions, ppo_kl, entropy, value means) are
token MEANs over the micro-batch's response tokens. ``Norm.report`` turns them into what the
backend sums (``megarl.backends.protocol.LossFn``; `megarl.backends.metrics.contributions`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

import megarl_kernels
from megarl import algos
from megarl.backends.metrics import contributions, share
from megarl.backends.protocol import SequenceBatch
from megarl.metrics import Metric


@dataclass(frozen=True)
class Norm:
    """Totals of one mini-batch over all data-parallel ranks."""

    dp_size: int
    batch_num_tokens: int
    global_batch_size: int
    loss_scale_factor: float

    def kwargs(self) -> dict[str, Any]:
        return dict(dp_size=self.dp_size, batch_num_tokens=self.batch_num_tokens,
                    global_batch_size=self.global_batch_size,
                    loss_scale_factor=self.loss_scale_factor)

    def token_share(self, mask: torch.Tensor) -> float:
        """This micro-batch's weight for a token-mean metric (sums to 1 per rank-average)."""
        return share(float(mask.sum()), self.batch_num_tokens, self.dp_size)

    def report(self, metrics: Mapping[str, Metric | float]) -> dict[str, float]:
        """A micro-batch's metrics as the backend sums them: token MEANs (weight: this
        micro-batch's response tokens) times their share of the mini-batch's tokens, SUMs and
        plain floats (already normalised) as they are."""
        return contributions({k: v if isinstance(v, Metric) else Metric.sum(v)
                              for k, v in metrics.items()}, self.batch_num_tokens, self.dp_size)


class PolicyTerm(Protocol):
    """A policy objective replacing the PPO family's registered policy loss (an algorithm's loss
    hook, e.g. a classifier loss; ``megarl.trainer.algorithm``)."""

    # the entropy bonus (entropy_coeff) and the KL loss (use_kl_loss) are added to it
    regularized: bool

    def __call__(self, logprob: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor,
                 mb: SequenceBatch, norm: Norm) -> tuple[torch.Tensor, dict[str, Metric | float]]:
        """``logprob`` [b, L] (carries the gradient), ``old_logprob`` [b, L], ``mask`` [b, L]
        float32 of this micro-batch -> (its share of the mini-batch loss, metrics: `Metric`
        values, or floats read as already-normalised SUMs)."""
        ...


FUSED_LOSS_MODE = "vanilla"  # the policy loss megarl_kernels.fused_ppo_loss computes


@dataclass(frozen=True)
class ActorLossSettings:
    loss_mode: str = "vanilla"
    agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0  # SAPO (loss options: megarl.algos.POLICY_LOSS_OPTIONS)
    tau_neg: float = 1.05
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # None: the registered policy loss ``loss_mode``; else the algorithm's own objective
    policy: PolicyTerm | None = None
    # One mini-batch and one epoch: the policy that sampled is the one being updated, so the
    # ratio is exactly 1 (verl's on-policy rule: old_logprob = logprob.detach()).
    on_policy: bool = False
    # Vanilla PPO straight from hidden states with megarl_kernels.fused_ppo_loss (one chunked
    # pass computes loss and gradients; no [T, V] logits). Other losses use the kernels for
    # logprob/entropy and compose with megarl.algos.
    fused: bool = True

    def use_fused(self, out) -> bool:
        return (self.fused and self.policy is None and self.loss_mode == FUSED_LOSS_MODE
                and not self.use_kl_loss and getattr(out, "hidden", None) is not None)

    @property
    def has_ratio(self) -> bool:
        """Whether the policy objective takes an importance ratio against ``old_logprob`` (the
        registered losses but those with ``ratio=False``, e.g. reinforce; an algorithm's own
        objective unless it says ``has_ratio = False``)."""
        if self.policy is not None:
            return bool(getattr(self.policy, "has_ratio", True))
        return algos.policy_loss_has_ratio(self.loss_mode)

    @property
    def regularized(self) -> bool:
        """Whether the entropy bonus and the KL loss apply (the PPO family's loss: always)."""
        return self.policy is None or self.policy.regularized


def ppo_policy_term(s: ActorLossSettings, logprob: torch.Tensor, old_logprob: torch.Tensor,
                    mask: torch.Tensor, mb: SequenceBatch,
                    norm: Norm) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The registered policy loss ``s.loss_mode`` on ``advantages`` (and rollout_is_weights);
    metrics pg_loss (normalised: a SUM) and the clip fractions and ppo_kl (token MEANs)."""
    t = mb.tensors
    loss, m = algos.policy_loss(
        s.loss_mode, logprob=logprob, old_logprob=old_logprob,
        advantages=t["advantages"], response_mask=mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c, agg_mode=s.agg_mode,
        rollout_is_weights=t.get("rollout_is_weights"),
        options={"tau_pos": s.tau_pos, "tau_neg": s.tau_neg}, **norm.kwargs())
    tokens = float(mask.sum())
    metrics = {"actor/pg_loss": Metric.sum(float(m["pg_loss"]))}
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        metrics[f"actor/{key}"] = Metric.mean(float(m[key]), tokens)
    return loss, metrics


def actor_loss_fn(s: ActorLossSettings, norm: Norm):
    """loss_fn(outputs, micro_batch) for the actor: the policy objective (``s.policy``, or the
    PPO family's registered loss on ``advantages``), minus the entropy bonus, plus the KL loss
    against ``ref_logprob``. micro_batch.tensors holds old_logprob (unless on-policy), what the
    objective reads and, with rollout correction, rollout_is_weights (multiply each token's
    policy loss; the fused kernel takes no weights, so the unfused path runs then); with
    rejection sampling the micro-batch's response_mask already lacks the rejected tokens (both
    paths read only the tokens of response_mask)."""

    def loss_fn(out, mb: SequenceBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if s.use_fused(out) and "rollout_is_weights" not in mb.tensors:
            return fused_ppo(out, mb)
        t = mb.tensors
        mask = t["response_mask"].to(torch.float32)
        logprob = out.logprob
        old_logprob = logprob.detach() if s.on_policy else t["old_logprob"]
        tokens = float(mask.sum())
        metrics: dict[str, Metric | float]
        if s.policy is None:
            loss, metrics = ppo_policy_term(s, logprob, old_logprob, mask, mb, norm)
        else:
            loss, metrics = s.policy(logprob, old_logprob, mask, mb, norm)
        entropy = out.entropy
        if entropy is not None:
            ent_mean = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
            metrics["actor/entropy"] = Metric.mean(float(ent_mean), tokens)
            if s.entropy_coeff != 0.0 and s.regularized:
                ent_loss = algos.agg_loss(entropy, mask, s.agg_mode, **norm.kwargs())
                loss = loss - s.entropy_coeff * ent_loss
        if s.use_kl_loss and s.regularized:
            kl = algos.kl_penalty(logprob, t["ref_logprob"], s.kl_loss_type)
            kl_loss = algos.agg_loss(kl, mask, s.agg_mode, **norm.kwargs())
            loss = loss + s.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = Metric.sum(float(kl_loss.detach()))
            metrics["actor/kl_coef"] = Metric.mean(s.kl_loss_coef, tokens)
        return loss, norm.report(metrics)

    def fused_ppo(out, mb: SequenceBatch) -> tuple[torch.Tensor, dict[str, float]]:
        t = mb.tensors
        rows, cols = out.flat_index
        hidden, labels = out.hidden, out.labels
        # the packed positions are every response token the model read; a multi-turn mask
        # leaves out the appended ones (tool responses, template glue): only the model's count
        keep = t["response_mask"][rows, cols] > 0
        if not bool(keep.all()):
            rows, cols, hidden, labels = rows[keep], cols[keep], hidden[keep], labels[keep]
        tokens = float(t["response_mask"].sum())
        old = None if s.on_policy else t["old_logprob"][rows, cols]
        scale = megarl_kernels.loss_scale_from_agg(s.agg_mode, rows, **norm.kwargs())
        loss, m = megarl_kernels.fused_ppo_loss(
            hidden, out.weight, labels, old, t["advantages"][rows, cols],
            loss_scale=scale, clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
            clip_ratio_c=s.clip_ratio_c, temperature=out.temperature,
            entropy_coeff=s.entropy_coeff, tp_group=out.tp_group)
        metrics = {"actor/pg_loss": Metric.sum(m["pg_loss"])}
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy"):
            metrics[f"actor/{key}"] = Metric.mean(m[key], tokens)
        return loss, norm.report(metrics)

    return loss_fn


def critic_loss_fn(cliprange_value: float, agg_mode: str, norm: Norm):
    """loss_fn for the critic: clipped value loss against ``returns`` with old ``values``."""

    def loss_fn(out, mb: SequenceBatch) -> tuple[torch.Tensor, dict[str, float]]:
        t = mb.tensors
        mask = t["response_mask"].to(torch.float32)
        loss, m = algos.value_loss(
            vpreds=out.values, returns=t["returns"], values=t["values"], response_mask=mask,
            cliprange_value=cliprange_value, agg_mode=agg_mode, **norm.kwargs())
        tokens = float(mask.sum())
        vmean = (out.values.detach() * mask).sum() / mask.sum().clamp(min=1)
        return loss, norm.report({
            "critic/vf_loss": Metric.sum(float(m["vf_loss"])),
            "critic/vf_clipfrac": Metric.mean(float(m["vf_clipfrac"]), tokens),
            "critic/vpred_mean": Metric.mean(float(vmean), tokens),
        })

    return loss_fn
