"""Per-token KL estimators, KL-in-reward, KL coefficient controllers, and token entropy.

With `d = logprob - ref_logprob` (log pi / pi_ref at the sampled token):

| kind              | value                                                           |
|-------------------|-----------------------------------------------------------------|
| `k1`, `kl`        | `d`                                                             |
| `abs`             | `|d|`                                                           |
| `k2`, `mse`       | `d^2 / 2`                                                       |
| `k3`, `low_var_kl`| `k = clamp(-d, -20, 20)`; `clamp(exp(k) - k - 1, -10, 10)`      |

A `+` suffix (`k1+`, `k3+`, `low_var_kl+`, ...) is the straight-through variant: forward value =
the estimator, gradient = that of `k2` (`k2 - sg(k2) + sg(estimator)`), an unbiased gradient of
KL(pi || pi_ref) whatever estimator is logged. `full` needs the whole vocabulary distribution
and is not available from per-token log-probs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.algos._checks import check_2d, check_float, check_mask, check_same_shape, work_dtype
from megarl.algos.masked import masked_mean

K3_EXP_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _abs(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _k3(d: torch.Tensor) -> torch.Tensor:
    k = torch.clamp(-d, -K3_EXP_CLAMP, K3_EXP_CLAMP)
    return torch.clamp(torch.exp(k) - k - 1.0, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1, "kl": _k1, "abs": _abs, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3,
}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate `[...]` (same shape and dtype as `logprob`) of kind `kind`.

    Both inputs are log-probs of the sampled tokens; gradients flow to both.
    """
    check_float("logprob", logprob)
    check_same_shape("logprob", logprob, ref_logprob=check_float("ref_logprob", ref_logprob))
    if not isinstance(kind, str):
        raise ValueError(f"kl kind must be a string, got {kind!r}")
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base == "full":
        raise NotImplementedError(
            "kl kind 'full' needs the full-vocabulary distributions, not per-token log-probs; "
            f"use one of {sorted(KL_ESTIMATORS)} (optionally with a '+' suffix)"
        )
    estimator = KL_ESTIMATORS.get(base)
    if estimator is None:
        valid = sorted(KL_ESTIMATORS) + sorted(k + "+" for k in KL_ESTIMATORS)
        raise ValueError(f"unknown kl kind {kind!r}; valid: {valid}")
    d = logprob - ref_logprob.to(logprob.dtype)
    value = estimator(d)
    if not straight_through:
        return value
    k2 = _k2(d)
    return k2 - k2.detach() + value.detach()


def apply_kl_in_reward(
    token_scores: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL penalty inside the reward (verl `apply_kl_penalty`), without gradient.

    `kld = kl_penalty(old, ref, kind) * m`, `token_rewards = token_scores - kl_coef * kld`.
    Returns (token_rewards [B, L], current_kl) where `current_kl` is the mean over responses of
    each response's token-mean `kld` (the value to pass to `KLController.update`).
    """
    check_2d("token_scores", check_float("token_scores", token_scores))
    check_same_shape("token_scores", token_scores, old_logprob=old_logprob, ref_logprob=ref_logprob)
    check_float("old_logprob", old_logprob)
    mask = check_mask("response_mask", response_mask, "token_scores", token_scores)
    with torch.no_grad():
        kld = kl_penalty(old_logprob.to(token_scores.dtype), ref_logprob, kind)
        kld = torch.where(mask, kld, 0.0)
        rewards = token_scores - kl_coef * kld
        per_seq = masked_mean(kld, mask, dim=-1)
        current_kl = float(per_seq.mean().item()) if per_seq.numel() else 0.0
    return rewards, current_kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of `softmax(logits)` over the last dim: `logsumexp(z) - sum_v softmax(z)_v z_v`.

    `[..., V] -> [...]`, same dtype (half precision is computed in float32). `-inf` logits
    (masked vocabulary entries) contribute 0.
    """
    check_float("logits", logits)
    z = logits.to(work_dtype(logits.dtype))
    p = torch.softmax(z, dim=-1)
    z_finite = torch.where(torch.isfinite(z), z, 0.0)
    entropy = torch.logsumexp(z, dim=-1) - (p * z_finite).sum(dim=-1)
    return entropy.to(logits.dtype)


class FixedKLController:
    """Constant KL coefficient `value` (verl `FixedKLController`)."""

    def __init__(self, kl_coef: float = 0.001):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type", "fixed") != "fixed":
            raise ValueError(f"state of a {state.get('type')!r} controller given to FixedKLController")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al.; verl `AdaptiveKLController`).

    `update(current_kl, n_steps)`: `e = clip(current_kl / target_kl - 1, -0.2, 0.2)`, then
    `value *= 1 + e * n_steps / horizon` (n_steps = responses in the batch).
    """

    def __init__(self, init_kl_coef: float = 0.001, target_kl: float = 0.1, horizon: float = 10000):
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type", "adaptive") != "adaptive":
            raise ValueError(
                f"state of a {state.get('type')!r} controller given to AdaptiveKLController"
            )
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def build_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """verl `algorithm.kl_ctrl` -> controller (`type` is "fixed" or "adaptive")."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller type {type!r}; valid: ['adaptive', 'fixed']")
