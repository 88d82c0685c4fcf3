"""The fully asynchronous producer: samples from rollout workers of their own, generated
continuously (``actor_rollout_ref.hybrid_engine=false``; docs/design.md, "Disaggregated,
fully asynchronous RL").

Trainer rank 0 keeps the workers (`megarl.rollout.worker_pool.WorkerPool`, the run's engine)
busy: every training prompt is a request of its n samples, handed out as soon as a worker has
room, and a learner step takes the first ``R = ppo_mini_batch_size x require_batches`` prompts
whose samples are all back, in the order they completed. Then the step is scored and trained
like any other; every ``trigger_parameter_sync_step`` steps the new weights stream to the
workers (`megarl.rollout.weight_stream`), which apply them once their running requests finish,
so every sample comes whole from one version, which it carries (``policy_version``); with
``async_training.partial_rollout`` they apply them at once and the running requests go on
under them (their KV cache recomputed), each token carrying the version that sampled it
(``token_version``; lags per token ``async/token_version_lag/*``, the share of samples that
span versions ``async/partial_samples``).

How far ahead the workers run is verl's rule: within a sync window of ``T`` steps at most
``R x T x (1 + staleness_threshold)`` prompts are out (handed out since the window began, plus
those still out from before it), so with staleness 0 and T = 1 every batch is sampled by the
weights it trains (synchronous, on the workers), and a threshold s lets s x R x T prompts run
ahead on the previous version. The lag of each sample (actor updates between the weights that
sampled it and those it trains) is logged: ``async/policy_version_lag/{min,mean,max}``.

The PPO ratio is taken against the engine's logprobs with
``async_training.use_rollout_log_probs`` (verl's default), as the one-step-off producer does
(`megarl.trainer.correction.lagged_logprobs`).

Each prompt's noise is keyed by its serial number (the n-th prompt handed out, counted across
resumes), so a prompt gives the same samples on whichever worker serves it. Which prompts a batch holds depends on
when samples finish, so runs are not bitwise repeatable across machines or loads.

Checkpoints hold the sampler's position and the prompts handed out but not yet trained on; a
resumed run hands those out again first (generated again on the resumed weights): no prompt is
lost and none is trained twice.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from megarl.config import disaggregated
from megarl.config.schema import Config
from megarl.errors import UserInputError
from megarl.rollout.coordinator import PromptRequest
from megarl.trainer import generation as R
from megarl.trainer.algorithm import Algorithm
from megarl.trainer.batch import RolloutBatch, RolloutSample
from megarl.trainer.correction import check_lagged_correction
from megarl.trainer.metrics import Timer
from megarl.trainer.parts import RunParts
from megarl.trainer.producer import SampleProducer
from megarl.trainer.reward_assembly import RewardAssembly
from megarl.utils import dist as mdist


class FullyAsyncProducer(SampleProducer):
    """A step's batch from the rollout workers' stream of finished samples (module doc)."""

    def __init__(self, cfg: Config, parts: RunParts, rewards: RewardAssembly) -> None:
        super().__init__(cfg, parts, rewards)
        at = cfg.async_training
        self.ratio_against_rollout = bool(at.use_rollout_log_probs)
        self.version_of = self.policy_version
        self.rollout_tp = mdist.world_size()  # rank 0 generates for the whole world
        self.per_step = disaggregated.prompts_per_step(cfg)
        self.sync_every = int(at.trigger_parameter_sync_step)
        self.window = disaggregated.window_prompts(cfg)
        self.total_prompts = parts.total_steps * self.per_step
        self.timeout_s = float(at.engine_timeout_s)
        self.seed = R.sampling_seed(cfg.trainer.seed, 0, 0, R.ROLLOUT_STREAM)
        self.coord = getattr(parts.engine, "coord", None)  # rank 0's; None elsewhere
        self.pool: deque[int] = deque()  # dataset indices drawn, not yet handed out
        self.index_of: dict[int, int] = {}  # prompt serial -> dataset index (out, untrained)
        self.issued = 0  # prompts handed out
        self.next_key = 0  # the next prompt's serial number (its noise key), never reused
        self.taken = 0  # prompts trained on (or being trained on)
        self.window_base = 0  # ``taken`` when the current sync window began

    @staticmethod
    def check_settings(cfg: Config, algorithm: Algorithm) -> None:
        """A loss without a ratio needs the truncated importance weights (as one-step-off)."""
        check_lagged_correction(1, cfg.actor_rollout_ref.actor.policy_loss.loss_mode,
                                algorithm.loss.has_ratio,
                                cfg.algorithm.rollout_correction.rollout_is)
        if getattr(cfg.data.sampler, "class_name", None):
            raise UserInputError(
                "data.sampler.class_name: a user sampler (a curriculum's update(batch) "
                "included) is not built for rollout workers; use the colocated modes")

    def policy_version(self, step: int) -> int:
        """The version of the weights after ``step``: the actor updates made by then."""
        return max(0, step - self.cfg.trainer.critic_warmup)

    def sync_due(self, step: int) -> bool:
        """Whether new weights go to the workers after ``step``."""
        return step % self.sync_every == 0 or step == self.parts.total_steps

    # ------------------------------------------------------------------ the stream
    def _next_index(self) -> int:
        if not self.pool:
            self.pool.extend(self.parts.sampler.next_batch())
        return self.pool.popleft()

    def _top_up(self) -> None:
        """Hand out prompts while the window's budget and the run's prompts allow."""
        sampling = self.sampling(self.seed)
        ds = self.parts.train_ds
        while (self.issued - self.window_base < self.window
               and self.issued < self.total_prompts):
            idx = self._next_index()
            serial = self.next_key
            self.next_key += 1
            self.coord.add([PromptRequest(key=serial, prompt=list(ds[idx].prompt_ids),
                                          seed=self.seed, n=sampling.n,
                                          max_new_tokens=sampling.max_new_tokens)])
            self.index_of[serial] = idx
            self.issued += 1

    def new_window(self) -> None:
        """A sync happened: the prompts still out count against the new window's budget."""
        self.window_base = self.taken
        if self.coord is not None:
            self._top_up()

    def produce(self, step: int, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """The first ``per_step`` prompts whose samples are all back (rank 0 waits for them and
        hands them to every rank), scored."""
        picked = None
        if self.coord is not None:
            with timer("gen"):  # the learner's wait for samples
                self._top_up()
                ready = self.coord.take(self.per_step, timeout_s=self.timeout_s)
            picked = [(r.key, self.index_of.pop(r.key), r.samples) for r in ready]
        picked = mdist.broadcast_object(picked)
        self.taken += self.per_step
        ds = self.parts.train_ds
        items = [ds[idx] for _, idx, _ in picked]
        samples = [
            RolloutSample(
                prompt_ids=list(item.prompt_ids), response_ids=list(c.token_ids),
                rollout_logprobs=c.logprobs.tolist() if c.logprobs is not None else None,
                finish_reason=c.finish_reason, group=g, data_source=item.data_source,
                ground_truth=item.ground_truth, extra_info=dict(item.extra_info or {}),
                policy_version=c.policy_version, token_versions=c.token_versions)
            for g, ((_, _, completions), item) in enumerate(zip(picked, items))
            for c in completions]
        scores, reward_metrics = self.rewards.score(samples, items, 0, timer)
        metrics = R.merge_round_metrics([reward_metrics])
        batch = RolloutBatch.from_samples(samples, self.parts.pad_id)
        batch.tensors["verifiable"] = scores
        metrics.update(self._lag_metrics(step, batch))
        return batch, metrics

    def _lag_metrics(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """Lags in actor updates behind the weights this step trains: per sample (its first
        token's version) and, with per-token versions, per generated token, with the share of
        samples that span versions (a partial rollout's)."""
        trained = self.policy_version(step - 1)  # the weights this step's update starts from
        lag = trained - batch.tensors["policy_version"].double()
        out = {}
        if "token_version" in batch.tensors:
            versions = batch.tensors["token_version"]
            model = batch.response_mask.bool() & (versions >= 0)
            token_lag = trained - versions[model].double()
            # versions never decrease along a sample, whose own is its first token's
            spans = versions.masked_fill(~model, -1).amax(1) != batch.tensors["policy_version"]
            out = {"async/token_version_lag/min": float(token_lag.min()),
                   "async/token_version_lag/mean": float(token_lag.mean()),
                   "async/token_version_lag/max": float(token_lag.max()),
                   "async/partial_samples": float(spans.double().mean())}
        return out | {"async/policy_version": float(trained),
                "async/policy_version_lag/min": float(lag.min()),
                "async/policy_version_lag/mean": float(lag.mean()),
                "async/policy_version_lag/max": float(lag.max()),
                "async/prompts_out": float(self.issued - self.taken),
                # seconds the workers have computed since the run began (all of them)
                "async/rollout_busy_s": (float(sum(self.coord.busy_s.values()))
                                         if self.coord is not None else 0.0)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The sampler's position, the prompts drawn but not handed out and those out but not
        trained on (rank 0's; handed out again first on resume)."""
        out = sorted(self.index_of.items())
        return {"sampler": self.parts.sampler.state_dict(),
                "fully_async": {"untrained": [idx for _, idx in out], "pool": list(self.pool),
                                "taken": self.taken, "next_key": self.next_key}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        mine = state.get("fully_async")
        if mine is None:
            raise UserInputError(
                "trainer.resume: the checkpoint was written by a colocated run (no rollout "
                "workers' state); resume it with actor_rollout_ref.hybrid_engine=true")
        self.pool = deque(int(i) for i in mine["untrained"] + mine["pool"])
        self.taken = self.issued = self.window_base = int(mine["taken"])
        self.next_key = int(mine["next_key"])

