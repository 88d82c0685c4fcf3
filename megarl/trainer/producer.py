"""The sample producer: the stage that turns training prompts into a scored batch.

It owns the prompt sampler's position, the rollout engine's requests and the scoring
(`RewardAssembly`); it gives the learner a `RolloutBatch` with the verifiable scores
(``tensors["verifiable"]``) and the round's metrics. `SampleProducer` is the synchronous one:
a step's batch is generated when the step asks for it, by the weights published after the
previous step. The one-step-off producer (`megarl.trainer.async_rollout.OneStepOffProducer`)
queues batches ahead on older versions. docs/design.md, "Three schedules of the same three
stages", says how the schedules compose the stages.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.config.schema import Config
from megarl.data.extern import CurriculumBatch
from megarl.errors import UserInputError
from megarl.metrics import Metric
from megarl.rollout.protocol import SamplingParams
from megarl.trainer import generation as R
from megarl.trainer.algorithm import Algorithm, StepContext
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.dump import dump_generations
from megarl.trainer.metrics import Timer
from megarl.trainer.parts import RunParts
from megarl.trainer.reward_assembly import RewardAssembly
from megarl.utils import dist as mdist


class SampleProducer:
    """One step's batch, generated now (module doc)."""

    #: the learner takes the PPO ratio against the engine's logprobs of a lagged batch
    ratio_against_rollout: bool = False
    #: step -> the version label of the weights after it, for engines that label publishes
    version_of: Callable[[int], int] | None = None

    def __init__(self, cfg: Config, parts: RunParts, rewards: RewardAssembly) -> None:
        self.cfg = cfg
        self.parts = parts
        self.rewards = rewards
        self.rank = mdist.rank()
        self.rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size

    @staticmethod
    def check_settings(cfg: Config, algorithm: Algorithm) -> None:
        """Refuse settings this producer cannot serve, before any model is built
        (UserInputError); the synchronous producer has none beyond the config's checks."""

    # ------------------------------------------------------------------ sampling settings
    def sampling(self, seed: int, validation: bool = False, n: int | None = None,
                 greedy: bool = False) -> SamplingParams:
        """The engine's sampling settings for the training rollout (``rollout.*``) or, with
        ``validation``, for validation (``rollout.val_kwargs``)."""
        return R.sampling_params(self.cfg, self.parts.eos_id, seed, validation=validation, n=n,
                                 greedy=greedy)

    # ------------------------------------------------------------------ a batch
    def produce(self, step: int, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate and score step ``step``'s batch. With dynamic sampling
        (``algorithm.filter_groups``), keep only groups whose scores differ and generate more
        batches until train_batch_size groups are kept; ``max_num_gen_batches > 0`` caps the
        rounds (the step then trains on the groups kept so far, at least one). One pass over the
        training prompts without enough groups is an error."""
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
            seed = R.sampling_seed(cfg.trainer.seed, step, rnd, R.ROLLOUT_STREAM)
            with timer("gen"):
                samples = R.generate(p.engine, items, self.sampling(seed),
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
            dump_generations(cfg.trainer.rollout_data_dir, step, kept, scores.tolist(),
                             p.tokenizer)
        if getattr(p.sampler, "curriculum", False):  # data.sampler with update(batch)
            p.sampler.update(CurriculumBatch(
                index=[drawn[s.group] for s in kept], score=scores.tolist(),
                data_source=[s.data_source for s in kept],
                extra_info=[s.extra_info for s in kept], step=step))
        batch = RolloutBatch.from_samples(kept, p.pad_id)
        batch.tensors["verifiable"] = scores
        return batch, metrics

    def step_context(self, timer: Timer) -> StepContext:
        """What the algorithm's prepare hook may use: generation on the engine (all ranks,
        gathered), the scorer and the run's sampling settings."""
        p = self.parts

        def generate(items: list[Any], params: SamplingParams) -> list:
            return R.generate(p.engine, items, params, 0, tp_size=self.rollout_tp,
                              agent=p.agent)

        return StepContext(generate=generate, score=self.rewards.final_scores,
                           sampling=self.sampling, timer=timer)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The producer's part of ``trainer_state.json``: the sampler's position."""
        return {"sampler": self.parts.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parts.sampler.load_state_dict(state["sampler"])

    def write_checkpoint(self, tmp: Path) -> None:
        """Files of the producer's own in the checkpoint folder ``tmp`` (collective); the
        synchronous producer holds nothing between steps."""

    def restore(self, ckpt: Path, notes: list[str]) -> None:
        """Read what `write_checkpoint` wrote in ``ckpt`` after the weights were published;
        ``notes``: lines the run prints about what the resume changed."""
