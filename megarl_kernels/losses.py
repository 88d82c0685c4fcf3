"""Fused RL losses computed straight from hidden states: PPO (vanilla clip, clip-higher, dual
clip) and PACS.

Design (both losses, both implementations): an ``autograd.Function`` whose forward

1. runs the statistics pass of ``linear_logprob_entropy`` (one logits matmul per tile, no
   ``[T, V]`` tensor) -> ``logprob [T]``, ``entropy [T]``;
2. evaluates the small per-token / per-sequence loss in plain torch with autograd on those
   ``[T]`` vectors -> the loss and ``dL/dlogprob``, ``dL/dentropy`` (PACS needs per-sequence sums
   of all tokens first, which is why the gradient pass cannot share the first pass);
3. runs the gradient pass of ``linear_logprob_entropy`` with those upstream gradients (recomputing
   the logit tiles) -> ``dL/dhidden`` (summed over the TP group) and the local ``dL/dweight``.

For a loss that is a sum over tokens (PPO) with the torch implementation and a float32 weight,
steps 1-3 run as one pass instead (``torch_impl.fused_single_pass``): per token chunk the logits
over the local vocabulary are formed once and used for the statistics and for the gradients
(3 matmuls instead of 4; memory ``token_chunk x V_local`` floats).

Its backward only scales the stored gradients by the incoming scalar. The loss formulas follow
``megarl.algos.policy_loss("vanilla", ...)`` and ``megarl.algos.pacs_loss`` (this package does not
import megarl; tests check equality).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl_kernels import _dispatch
from megarl_kernels.linear import check_inputs, grads, local_stats, normalize_chunk

LOG_RATIO_CLAMP = 20.0
PACS_GRPO_EPS = 1e-6
MEAN_EPS = 1e-8
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class _FusedLinearLoss(torch.autograd.Function):
    """forward -> loss (0-dim float32). ``token_loss(logprob, entropy, sl) -> (loss, metrics)``
    evaluates the loss of tokens ``sl`` (a slice; ``slice(None)`` = all, the only one used
    unless ``separable``, where chunk slices give their summands and metrics may be None)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, impl, chunks, token_loss,
                metrics_out, separable):
        vocab_start, _ = check_inputs(hidden, weight, labels, temperature, tp_group)
        impl_mod = _dispatch.load(impl)
        inv_temp = 1.0 / float(temperature)
        local_labels = labels.long() - vocab_start
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.dh = ctx.dw = None
        if separable and impl == "torch" and weight.dtype == torch.float32 and (need_dh or need_dw):
            # sum over tokens: one pass, logits of a token chunk used for stats and gradients
            from megarl_kernels import torch_impl

            def chunk_grads(t0, t1, lp_c, ent_c):
                return _upstream(token_loss, lp_c, ent_c, slice(t0, t1))[1:]

            logprob, entropy, dh, ctx.dw = torch_impl.fused_single_pass(
                hidden, weight, local_labels, inv_temp, chunk_grads, need_dh, need_dw, tp_group,
                chunks[0],
            )
            ctx.dh = None if dh is None else dh.to(hidden.dtype)
            with torch.no_grad():
                loss, metrics = token_loss(logprob, entropy, slice(None))
        else:
            logprob, entropy, lse = local_stats(
                impl_mod, hidden, weight, local_labels, inv_temp, chunks, tp_group
            )
            (loss, metrics), glp, gent = _upstream(token_loss, logprob, entropy, slice(None))
            if need_dh or need_dw:
                ctx.dh, ctx.dw = grads(
                    impl_mod, hidden, weight, local_labels, lse, entropy, glp, gent, inv_temp,
                    need_dh, need_dw, chunks, tp_group,
                )
        metrics_out.update(metrics)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None  # the gradients are handed out (and scaled in place) only once
        if grad is not None and not bool(grad == 1):
            dh = None if dh is None else dh.mul_(grad.to(dh.dtype))
            dw = None if dw is None else dw.mul_(grad.to(dw.dtype))
        return dh, dw, None, None, None, None, None, None, None, None


def _upstream(token_loss, logprob, entropy, sl):
    """((loss, metrics), dL/dlogprob | None, dL/dentropy | None) of ``token_loss`` on tokens
    ``sl`` (autograd on the small [T] vectors)."""
    with torch.enable_grad():
        lp = logprob.detach().requires_grad_()
        ent = entropy.detach().requires_grad_()
        out = token_loss(lp, ent, sl)
        glp, gent = torch.autograd.grad(out[0], [lp, ent], allow_unused=True)
    return out, glp, gent


def _run(hidden, weight, labels, temperature, tp_group, impl, chunk_size, token_loss, separable):
    chunks = normalize_chunk(chunk_size)
    name = _dispatch.resolve(impl, hidden.device)
    metrics: dict[str, float] = {}
    loss = _FusedLinearLoss.apply(
        hidden, weight, labels, float(temperature), tp_group, name, chunks, token_loss, metrics,
        separable,
    )
    return loss, metrics


def _per_token(name: str, x, n: int, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.shape != (n,):
        raise ValueError(f"{name} must be a [T] tensor with T={n}, got {getattr(x, 'shape', x)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a float tensor, got {x.dtype}")
    return x.detach().to(device=device, dtype=torch.float32)


def _num_tokens(hidden) -> int:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a [T, H] tensor, got {getattr(hidden, 'shape', hidden)}")
    return hidden.shape[0]


def _mean(x: torch.Tensor) -> float:
    return float(x.sum() / (x.numel() + MEAN_EPS))


def fused_ppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprob: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    loss_scale: torch.Tensor | float,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    temperature: float = 1.0,
    entropy_coeff: float = 0.0,
    tp_group=None,
    impl: str = "auto",
    chunk_size: int | tuple[int | None, int | None] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Vanilla PPO loss (clip-higher + dual clip) from hidden states, gradients computed in the
    forward pass.

    Per token (``d = clamp(logp - old_logprob, -20, 20)``, ``rho = e^d``, ``A = advantages``):
    ``l1 = -A rho``, ``l2 = -A clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high)``,
    ``lc = max(l1, l2)``; ``l = min(lc, -A clip_ratio_c)`` where ``A < 0`` else ``lc``.

    ``loss = sum_t loss_scale_t * (l_t - entropy_coeff * entropy_t)``: ``loss_scale`` ([T] or a
    scalar) carries the aggregation and global normalisation (see ``loss_scale_from_agg``; e.g.
    token-mean is ``dp_size / batch_num_tokens`` on every token).

    Args:
        hidden ``[T, H]``, weight ``[V or V/tp, H]``, labels ``[T]``: as
            ``linear_logprob_entropy`` (T = the valid response tokens, packed).
        old_logprob, advantages: ``[T]`` float. ``old_logprob=None`` is the on-policy case
            (one mini-batch, one epoch): the old policy is the current one, so
            ``old = logprob.detach()`` and the ratio is exactly 1 (verl's on-policy rule).

    Returns:
        ``(loss, metrics)``: loss is a 0-dim float32 tensor whose backward gives ``dL/dhidden`` and
        ``dL/dweight``; metrics (floats, over the T tokens): ``pg_loss`` (the policy part of the
        loss), ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (mean of ``-d``), ``entropy``.
    """
    n, dev = _num_tokens(hidden), hidden.device
    old = None if old_logprob is None else _per_token("old_logprob", old_logprob, n, dev)
    adv = _per_token("advantages", advantages, n, dev)
    if isinstance(loss_scale, torch.Tensor) and loss_scale.dim() > 0:
        scale = _per_token("loss_scale", loss_scale, n, dev)
    else:
        scale = torch.full((n,), float(loss_scale), dtype=torch.float32, device=dev)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")

    def token_loss(logprob, entropy, sl):
        a, w = adv[sl], scale[sl]
        prev = logprob.detach() if old is None else old[sl]
        log_ratio = torch.clamp(logprob - prev, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        loss1 = -a * ratio
        loss2 = -a * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        clipped = torch.maximum(loss1, loss2)
        loss3 = -a * clip_ratio_c
        negative = a < 0
        per_token = torch.where(negative, torch.minimum(loss3, clipped), clipped)
        pg_loss = (per_token * w).sum()
        loss = pg_loss
        if entropy_coeff != 0.0:
            loss = loss - entropy_coeff * (entropy * w).sum()
        if sl != slice(None):
            return loss, None
        with torch.no_grad():
            metrics = {
                "pg_loss": float(pg_loss),
                "pg_clipfrac": _mean((loss2 > loss1).float()),
                "pg_clipfrac_lower": _mean(((clipped > loss3) & negative).float()),
                "ppo_kl": _mean(-log_ratio),
                "entropy": _mean(entropy),
            }
        return loss, metrics

    return _run(hidden, weight, labels, temperature, tp_group, impl, chunk_size, token_loss, True)


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, inverse, x)[inverse]


def _pacs_weights(y, inverse, num_groups, size, mode):
    ones = torch.ones_like(y)
    if mode is None:
        return ones
    positive = y > 0.5
    if mode == "only_positive":
        return positive.to(y.dtype)
    if mode == "only_negative":
        return (~positive).to(y.dtype)
    n = size.to(y.dtype)
    n_pos = _group_sum(positive.to(y.dtype), inverse, num_groups)
    n_neg = n - n_pos
    both = (n_pos > 0) & (n_neg > 0)
    own = torch.where(positive, n_pos, n_neg).clamp_min(1.0)
    return torch.where(both, n / (2.0 * own), ones)  # sklearn "balanced" within the group


def fused_pacs_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprob: torch.Tensor,
    seq_index: torch.Tensor,
    group_index: torch.Tensor,
    scores: torch.Tensor,
    *,
    beta: float = 1.0,
    reward_method: str = "1",
    adv_estimator: str = "rloo",
    weight_mode: str | None = "question",
    norm_adv_by_std: bool = True,
    global_batch_size: int | None = None,
    dp_size: int = 1,
    temperature: float = 1.0,
    tp_group=None,
    impl: str = "auto",
    chunk_size: int | tuple[int | None, int | None] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PACS loss (weighted BCE of a policy-derived score) from hidden states.

    Token t belongs to response ``seq_index[t]`` in ``[0, B)``; ``B = scores.numel()``.
    1. ``r_i = beta * sum_{t in i} (logp_t - old_t)`` (method "1") or
       ``beta * sum_{t in i} logp_t / max(n_i, 1)`` (method "2").
    2. ``psi`` per group (``group_index [B]``, any order): ``rloo`` ``r_i - mean_{j != i} r_j``
       (singleton 0); ``grpo`` ``(r_i - mean) / (std_unbiased + 1e-6)`` (or without std;
       singleton mean 0, std 1); ``naive`` ``r_i``.
    3. weights: ``question`` (balanced classes within a group that has both labels, else 1),
       ``only_positive``, ``only_negative`` or None (all 1).
    4. ``loss = sum_i w_i BCEWithLogits(psi_i, scores_i) / (global_batch_size or B) * dp_size``.

    Returns ``(loss, metrics)`` with ``pacs_loss``, ``reward_mean``, ``adv_mean``, ``entropy``.
    """
    n, dev = _num_tokens(hidden), hidden.device
    old = _per_token("old_logprob", old_logprob, n, dev)
    if reward_method not in ("1", "2"):
        raise ValueError(f"unknown PACS reward_method {reward_method!r}; valid: ['1', '2']")
    if adv_estimator not in ("rloo", "grpo", "naive"):
        raise ValueError(f"unknown PACS adv_estimator {adv_estimator!r}; valid: rloo, grpo, naive")
    if weight_mode not in ("question", "only_positive", "only_negative", None):
        raise ValueError(
            f"unknown PACS weight_mode {weight_mode!r}; valid: question, only_positive, "
            "only_negative, None"
        )
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise ValueError(f"scores must be a [B] tensor, got {getattr(scores, 'shape', scores)}")
    n_seq = scores.numel()
    y = scores.detach().to(device=dev, dtype=torch.float32)
    if ((y < 0) | (y > 1)).any():
        raise ValueError("scores must be correctness labels in [0, 1] (1 = correct)")
    if not isinstance(group_index, torch.Tensor) or group_index.shape != (n_seq,):
        raise ValueError(f"group_index must be a [B] tensor with B={n_seq}, got "
                         f"{getattr(group_index, 'shape', group_index)}")
    if not isinstance(seq_index, torch.Tensor) or seq_index.shape != (n,):
        raise ValueError(f"seq_index must be a [T] tensor with T={n}, got "
                         f"{getattr(seq_index, 'shape', seq_index)}")
    seq = seq_index.to(device=dev, dtype=torch.long)
    if seq.numel() and (int(seq.min()) < 0 or int(seq.max()) >= n_seq):
        raise ValueError(f"seq_index must lie in [0, B={n_seq}) (one entry of scores per response)")
    if global_batch_size is not None and not global_batch_size > 0:
        raise ValueError(f"global_batch_size must be > 0, got {global_batch_size}")
    _, inverse, counts = torch.unique(group_index.to(dev), return_inverse=True, return_counts=True)
    num_groups, size = int(counts.numel()), counts[inverse]
    multi = size > 1
    n_f = size.to(torch.float32)
    lengths = torch.zeros(n_seq, dtype=torch.float32, device=dev).index_add(
        0, seq, torch.ones(n, dtype=torch.float32, device=dev))
    w = _pacs_weights(y, inverse, num_groups, size, weight_mode)
    denom = global_batch_size if global_batch_size is not None else n_seq

    def token_loss(logprob, entropy, sl):  # not separable: always all tokens
        zeros = torch.zeros(n_seq, dtype=torch.float32, device=dev)
        if reward_method == "1":
            reward = beta * zeros.index_add(0, seq, logprob - old)
        else:
            reward = beta * zeros.index_add(0, seq, logprob) / lengths.clamp_min(1.0)
        if adv_estimator == "rloo":
            others = (_group_sum(reward, inverse, num_groups) - reward) / torch.where(
                multi, n_f - 1, torch.ones_like(n_f))
            psi = reward - torch.where(multi, others, reward)
        elif adv_estimator == "grpo":
            mean = _group_sum(reward, inverse, num_groups) / n_f
            var = _group_sum((reward - mean) ** 2, inverse, num_groups) / torch.where(
                multi, n_f - 1, torch.ones_like(n_f))
            pos = var > 0
            std = torch.where(pos, torch.sqrt(torch.where(pos, var, torch.ones_like(var))), 0.0)
            mean = torch.where(multi, mean, torch.zeros_like(mean))
            std = torch.where(multi, std, torch.ones_like(std))
            psi = (reward - mean) / (std + PACS_GRPO_EPS) if norm_adv_by_std else reward - mean
        else:
            psi = reward
        per_sample = F.binary_cross_entropy_with_logits(psi, y, weight=w, reduction="none")
        loss = per_sample.sum() / denom * dp_size
        metrics = {
            "pacs_loss": float(loss.detach()),
            "reward_mean": float(reward.detach().mean()),
            "adv_mean": float(psi.detach().mean()),
            "entropy": _mean(entropy.detach()),
        }
        return loss, metrics

    return _run(hidden, weight, labels, temperature, tp_group, impl, chunk_size, token_loss, False)


def loss_scale_from_agg(
    agg_mode: str,
    seq_index: torch.Tensor,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Per-token weights ``[T]`` so that ``sum_t w_t l_t`` equals ``megarl.algos.agg_loss`` of
    the per-token loss ``l`` (tokens packed, token t in response ``seq_index[t]``).

    Defaults as agg_loss for this call: ``batch_num_tokens = T``, ``global_batch_size`` = number
    of distinct responses in ``seq_index``; ``seq-mean-token-sum-norm`` needs
    ``loss_scale_factor`` (agg_loss's default is the padded length, unknown for packed tokens).
    """
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; valid: {list(AGG_MODES)}")
    seq = seq_index.long()
    n = seq.numel()
    ones = torch.ones(n, dtype=torch.float32, device=seq.device)
    if agg_mode == "token-mean":
        denom = batch_num_tokens if batch_num_tokens is not None else max(n, 1)
        return ones * (dp_size / float(denom))
    if agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            raise ValueError("seq-mean-token-sum-norm needs loss_scale_factor (e.g. the padded "
                             "response length L) for packed tokens")
        return ones / float(loss_scale_factor)
    _, inverse, counts = torch.unique(seq, return_inverse=True, return_counts=True)
    groups = global_batch_size if global_batch_size is not None else max(int(counts.numel()), 1)
    base = ones * (dp_size / float(groups))
    if agg_mode == "seq-mean-token-mean":
        return base / (counts[inverse].to(torch.float32) + MEAN_EPS)
    return base
