"""The RL loop. One step:

  prompts -> rollout (n per prompt) -> verifiable rewards (an outcome reward model's or the
  generative judge's scores in their place when one is configured) -> algorithm.prepare
  -> PRM step scores, ref and old logprobs, values -> algorithm.advantages (rewards placed,
  KL in reward) -> actor (and critic) updates over mini-batches and ppo epochs with the
  algorithm's loss -> weight sync to the engine -> metrics, validation, checkpoint.

Three stages run it (docs/design.md, "Three schedules of the same three stages"): the sample
producer (`megarl.trainer.producer`: prompts, rollout, scores), the learner
(`megarl.trainer.learner`: logprobs, advantages, updates) and the weight publisher
(`megarl.rollout.publish`); the run's schedule (`megarl.trainer.schedules`) says in which
order. `RLTrainer` builds them and runs the steps, validation, checkpoints and resume.

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

from megarl.config.notices import startup_notices
from megarl.config.schema import Config
from megarl.rollout.publish import WeightPublisher
from megarl.trainer import generation as R
from megarl.trainer.algorithm import build_algorithm
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.dump import dump_generations
from megarl.trainer.flops import mfu, peak_flops
from megarl.trainer.learner import Learner
from megarl.trainer.metrics import Timer, data_metrics, per_token_timing
from megarl.trainer.parts import RunParts, build_run
from megarl.trainer.reward_assembly import RewardAssembly
from megarl.trainer.schedules import PRODUCERS, SCHEDULES, schedule_name
from megarl.trainer.settings import algorithm_settings
from megarl.trainer.validation import validate
from megarl.utils import dist as mdist


class RLTrainer:
    """A run: its stages, built from the validated config, and the loop over its steps."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # the user's estimators and losses (algorithm.custom_algorithms.path) are imported
        # first: a name that has no algorithm fails before any model is loaded
        algorithm = build_algorithm(algorithm_settings(cfg))
        self.schedule = schedule_name(cfg)
        producer_class = PRODUCERS[self.schedule]
        producer_class.check_settings(cfg, algorithm)
        self.parts: RunParts = build_run(cfg)
        p = self.parts
        self.rank = mdist.rank()
        rewards = RewardAssembly(p.scorer, p.outcome_rm, p.judge, p.tokenizer)
        if rewards.model_scores:
            # its score is the reward (in place of the verifiable one): no PRM step scores; the
            # entry is built again from those settings, so that it and its settings agree
            s = algorithm.settings
            algorithm = build_algorithm(
                dataclasses.replace(s, adv=dataclasses.replace(s.adv, prm_enabled=False)))
        self.producer = producer_class(cfg, p, rewards)
        self.learner = Learner(cfg, p, algorithm)
        self.publisher = WeightPublisher(
            p.engine, free_cache_engine=cfg.actor_rollout_ref.rollout.free_cache_engine,
            version_of=self.producer.version_of)
        self.rollout_tp = self.producer.rollout_tp  # ranks per engine group of a generation
        self.peak_flops = peak_flops(p.device)
        self.actor_hf_config = None
        if self.peak_flops is not None:
            from megarl.models import read_hf_config

            self.actor_hf_config = read_hf_config(p.model_paths["actor"])
        self.ckpt = CheckpointManager(Path(p.run_dir) / "checkpoints",
                                      cfg.trainer.max_ckpt_to_keep)
        self.step = 0
        self.logger = None
        self._resumed_row: dict[str, float] | None = None
        self.resume_notes: list[str] = []  # what a resume changed, printed after it

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        """Step ``self.step`` (already advanced by the caller): the schedule's stages, then
        the step's data, timing and throughput metrics."""
        timer = Timer()
        t0 = time.perf_counter()
        batch, metrics = SCHEDULES[self.schedule](self.step, self.producer, self.learner,
                                                  self.publisher, timer)
        metrics.update(self.step_metrics(batch, timer, time.perf_counter() - t0))
        metrics["actor/lr"] = metrics.get("actor/lr", float("nan"))
        return metrics

    def step_metrics(self, batch: RolloutBatch, timer: Timer,
                     step_time: float) -> dict[str, float]:
        """The step's data metrics (verl's names), its timings (seconds; per token), MFU,
        throughput (tokens per second per rank) and peak memory."""
        cfg, p = self.cfg, self.parts
        a = cfg.actor_rollout_ref.actor
        metrics = data_metrics(batch, cfg.data.max_response_length, cfg.data.max_prompt_length)
        metrics["data/num_filtered_prompts"] = float(p.train_ds.num_filtered)
        metrics["data/num_bad_rows"] = float(p.train_ds.num_bad_rows)
        metrics.update(timer.metrics())
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
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        p = self.parts
        if p.val_items is None:
            return {}
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        if vk.do_sample:
            params = self.producer.sampling(
                R.sampling_seed(self.cfg.trainer.seed, self.step, 99), validation=True)
        else:
            params = self.producer.sampling(0, validation=True, n=1, greedy=True)
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
        return {"step": self.step, **self.producer.state_dict(), **self.learner.state_dict(),
                "step_metrics": step_metrics}

    def write_checkpoint(self, tmp: Path) -> None:
        """Write this step's state into the checkpoint folder ``tmp`` (collective; the folder
        is marked complete after it returns): the learner's weights and optimizers, then what
        the producer holds between steps (the one-step-off batches in flight)."""
        self.learner.save(tmp)
        self.producer.write_checkpoint(tmp)

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
        self.resume_notes[:0] = resume_config.check(self.cfg, ckpt, self.parts.total_steps)
        self.learner.load(ckpt)
        state = self.ckpt.load_trainer_state(ckpt)
        self.step = int(state["step"])
        self._resumed_row = state.get("step_metrics")
        self.producer.load_state_dict(state)
        self.learner.load_state_dict(state)
        self.ckpt.load_rng(ckpt, self.rank)
        self.publisher.load(self.learner.export_weights(), self.step)
        self.producer.restore(ckpt, self.resume_notes)
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
