"""Keys a run does not read: the settings of parts the config switched off (the critic of a run
without one, the process reward model's when ``reward_model.enable`` is false or means the
generative judge, the judge's engine keys when there is no judge, megatron-core's options on the
torch backend). The startup report (``Resolved.report``) lists such values on one
line of their own instead of among the values the run uses."""

from __future__ import annotations

import json
import os
from typing import Any

from megarl.config.schema import Config
from megarl.config.schema_judge import judge_enabled

# reward_model keys that only the process reward model reads (the verifiable-reward manager,
# its worker pool and the overlong buffer are read with or without a PRM)
PRM_ONLY = ("model", "strategy", "parallel", "micro_batch_size_per_gpu", "use_dynamic_bsz",
            "forward_max_token_len_per_gpu", "credit_assignment", "verifiable_reward_coef",
            "step_separator", "prm_step_token", "max_length")
# reward_model.model keys the generative judge does not read (it reads model.path only: its
# dtype is reward_model.rollout.dtype)
NOT_JUDGE_MODEL = ("dtype", "kind", "input_tokenizer")
# reward_model.rollout keys only the vLLM judge reads (megarl's torch engine has none of them)
VLLM_ONLY = ("enforce_eager", "max_num_batched_tokens", "enable_chunked_prefill",
             "enable_prefix_caching", "engine_kwargs", "cudagraph_capture_sizes",
             "disable_log_stats", "tensor_model_parallel_size")


def judge_model_state(rm: Any) -> bool | None:
    """Whether ``rm`` (reward_model) serves a generative judge: False without use_reward_loop +
    rollout.name, with model.kind prm | outcome, or with a classifier in a local model folder
    (verl's "disrm", scored with one forward); True with a local generative model; None when
    only start-up can tell (a hub id or embedded:// path: its config.json is not read here)."""
    if not judge_enabled(rm):
        return False
    if getattr(rm.model, "kind", "auto") != "auto":
        return False
    path = rm.model.path
    config = os.path.join(path, "config.json") if isinstance(path, str) else ""
    if not config or not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            arch = [str(a) for a in json.load(f).get("architectures") or ()]
    except (OSError, ValueError, AttributeError):
        return None
    return not any(a.endswith(("ForSequenceClassification", "ForTokenClassification"))
                   for a in arch)


def unused_reasons(cfg: Config) -> list[tuple[str, str]]:
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
    judge = judge_model_state(rm)
    if judge:
        why = (f"reward_model.rollout.name={rm.rollout.name}: the generative judge reads "
               "reward_model.model.path only")
        out += [(f"reward_model.{name}", why) for name in PRM_ONLY if name != "model"]
        out += [(f"reward_model.model.{name}", why) for name in NOT_JUDGE_MODEL]
        out.append(("reward_model.rollout.free_cache_engine",
                    "the generative judge's engine stays resident (a frozen model)"))
        if rm.rollout.name == "torch":
            out += [(f"reward_model.rollout.{name}", "reward_model.rollout.name=torch")
                    for name in VLLM_ONLY]
    else:
        if not rm.enable:  # neither a PRM nor an outcome RM; a judge may read model.path
            out += [(f"reward_model.{name}", "reward_model.enable=false") for name in PRM_ONLY
                    if judge is False or name != "model"]
        if judge is False:
            why = ("reward_model.use_reward_loop=false" if not rm.use_reward_loop else
                   "reward_model.rollout.name=null" if rm.rollout.name is None else
                   "reward_model.model.path is a classifier, scored with one forward"
                   if rm.model.kind == "auto" else f"reward_model.model.kind={rm.model.kind}")
            out.append(("reward_model.rollout", f"{why} (no generative judge)"))
            if rm.use_reward_loop:
                out.append(("reward_model.use_reward_loop", f"{why} (no generative judge)"))
    prm_on = rm.enable and judge is not True
    if actor.strategy != "megatron" and not (prm_on and rm.strategy == "megatron"):
        out.append(("actor_rollout_ref.actor.megatron",
                    f"actor_rollout_ref.actor.strategy={actor.strategy}"))
    return out


def unused_reason(reasons: list[tuple[str, str]], key: str) -> str | None:
    """Why ``key`` is not read, from ``unused_reasons``; None when the run reads it."""
    for prefix, why in reasons:
        if key == prefix or key.startswith(prefix + "."):
            return why
    return None
