"""Startup notices: keys of a loaded config that are accepted but have no effect on this run,
and settings that run but leave something uncorrected.

``startup_notices(cfg)`` returns one line per such key, ``KEY=VALUE: accepted without effect:
WHY[; FIX]`` (inert keys) or ``KEY=VALUE: WHY; FIX`` (a setting that does not do what a user
may expect of it: asynchronous rollout with nothing correcting for the behaviour policy).
A key appears only when its value is not the schema default (or when another setting makes it
inert, e.g. a micro-batch size under ``use_dynamic_bsz: true``), or in the combination that
has the effect named; the trainer prints the lines at start. Keys that do have their effect
are never listed as inert. An inert key is named only when the user set its value (a recipe
file, the user's own file, an override: ``Sources.user_set``), never for a value that came from
the embedded demo's overlay, a schema default or a derived fill.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.config import algorithms as A
from megarl.config.provenance import Sources, sources_of
from megarl.config.schema import Config, PureConfig
from megarl.config.schema_judge import judge_enabled

_ALL_CONTENTS = ["model", "optimizer", "extra"]
_DEFAULT_EPOCHS = 30


_INERT = ": accepted without effect: "
_SUBJECT = re.compile(r"[\w.]+")


def _line(key: str, value: Any, why: str) -> str:
    return f"{key}={value!r}{_INERT}{why}"


def _caveat(key: str, value: Any, why: str) -> str:
    return f"{key}={value!r}: {why}"


def _loss_has_ratio(cfg: Config) -> bool:
    """Whether the run's policy loss takes a ratio against old_logprob (PACS's own loss reads
    old_logprob too, and takes no importance weights)."""
    from megarl import algos

    return cfg.pacs.enable or algos.policy_loss_has_ratio(
        cfg.actor_rollout_ref.actor.policy_loss.loss_mode)


def _async_correction_notices(cfg: Config) -> list[str]:
    """Asynchronous rollout's off-policy correction (`megarl.trainer.async_rollout`): the
    weights of ``rollout_is`` measured only (the ratio against the behaviour policy corrects),
    or nothing correcting for the behaviour policy (the ratio against the trainer's own
    recomputation and no weights). A loss without a ratio and no weights is refused by the
    trainer (`megarl.trainer.correction.check_lagged_correction`)."""
    rc, at = cfg.algorithm.rollout_correction, cfg.async_training
    if at.staleness_threshold <= 0:
        return []
    if rc.rollout_is is not None and at.use_rollout_log_probs and _loss_has_ratio(cfg):
        return [_line(
            "algorithm.rollout_correction.rollout_is", rc.rollout_is,
            "async_training.use_rollout_log_probs=true takes the PPO ratio against the engine's "
            "logprobs, which already corrects for the behaviour policy (verl's bypass mode), so "
            "the weights are logged (rollout_corr/rollout_is_*) but not applied (they are with a "
            "loss that takes no ratio, policy_loss.loss_mode=reinforce); set "
            "async_training.use_rollout_log_probs=false to apply them")]
    if rc.rollout_is is None and not at.use_rollout_log_probs:
        return [_caveat(
            "async_training.use_rollout_log_probs", False,
            f"with async_training.staleness_threshold={at.staleness_threshold} the loss's ratio "
            "is taken against the trainer's own recomputation (its weights before the update), "
            "and with algorithm.rollout_correction.rollout_is=null nothing corrects for the "
            "older policy version that sampled each batch (the behaviour policy): its samples "
            "train as if on-policy; set algorithm.rollout_correction.rollout_is=token (the "
            "truncated weights pi/mu, decoupled PPO) or async_training.use_rollout_log_probs=true "
            "(the ratio against the behaviour policy)")]
    return []


def _micro_notices(cfg: Config) -> list[str]:
    """Micro-batch sizes made inert by an explicit ``use_dynamic_bsz: true`` (verl's rule:
    dynamic batching packs micro-batches by a token budget and ignores the micro size)."""
    arr = cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    roles = [("actor_rollout_ref.actor", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
              "ppo_max_token_len_per_gpu", actor.ppo_micro_batch_size_per_gpu,
              actor.use_dynamic_bsz),
             ("actor_rollout_ref.rollout", "log_prob_micro_batch_size_per_gpu",
              "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
              rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz)]
    inherited = (ref.log_prob_micro_batch_size_per_gpu == rollout.log_prob_micro_batch_size_per_gpu
                 and ref.log_prob_use_dynamic_bsz == rollout.log_prob_use_dynamic_bsz)
    if not inherited:  # the rollout's line already covers a ref that copies it
        roles.append(("actor_rollout_ref.ref", "log_prob_micro_batch_size_per_gpu",
                      "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
                      ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz))
    if cfg.critic.enable:
        c = cfg.critic
        roles.append(("critic", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                      "ppo_max_token_len_per_gpu", c.ppo_micro_batch_size_per_gpu,
                      c.use_dynamic_bsz))
    if cfg.reward_model.enable and not judge_enabled(cfg.reward_model):
        rm = cfg.reward_model
        roles.append(("reward_model", "micro_batch_size_per_gpu", "use_dynamic_bsz",
                      "forward_max_token_len_per_gpu", rm.micro_batch_size_per_gpu,
                      rm.use_dynamic_bsz))
    out = []
    for prefix, micro_key, dyn_key, budget_key, micro, dynamic in roles:
        if micro is not None and dynamic:
            out.append(_line(
                f"{prefix}.{micro_key}", micro,
                f"{prefix}.{dyn_key} is true, so micro-batches are packed up to "
                f"{prefix}.{budget_key} tokens and the micro size is ignored (verl's rule); set "
                f"{prefix}.{dyn_key}=false to run {micro} responses per forward"))
    return out


def startup_notices(cfg: Config, sources: Sources | None = None) -> list[str]:
    """One line per key of ``cfg`` (a loaded, filled Config) accepted without effect, or set
    in a combination that leaves something uncorrected (module doc). ``sources``: where each
    value came from; None = what the loader recorded for this Config object (``sources_of``).
    An inert key whose value the user did not set is left out; with no provenance at all (a
    Config built or copied outside the loader) every line is given."""
    sources = sources if sources is not None else sources_of(cfg)
    lines = _all_notices(cfg)
    if sources is None:
        return lines
    return [line for line in lines
            if _INERT not in line or sources.user_set(_SUBJECT.match(line).group(0))]


def _all_notices(cfg: Config) -> list[str]:
    out = _micro_notices(cfg)
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    ckpt = arr.actor.checkpoint
    for key, value in (("save_contents", ckpt.save_contents), ("load_contents", ckpt.load_contents)):
        # "hf_model" has its effect (an HF folder in each checkpoint: megarl.trainer.checkpoint)
        if value is not None and sorted(set(value) - {"hf_model"}) != sorted(_ALL_CONTENTS):
            out.append(_line(
                f"actor_rollout_ref.actor.checkpoint.{key}", value,
                "megarl always saves and loads model, optimizer and extra (RNG, LR schedule, "
                "sampler position) so that a resume is exact"))
    if not arr.model.use_remove_padding:
        out.append(_line(
            "actor_rollout_ref.model.use_remove_padding", False,
            "the backends always pack a micro-batch's sequences into one row without padding "
            "(segment ids keep them apart); the results equal a padded forward's"))
    est = cfg.algorithm.adv_estimator
    if (arr.rollout.n == 1 and "singleton_groups" in A.estimator_traits(est)
            and not cfg.pacs.enable):
        out.append(_caveat(
            "actor_rollout_ref.rollout.n", 1,
            f"with algorithm.adv_estimator={est} each group holds one response, so its advantage "
            "is its own score (verl's rule for a group of one: mean 0, std 1), a policy "
            "gradient without a baseline; set rollout.n >= 2 for its group baseline"))
    if not t.balance_batch:
        out.append(_line(
            "trainer.balance_batch", False,
            "responses are always spread over data-parallel ranks balanced by token count "
            "(whole groups where the loss needs them); the gradient does not depend on it"))
    if t.total_training_steps is not None and t.total_epochs != _DEFAULT_EPOCHS:
        out.append(_line(
            "trainer.total_epochs", t.total_epochs,
            f"trainer.total_training_steps={t.total_training_steps} sets the run's length "
            f"(verl's rule); set trainer.total_training_steps=null to train "
            f"{t.total_epochs} epochs"))
    if t.log_val_generations and not cfg.data.val_files:
        out.append(_line("trainer.log_val_generations", t.log_val_generations,
                         "data.val_files is not set, so there is no validation to print"))
    pure = cfg.algorithm.pure
    readers = A.estimators_reading("algorithm.pure")
    if cfg.algorithm.adv_estimator not in readers:
        for name, default in (("mask_separator", PureConfig.mask_separator),
                              ("normalize", PureConfig.normalize)):
            value = getattr(pure, name)
            if value != default:
                alias = " (PURE's algorithm.adv_norm)" if name == "normalize" else ""
                out.append(_line(
                    f"algorithm.pure.{name}{alias}", value,
                    f"it shapes PURE's advantage pipeline, algorithm.adv_estimator="
                    f"{' or '.join(readers)}, and this run uses {cfg.algorithm.adv_estimator}"))
    out += _async_correction_notices(cfg)
    ob = cfg.reward_model.overlong_buffer
    if ob.log and not ob.enable:
        out.append(_line("reward_model.overlong_buffer.log", True,
                         "reward_model.overlong_buffer.enable is false (no penalty to log)"))
    return out
