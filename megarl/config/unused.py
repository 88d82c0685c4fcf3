"""Keys a run does not read: the settings of parts the config switched off (the critic of a run
without one, the process reward model's when ``reward_model.enable`` is false, megatron-core's
options on the torch backend). The startup report (``Resolved.report``) lists such values on one
line of their own instead of among the values the run uses."""

from __future__ import annotations

from typing import Any

# reward_model keys that only the process reward model reads (the verifiable-reward manager,
# its worker pool and the overlong buffer are read with or without a PRM)
PRM_ONLY = ("model", "strategy", "parallel", "micro_batch_size_per_gpu", "use_dynamic_bsz",
            "forward_max_token_len_per_gpu", "credit_assignment", "verifiable_reward_coef",
            "step_separator", "prm_step_token", "max_length")


def unused_reasons(cfg: Any) -> list[tuple[str, str]]:
    """[(dotted prefix, why)] of the subtrees ``cfg`` (a loaded, filled Config) does not read;
    a key is unused when it equals a prefix or lies under one."""
    out: list[tuple[str, str]] = []
    critic, rm = cfg.critic, cfg.reward_model
    actor = cfg.actor_rollout_ref.actor
    if not critic.enable:
        out += [(f"critic.{name}", "critic.enable=false") for name in vars(critic)
                if name != "enable"]
    elif critic.strategy != "megatron":
        out.append(("critic.megatron", f"critic.strategy={critic.strategy}"))
    if not rm.enable:
        out += [(f"reward_model.{name}", "reward_model.enable=false") for name in PRM_ONLY]
    if actor.strategy != "megatron" and not (rm.enable and rm.strategy == "megatron"):
        out.append(("actor_rollout_ref.actor.megatron",
                    f"actor_rollout_ref.actor.strategy={actor.strategy}"))
    return out


def unused_reason(reasons: list[tuple[str, str]], key: str) -> str | None:
    """Why ``key`` is not read, from ``unused_reasons``; None when the run reads it."""
    for prefix, why in reasons:
        if key == prefix or key.startswith(prefix + "."):
            return why
    return None
