"""megarl.algos: the RL math of verl, PURE and PACS as pure tensor functions.

No model, process group or config object here: tensors in, tensors out. Per-token tensors are
`[B, L]` (B responses, L padded response length), per-response tensors `[B]`; `group_index` is an
int64 `[B]` tensor (same value = same prompt, any order). float32 / float64 in, same dtype out.
Each function's docstring gives its formula and source (the paper, or verl's core_algos);
tests/algos checks each against a float64 brute-force loop.
"""

from megarl.algos.advantages import compute_advantages, optimal_token_baseline
from megarl.algos.agg import AGG_MODES, agg_loss
from megarl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    entropy_from_logits,
    kl_penalty,
)
from megarl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algos.pacs import pacs_loss
from megarl.algos.policy_losses import policy_loss
from megarl.algos.pure import pure_credit_assignment, pure_rloo_advantages
from megarl.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_PIPELINES,
    ESTIMATOR_NEEDS,
    ESTIMATOR_TRAITS,
    NEEDS,
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    RATIO_FREE_LOSSES,
    TRAITS,
    estimator_names,
    estimator_needs,
    estimator_traits,
    estimators_reading,
    policy_loss_has_ratio,
    register_advantage_estimator,
    register_advantage_pipeline,
    register_policy_loss,
)
from megarl.algos.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
    parse_rollout_rs,
)
from megarl.algos.value import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_PIPELINES",
    "AGG_MODES",
    "ESTIMATOR_NEEDS",
    "KL_ESTIMATORS",
    "NEEDS",
    "POLICY_LOSSES",
    "POLICY_LOSS_OPTIONS",
    "RATIO_FREE_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_in_reward",
    "build_kl_controller",
    "compute_advantages",
    "compute_rollout_is_weights",
    "compute_rollout_rejection_mask",
    "entropy_from_logits",
    "estimator_names",
    "estimator_needs",
    "estimator_traits",
    "estimators_reading",
    "ESTIMATOR_TRAITS",
    "TRAITS",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "optimal_token_baseline",
    "pacs_loss",
    "parse_rollout_rs",
    "policy_loss",
    "policy_loss_has_ratio",
    "pure_credit_assignment",
    "pure_rloo_advantages",
    "register_advantage_estimator",
    "register_advantage_pipeline",
    "register_policy_loss",
    "value_loss",
]
