"""The RL loop. One step:

  prompts -> rollout (n per prompt) -> verifiable rewards (an outcome reward model's or the
  generative judge's scores in their place when one is configured) -> algorithm.prepare
  -> PRM step scores, ref and old logprobs, values -> algorithm.advantages (rewards placed,
  KL in reward) -> actor (and critic) updates over mini-batches and ppo epochs with the
  algorithm's loss -> weight sync to the engine -> metrics, validation, checkpoint.

The algorithm (``megarl.trainer.algorithm``: its registry of entries, the user's included)
supplies the hooks and declares what the step must provide; the loop never tests its name.

SPMD: every rank started by torchrun runs this same loop and holds the same step batch.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

from megarl import algos
from megarl.algos.rollout_correction import logprob_diff_metrics
from megarl.backends.settings import micro_batch_tokens
from megarl.config.notices import startup_notices
from megarl.config.schema import Config
from megarl.data.extern import CurriculumBatch
from megarl.errors import UserInputError
from megarl.metrics import Metric, prefixed
from megarl.rollout.protocol import SamplingParams
from megarl.trainer import generation as R
from megarl.trainer.advantage import old_logprob_pass
from megarl.trainer.algorithm import StepContext, build_algorithm
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.checkpoint import HF_FOLDER, CheckpointManager, wants_hf_model, write_hf_model
from megarl.trainer.correction import (
    add_rollout_is_weights,
    add_rollout_rejection,
    bypass_logprobs,
    require_rollout_logprobs,
    without_rejected,
)
from megarl.trainer.dump import dump_generations
from megarl.trainer.flops import mfu, peak_flops
from megarl.trainer.logprob_plan import CorrectionFacts, StepFacts, plan_logprob_passes
from megarl.trainer.losses import actor_loss_fn, critic_loss_fn
from megarl.trainer.metrics import Timer, data_metrics, per_token_timing
from megarl.trainer.parts import RunParts, build_run
from megarl.trainer.prm import prm_step_settings, score_steps
from megarl.trainer.reward_assembly import RewardAssembly
from megarl.trainer.settings import algorithm_settings
from megarl.trainer.update import mean_metrics, run_update
from megarl.trainer.validation import validate
from megarl.utils import dist as mdist


class RLTrainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # the user's estimators and losses (algorithm.custom_algorithms.path) are imported
        # first: a name that has no algorithm fails before any model is loaded
        self.algorithm = build_algorithm(algorithm_settings(cfg))
        self.check_settings()
        self.parts: RunParts = build_run(cfg)
        p = self.parts
        self.rank = mdist.rank()
        arr = cfg.actor_rollout_ref
        alg = cfg.algorithm
        self.kl_ctrl = algos.build_kl_controller(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef,
                                                 alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon)
        if p.prm is not None:
            self.step_end_ids, self.prm_marker = prm_step_settings(cfg.reward_model, p.tokenizer)
        self.rewards = RewardAssembly(p.scorer, p.outcome_rm, p.judge, p.tokenizer)
        if self.rewards.model_scores:
            # its score is the reward (in place of the verifiable one): no PRM step scores; the
            # entry is built again from those settings, so that it and its settings agree
            s = self.algorithm.settings
            self.algorithm = build_algorithm(
                dataclasses.replace(s, adv=dataclasses.replace(s.adv, prm_enabled=False)))
        self.rollout_tp = arr.rollout.tensor_model_parallel_size
        self.peak_flops = peak_flops(p.device)
        self.actor_hf_config = None
        if self.peak_flops is not None:
            from megarl.models import read_hf_config

            self.actor_hf_config = read_hf_config(p.model_paths["actor"])
        self.ckpt = CheckpointManager(Path(p.run_dir) / "checkpoints",
                                      cfg.trainer.max_ckpt_to_keep)
        self.step = 0
        self.logger = None
        self.ratio_against_rollout_logprobs = False  # asynchronous rollout may set it
        self._resumed_row: dict[str, float] | None = None
        self.resume_notes: list[str] = []  # what a resume changed, printed after it

    def check_settings(self) -> None:
        """Refuse settings this loop cannot run, before any model is built (UserInputError);
        the synchronous loop has none beyond the config's checks."""

    # ------------------------------------------------------------------ sampling settings
    def _sampling(self, seed: int, validation: bool = False, n: int | None = None,
                  greedy: bool = False) -> SamplingParams:
        ro = self.cfg.actor_rollout_ref.rollout
        src = ro.val_kwargs if validation else ro
        do_sample = getattr(src, "do_sample", True) and not greedy
        return SamplingParams(
            n=n if n is not None else src.n,
            temperature=src.temperature if do_sample else 0.0,
            top_k=src.top_k, top_p=src.top_p, greedy=not do_sample,
            max_new_tokens=self.cfg.data.max_response_length,
            stop_token_ids=list(ro.stop_token_ids) + [self.parts.eos_id],
            stop=list(ro.stop), seed=seed)

    # ------------------------------------------------------------------ one step
    def rollout_and_score(self, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate and score. With dynamic sampling (``algorithm.filter_groups``), keep only
        groups whose scores differ and generate more batches until train_batch_size groups are
        kept; ``max_num_gen_batches > 0`` caps the rounds (the step then trains on the groups
        kept so far, at least one). One pass over the training prompts without enough groups
        is an error."""
        cfg, p = self.cfg, self.parts
        fg = cfg.algorithm.filter_groups
        want = cfg.data.train_batch_size
        per_round = p.sampler.batch_size  # data.gen_batch_size (= train_batch_size by default)
        cap = fg.max_num_gen_batches if fg.max_num_gen_batches > 0 else None
        bound = max(p.sampler.batches_per_epoch, cap or 0)
        kept: list = []
        kept_scores: list[torch.Tensor] = []
        n_groups, rnd = 0, 0
        rounds: list[dict[str, Metric]] = []  # each round's reward metrics
        drawn: dict[int, int] = {}  # group id -> dataset index (a curriculum sampler's update)
        while True:
            idx = p.sampler.next_batch()
            drawn.update((rnd * per_round + k, i) for k, i in enumerate(idx))
            items = [p.train_ds[i] for i in idx]
            seed = R.sampling_seed(cfg.trainer.seed, self.step, rnd, R.ROLLOUT_STREAM)
            with timer("gen"):
                samples = R.generate(p.engine, items, self._sampling(seed),
                                     group_offset=rnd * per_round, tp_size=self.rollout_tp,
                                     agent=p.agent)
            scores, round_metrics = self.rewards.score(samples, items, rnd * per_round, timer)
            rounds.append(round_metrics)
            rnd += 1
            if not fg.enable:
                kept, kept_scores = samples, [scores]
                break
            keep = R.samples_of_groups(samples, R.groups_with_signal(samples, scores),
                                       limit=want - n_groups)
            kept += [samples[i] for i in keep]
            kept_scores.append(scores[keep])
            n_groups += len({samples[i].group for i in keep})
            if n_groups >= want or (cap is not None and rnd >= cap and n_groups > 0):
                break
            if rnd >= bound:
                fix = ("algorithm.filter_groups.max_num_gen_batches=N trains on the groups kept "
                       "after N rounds; " if cap is None and n_groups else "")
                raise UserInputError(
                    f"algorithm.filter_groups: {rnd} generation rounds (every training prompt "
                    f"once) kept {n_groups} of the {want} groups a step needs: every response of "
                    f"the others scored the same. {fix}use prompts the policy sometimes solves "
                    "and sometimes fails, or set algorithm.filter_groups.enable=false")
        metrics = R.merge_round_metrics(rounds)
        metrics.update(R.multi_turn_metrics(kept))  # trajectories of the agent loop only
        if fg.enable:
            metrics["train/num_gen_batches"] = rnd
            metrics["train/kept_groups"] = n_groups
        scores = torch.cat(kept_scores) if kept_scores else torch.zeros(0)
        if cfg.trainer.rollout_data_dir and self.rank == 0:
            dump_generations(cfg.trainer.rollout_data_dir, self.step, kept, scores.tolist(),
                             p.tokenizer)
        if getattr(p.sampler, "curriculum", False):  # data.sampler with update(batch)
            p.sampler.update(CurriculumBatch(
                index=[drawn[s.group] for s in kept], score=scores.tolist(),
                data_source=[s.data_source for s in kept],
                extra_info=[s.extra_info for s in kept], step=self.step))
        batch = RolloutBatch.from_samples(kept, p.pad_id)
        batch.tensors["verifiable"] = scores
        return batch, metrics

    def train_step(self) -> dict[str, float]:
        cfg, p = self.cfg, self.parts
        arr = cfg.actor_rollout_ref
        timer = Timer()
        t0 = time.perf_counter()
        batch, metrics = self.rollout_and_score(timer)
        algo = self.algorithm
        t = batch.tensors
        seq = batch.sequence_batch()
        temperature = arr.rollout.temperature

        algo.prepare(batch, self.step_context(timer))  # may still generate (greedy baselines)
        if arr.rollout.free_cache_engine:  # the engine's memory goes to the training forwards
            with timer("engine_sleep"):
                p.engine.sleep()
            metrics["rollout/engine_asleep"] = float(p.engine.asleep)

        if p.prm is not None:
            with timer("prm"):
                t["step_rewards"], t["step_mask"] = score_steps(p.prm, batch, self.step_end_ids,
                                                                self.prm_marker)
        a = arr.actor
        n_groups = len(set(batch.group_index.tolist()))
        rc = cfg.algorithm.rollout_correction
        plan = plan_logprob_passes(
            StepFacts(step=self.step, lagged="policy_version" in t,  # async rollout's samples
                      has_rollout_logprobs="rollout_logprob" in t,
                      one_update=a.ppo_epochs == 1 and a.ppo_mini_batch_size >= n_groups,
                      ratio_against_rollout=self.ratio_against_rollout_logprobs),
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
            self.behaviour_logprobs(batch, metrics)
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
                c = cfg.critic
                steps = run_update(
                    p.critic, train_batch, ("values", "returns"),
                    lambda norm: critic_loss_fn(c.cliprange_value, c.loss_agg_mode, norm),
                    prompts_per_mini=c.ppo_mini_batch_size, epochs=c.ppo_epochs,
                    shuffle=c.shuffle, seed=R.sampling_seed(cfg.trainer.seed, self.step, 7),
                    max_tokens_per_micro=micro_batch_tokens(c.ppo_max_token_len_per_gpu, c.parallel)
                    if c.use_dynamic_bsz else None,
                    micro_size=c.ppo_micro_batch_size_per_gpu, keep_groups_on_rank=False,
                    loss_scale_factor=cfg.data.max_response_length)
                metrics.update(prefixed(mean_metrics(steps), "critic"))
        if self.step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                keys = algo.update_keys
                if "old_logprob" in t:
                    keys += ("old_logprob",)
                if a.use_kl_loss:
                    keys += ("ref_logprob",)
                if "rollout_is_weights" in t:
                    keys += ("rollout_is_weights",)
                settings = algo.loss_settings(plan.on_policy)
                steps = run_update(
                    p.actor, train_batch, keys, lambda norm: actor_loss_fn(settings, norm),
                    prompts_per_mini=a.ppo_mini_batch_size, epochs=a.ppo_epochs,
                    shuffle=a.shuffle, seed=R.sampling_seed(cfg.trainer.seed, self.step, 3),
                    max_tokens_per_micro=micro_batch_tokens(a.ppo_max_token_len_per_gpu, a.parallel)
                    if a.use_dynamic_bsz else None,
                    micro_size=a.ppo_micro_batch_size_per_gpu,
                    keep_groups_on_rank=algo.needs.whole_groups,
                    loss_scale_factor=cfg.data.max_response_length, temperature=temperature)
                metrics.update(prefixed(mean_metrics(steps), "actor"))
        if self.step > cfg.trainer.critic_warmup or p.engine.asleep:
            with timer("update_weights"):  # an asleep engine may have dropped its weights
                p.engine.update_weights(p.actor.export_weights())
            sync_bytes = getattr(p.engine, "last_sync_bytes", None)  # engines that count them
            if sync_bytes is not None:
                metrics["rollout/weight_sync_bytes"] = float(sync_bytes)
        if arr.rollout.free_cache_engine:
            with timer("engine_wake"):
                p.engine.wake()

        metrics.update(data_metrics(batch, cfg.data.max_response_length,
                                    cfg.data.max_prompt_length))
        metrics["data/num_filtered_prompts"] = float(p.train_ds.num_filtered)
        metrics["data/num_bad_rows"] = float(p.train_ds.num_bad_rows)
        metrics.update(timer.metrics())
        step_time = time.perf_counter() - t0
        metrics["timing_s/step"] = step_time
        # tokens the forwards processed: a multi-turn response's appended tokens included
        n_response = int(batch.response_padding_mask.sum())
        n_prompt = int(batch.prompt_mask.sum())
        metrics.update(per_token_timing(timer.times, n_prompt, n_response))
        if self.actor_hf_config is not None and "update_actor" in timer.times:
            lens = (batch.response_padding_mask.sum(-1) + batch.prompt_mask.sum(-1)).tolist()
            util = mfu(self.actor_hf_config, lens, a.ppo_epochs, timer.times["update_actor"],
                       mdist.world_size(), self.peak_flops)
            if util is not None:
                metrics["perf/mfu/actor"] = util
        n_tokens = n_prompt + n_response
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/time_per_step"] = step_time
        metrics["perf/throughput"] = n_tokens / step_time / max(mdist.world_size(), 1)
        metrics.update(memory_metrics(p.device))
        metrics["training/global_step"] = self.step
        metrics["training/epoch"] = p.sampler.epoch
        metrics["actor/lr"] = metrics.get("actor/lr", float("nan"))
        return metrics

    def behaviour_logprobs(self, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """Off-policy correction of a batch sampled by an earlier policy version (asynchronous
        rollout: `megarl.trainer.async_rollout.AsyncRLTrainer`); the synchronous loop has none."""

    def step_context(self, timer: Timer) -> StepContext:
        """What the algorithm's prepare hook may use: generation on the engine (all ranks,
        gathered), the scorer and the run's sampling settings."""
        p = self.parts

        def generate(items: list[Any], params: SamplingParams) -> list:
            return R.generate(p.engine, items, params, 0, tp_size=self.rollout_tp,
                              agent=p.agent)

        return StepContext(generate=generate, score=self.rewards.final_scores,
                           sampling=self._sampling, timer=timer)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        p = self.parts
        if p.val_items is None:
            return {}
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        if vk.do_sample:
            params = self._sampling(R.sampling_seed(self.cfg.trainer.seed, self.step, 99),
                                    validation=True)
        else:
            params = self._sampling(0, validation=True, n=1, greedy=True)
        t0 = time.perf_counter()
        dump_dir = self.cfg.trainer.validation_data_dir
        show = self.cfg.trainer.log_val_generations
        on_scored = None
        if (dump_dir or show) and self.rank == 0:
            def on_scored(samples, scores):
                if dump_dir:
                    dump_generations(dump_dir, self.step, samples, scores, p.tokenizer)
                if show and self.logger is not None:
                    for line in generation_lines(samples, scores, p.tokenizer, show, self.step):
                        self.logger.print(line)
        out = validate(p.engine, p.val_items, p.val_scorer, params,
                       batch_size=self.cfg.data.val_batch_size, tp_size=self.rollout_tp,
                       on_scored=on_scored, agent=p.agent)
        out["timing_s/testing"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self, step_metrics: dict[str, float] | None = None) -> dict[str, Any]:
        """What resume needs beside the weights; ``step_metrics``: the step's metrics row,
        logged again on resume if the run died between this save and its log."""
        return {"step": self.step, "sampler": self.parts.sampler.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(), "step_metrics": step_metrics}

    def write_checkpoint(self, tmp: Path) -> None:
        """Write this step's state into the checkpoint folder ``tmp`` (collective; the folder
        is marked complete after it returns): the trained roles' weights and optimizers, and
        with "hf_model" in actor.checkpoint.save_contents the actor as an HF folder
        (actor/huggingface, verl's place for it)."""
        p = self.parts
        p.actor.save(str(tmp / "actor"))
        if wants_hf_model(self.cfg.actor_rollout_ref.actor.checkpoint.save_contents):
            write_hf_model(p.actor, p.model_paths["actor"], tmp / "actor" / HF_FOLDER)
        if p.critic is not None:
            p.critic.save(str(tmp / "critic"))

    def save(self, step_metrics: dict[str, float] | None = None) -> Path:
        return self.ckpt.save(self.step, self.write_checkpoint, self.trainer_state(step_metrics))

    def maybe_resume(self) -> int | None:
        mode = self.cfg.trainer.resume
        if mode == "disable":
            return None
        from megarl.trainer import resume_config  # what it continues, and refused changes

        ckpt = resume_config.checkpoint_for(mode, self.ckpt.latest())
        if ckpt is None:
            return None
        p = self.parts
        self.resume_notes[:0] = resume_config.check(self.cfg, ckpt, p.total_steps)
        p.actor.load(str(ckpt / "actor"))
        if p.critic is not None:
            p.critic.load(str(ckpt / "critic"))
        state = self.ckpt.load_trainer_state(ckpt)
        self.step = int(state["step"])
        self._resumed_row = state.get("step_metrics")
        p.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.ckpt.load_rng(ckpt, self.rank)
        p.engine.update_weights(p.actor.export_weights())
        return self.step

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        cfg, p = self.cfg, self.parts
        resumed = self.maybe_resume()
        total = p.total_steps
        logger = self.logger = p.make_logger(total, resumed)
        for line in startup_notices(cfg):
            logger.print(f"notice: {line}")
        if resumed is not None:
            logger.print(f"resumed from step {resumed}")
            for line in self.resume_notes:
                logger.print(line)
            if self._resumed_row is not None and not logger.has_step(resumed):
                logger.log(resumed, self._resumed_row)  # the run died after saving, before logging
        summary: dict[str, Any] = {}
        if self.step == 0 and cfg.trainer.val_before_train:
            val = self.validate()
            if val:
                logger.log(0, val)
                summary["val_before"] = val
                logger.print("validation before training: " + _fmt(val))
        last_val: dict[str, float] = {}
        while self.step < total:
            self.step += 1
            metrics = self.train_step()
            freq = cfg.trainer.test_freq
            if freq and freq > 0 and (self.step % freq == 0 or self.step == total):
                last_val = self.validate()
                metrics.update(last_val)
            sf = cfg.trainer.save_freq
            if sf and sf > 0 and (self.step % sf == 0 or self.step == total):
                t0 = time.perf_counter()
                self.save(metrics)
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - t0
            logger.log(self.step, metrics)
        if last_val:
            summary["val_after"] = last_val
            logger.print("validation after training: " + _fmt(last_val))
        if cfg.trainer.export_hf:
            summary["hf_export"] = p.export_actor_hf()
        summary["curves"] = logger.close()
        return summary


def generation_lines(samples: list, scores: list[float], tokenizer, count: int,
                     step: int) -> list[str]:
    """``trainer.log_val_generations``: the first ``count`` validation responses (verl logs
    input, output and score of a fixed sample; here the first prompts of the set, whose order
    is fixed) as console lines."""
    out = []
    for s, score in list(zip(samples, scores))[:count]:
        prompt = tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
        response = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        out.append(f"val generation (step {step}, score {score:.3f}): input={prompt!r} "
                   f"output={response!r}")
    return out


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory so far: GPU allocator peak on CUDA, this process's peak RSS everywhere."""
    out = {"perf/cpu_max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())
                     if isinstance(v, float) and not math.isnan(v))
