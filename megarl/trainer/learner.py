"""The learner: the stage that trains on a scored batch.

It owns the training backends (actor, critic, reference, PRM), the algorithm and the KL
controller. For a batch from the producer:

    prepare (the algorithm's hook; it may still generate: the ReMax greedy baselines)
    -> PRM step scores -> the logprob passes `plan_logprob_passes` asks for (old logprobs,
       the engine/trainer gap, the pairing of behaviour logprobs) -> rollout correction
       (truncated IS weights, rejection) -> reference logprobs, values
    -> advantages (rewards placed, KL in reward) -> critic and actor updates

and gives metrics and a new actor version (`export_weights`, for the publisher).
docs/design.md, "Three schedules of the same three stages", says how a schedule runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megarl import algos
from megarl.algos.rollout_correction import logprob_diff_metrics
from megarl.backends.settings import micro_batch_tokens
from megarl.config.schema import Config
from megarl.metrics import prefixed
from megarl.trainer import generation as R
from megarl.trainer.advantage import old_logprob_pass
from megarl.trainer.algorithm import Algorithm, StepContext
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.checkpoint import HF_FOLDER, wants_hf_model, write_hf_model
from megarl.trainer.correction import (
    add_rollout_is_weights,
    add_rollout_rejection,
    bypass_logprobs,
    lagged_logprobs,
    require_rollout_logprobs,
    without_rejected,
)
from megarl.trainer.logprob_plan import CorrectionFacts, StepFacts, plan_logprob_passes
from megarl.trainer.losses import actor_loss_fn, critic_loss_fn
from megarl.trainer.metrics import Timer
from megarl.trainer.parts import RunParts
from megarl.trainer.prm import prm_step_settings, score_steps
from megarl.trainer.update import mean_metrics, run_update


class Learner:
    """Trains the actor (and the critic) on one batch per step (module doc)."""

    def __init__(self, cfg: Config, parts: RunParts, algorithm: Algorithm) -> None:
        self.cfg = cfg
        self.parts = parts
        self.algorithm = algorithm
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.build_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        if parts.prm is not None:
            self.step_end_ids, self.prm_marker = prm_step_settings(cfg.reward_model,
                                                                   parts.tokenizer)

    def updates_actor(self, step: int) -> bool:
        """Whether step ``step`` updates the actor (not during ``trainer.critic_warmup``)."""
        return step > self.cfg.trainer.critic_warmup

    def prepare(self, batch: RolloutBatch, ctx: StepContext) -> None:
        """The algorithm's prepare hook, before the engine is released (it may generate)."""
        self.algorithm.prepare(batch, ctx)

    def update(self, batch: RolloutBatch, step: int, metrics: dict[str, float], timer: Timer,
               *, ratio_against_rollout: bool = False) -> None:
        """Everything from the PRM's step scores through the updates (module doc), its metrics
        added to ``metrics``. ``ratio_against_rollout``: a lagged batch's PPO ratio is taken
        against the engine's logprobs (`megarl.trainer.correction.lagged_logprobs`)."""
        cfg, p, algo = self.cfg, self.parts, self.algorithm
        arr = cfg.actor_rollout_ref
        t = batch.tensors
        seq = batch.sequence_batch()
        temperature = arr.rollout.temperature
        if p.prm is not None:
            with timer("prm"):
                t["step_rewards"], t["step_mask"] = score_steps(p.prm, batch, self.step_end_ids,
                                                                self.prm_marker)
        a = arr.actor
        n_groups = len(set(batch.group_index.tolist()))
        rc = cfg.algorithm.rollout_correction
        plan = plan_logprob_passes(
            StepFacts(step=step, lagged="policy_version" in t,  # async rollout's samples
                      has_rollout_logprobs="rollout_logprob" in t,
                      one_update=a.ppo_epochs == 1 and a.ppo_mini_batch_size >= n_groups,
                      ratio_against_rollout=ratio_against_rollout),
            CorrectionFacts(bypass_mode=rc.bypass_mode, rollout_is=rc.rollout_is,
                            rollout_rs=rc.rollout_rs,
                            use_kl_in_reward=cfg.algorithm.use_kl_in_reward,
                            check_logprobs=arr.rollout.check_logprobs,
                            record_routing=a.router_replay.mode == "R2"),
            loss_has_ratio=algo.loss.has_ratio, needs_sum_pi_squared=algo.needs.sum_pi_squared)
        # importance weights on the engine/trainer gap need both logprobs (correction.py)
        if rc.rollout_is is not None:
            require_rollout_logprobs(batch, rc.rollout_is)
        if plan.old_logprob_pass:
            with timer("old_log_prob"):
                res = old_logprob_pass(p.actor, seq, temperature,
                                       sum_pi_squared=plan.sum_pi_squared,
                                       record_routing=plan.record_routing)
                old, ent = res["old_logprob"], res["entropy"]
                t["old_logprob"] = old
                for key in ("sum_pi_squared", "routed_experts"):
                    if key in res:
                        t[key] = res[key]
                if ent is not None:
                    mask = batch.response_mask
                    metrics["actor/old_entropy"] = float(
                        (ent * mask).sum() / mask.sum().clamp(min=1))
            if plan.check_gap:
                metrics.update(logprob_diff_metrics(t["rollout_logprob"], old,
                                                    batch.response_mask))
                # mixture of experts: expert load, router entropy, what routing replay changes
                metrics.update(p.actor.routing_metrics(seq, t["rollout_logprob"], temperature))
        if plan.pairing == "lagged":
            metrics.update(lagged_logprobs(batch, ratio_against_rollout))
        elif plan.pairing == "bypass":
            bypass_logprobs(batch)
        if rc.rollout_is is not None:
            metrics.update(add_rollout_is_weights(batch, rc, algo.loss.has_ratio))
        if rc.rollout_rs is not None:
            metrics.update(add_rollout_rejection(batch, rc))
        if p.ref is not None:
            with timer("ref"):
                t["ref_logprob"], _ = p.ref.logprobs(seq, temperature=temperature)
        if p.critic is not None:
            with timer("values"):
                t["values"] = p.critic.values(seq)

        with timer("adv"):
            adv_metrics = algo.advantages(batch, self.kl_ctrl.value)
        cur_kl = adv_metrics.pop("_kl_for_controller", None)
        if cur_kl is not None:
            self.kl_ctrl.update(cur_kl, batch.batch_size)
        metrics.update(adv_metrics)

        # rejection sampling: the rejected tokens leave the updates' masks (correction.py)
        train_batch = without_rejected(batch)
        if p.critic is not None:
            with timer("update_critic"):
                metrics.update(self._update_critic(train_batch, step))
        if self.updates_actor(step):
            with timer("update_actor"):
                metrics.update(self._update_actor(train_batch, step, plan.on_policy))

    def _update_critic(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        cfg = self.cfg
        c = cfg.critic
        steps = run_update(
            self.parts.critic, batch, ("values", "returns"),
            lambda norm: critic_loss_fn(c.cliprange_value, c.loss_agg_mode, norm),
            prompts_per_mini=c.ppo_mini_batch_size, epochs=c.ppo_epochs,
            shuffle=c.shuffle, seed=R.sampling_seed(cfg.trainer.seed, step, 7),
            max_tokens_per_micro=micro_batch_tokens(c.ppo_max_token_len_per_gpu, c.parallel)
            if c.use_dynamic_bsz else None,
            micro_size=c.ppo_micro_batch_size_per_gpu, keep_groups_on_rank=False,
            loss_scale_factor=cfg.data.max_response_length)
        return prefixed(mean_metrics(steps), "critic")

    def _update_actor(self, batch: RolloutBatch, step: int, on_policy: bool) -> dict[str, float]:
        cfg, algo = self.cfg, self.algorithm
        a = cfg.actor_rollout_ref.actor
        t = batch.tensors
        keys = algo.update_keys
        if "old_logprob" in t:
            keys += ("old_logprob",)
        if a.use_kl_loss:
            keys += ("ref_logprob",)
        if "rollout_is_weights" in t:
            keys += ("rollout_is_weights",)
        settings = algo.loss_settings(on_policy)
        steps = run_update(
            self.parts.actor, batch, keys, lambda norm: actor_loss_fn(settings, norm),
            prompts_per_mini=a.ppo_mini_batch_size, epochs=a.ppo_epochs,
            shuffle=a.shuffle, seed=R.sampling_seed(cfg.trainer.seed, step, 3),
            max_tokens_per_micro=micro_batch_tokens(a.ppo_max_token_len_per_gpu, a.parallel)
            if a.use_dynamic_bsz else None,
            micro_size=a.ppo_micro_batch_size_per_gpu,
            keep_groups_on_rank=algo.needs.whole_groups,
            loss_scale_factor=cfg.data.max_response_length,
            temperature=cfg.actor_rollout_ref.rollout.temperature)
        return prefixed(mean_metrics(steps), "actor")

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's (HF name, full tensor) stream (collective), for the publisher."""
        return self.parts.actor.export_weights()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The learner's part of ``trainer_state.json``: the KL controller."""
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def save(self, tmp: Path) -> None:
        """The trained roles' weights and optimizers into the checkpoint folder ``tmp``
        (collective), and with "hf_model" in actor.checkpoint.save_contents the actor as an HF
        folder (actor/huggingface, verl's place for it)."""
        p = self.parts
        p.actor.save(str(tmp / "actor"))
        if wants_hf_model(self.cfg.actor_rollout_ref.actor.checkpoint.save_contents):
            write_hf_model(p.actor, p.model_paths["actor"], tmp / "actor" / HF_FOLDER)
        if p.critic is not None:
            p.critic.save(str(tmp / "critic"))

    def load(self, ckpt: Path) -> None:
        """The weights and optimizers `save` wrote in ``ckpt``."""
        p = self.parts
        p.actor.load(str(ckpt / "actor"))
        if p.critic is not None:
            p.critic.load(str(ckpt / "critic"))
