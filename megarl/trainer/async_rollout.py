"""Asynchronous rollout with bounded staleness (verl's one-step-off-policy recipe and
``async_training.staleness_threshold``): the engine generates the batches of the next
``staleness`` steps while the trainer trains on the current one.

With staleness s (the engine is a `ProcessRolloutEngine`: megarl's torch engine or vLLM in its
own process, on its own cores):

    step k:  collect batch k (sampled earlier with version max(0, k-1-s))
             queue the batches of steps k+1 .. k+s that are not queued yet, each on the newest
             published version (v_{k-1}: the engine picks it up before it starts)
             score, old/ref logprobs, advantages, updates -> publish v_k (the ring)

so with s = 1, while step k trains, batch k+1 is generated with the weights published after
step k-1. A version is the trainer step whose update produced the weights (0: the initial
ones); every sample carries the version that sampled it (``policy_version``, lag metrics
``async/policy_version_lag/{min,mean,max}``). Dynamic sampling's refill rounds and the ReMax
greedy baselines generate at once on the newest published version (their samples say so).

Off-policy correction (`AsyncRLTrainer.behaviour_logprobs`): the PPO ratio is taken against the
behaviour policy's logprobs, i.e. the engine's sampling logprobs of the version that sampled
(``async_training.use_rollout_log_probs=true``, verl's default; exact for any lag, no weight
history kept on the trainer). The trainer's own recomputation with its current weights (one
version newer) is still made and gives the mismatch metrics ``rollout_corr/*``; with
``use_rollout_log_probs=false`` it is the ratio's denominator instead (the proximal policy of
decoupled PPO; the behaviour logprobs then enter only through the metrics, and through the
truncated importance weights `pi_prox / mu` of ``algorithm.rollout_correction.rollout_is``, which
are applied in this mode only: against the behaviour logprobs the ratio already corrects, see
`megarl.trainer.correction`).

Exact resume: a checkpoint waits for the batches in flight and stores them per rank
(``async/rank{r}.pt``: prompts, keys, sampling and completions with their versions); the
resumed run collects them instead of generating, and queues later batches exactly as an
uninterrupted run would (the sampler's position is never advanced by a prefetch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.trainer import generation as R
from megarl.trainer.parts import async_settings
from megarl.trainer.trainer import RLTrainer
from megarl.utils import dist as mdist


class AsyncRLTrainer(RLTrainer):
    """`RLTrainer` whose rollouts come from the engine process ahead of time (module doc)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.staleness, self.use_rollout_log_probs, _ = async_settings(cfg)
        self.ratio_against_rollout_logprobs = self.use_rollout_log_probs
        engine = self.parts.engine
        if not hasattr(engine, "prefetch"):
            raise UserInputError("async_training.staleness_threshold > 0 needs the engine "
                                 "process (actor_rollout_ref.rollout.name=torch or vllm)")
        engine.version_fn = lambda: self.step
        self._queued: dict[int, Any] = {}  # step -> match key of its prefetched first round

    # ------------------------------------------------------------------ producer
    def _peek_items(self, ahead: int) -> list[Any]:
        """The dataset items of the first generation round ``ahead`` steps from now (the
        sampler's position is restored)."""
        sampler = self.parts.sampler
        state = sampler.state_dict()
        try:
            for _ in range(ahead + 1):
                idx = sampler.next_batch()
        finally:
            sampler.load_state_dict(state)
        return [self.parts.train_ds[i] for i in idx]

    def _queue(self, step: int, ahead: int) -> None:
        """Queue ``step``'s first generation round exactly as `R.generate` will ask for it."""
        if step in self._queued or step > self.parts.total_steps:
            return
        items = self._peek_items(ahead)
        seed = R.sampling_seed(self.cfg.trainer.seed, step, 0, R.ROLLOUT_STREAM)
        mine, _ = R.local_share(len(items), self.rollout_tp)
        prompts = [list(items[k].prompt_ids) for k in mine]
        self._queued[step] = self.parts.engine.prefetch(prompts, self._sampling(seed), mine)

    def rollout_and_score(self, timer: Any) -> tuple[Any, dict[str, float]]:
        engine = self.parts.engine
        self._queue(self.step, 0)  # queued by an earlier step, or now (the first step)
        batch, metrics = super().rollout_and_score(timer)
        for step in [s for s in self._queued if s <= self.step]:  # collected, or never will be
            engine.drop(self._queued.pop(step))
        for ahead in range(1, self.staleness + 1):
            self._queue(self.step + ahead, ahead - 1)
        version = engine.latest_version
        lag = version - batch.tensors["policy_version"].double()
        metrics["async/policy_version"] = float(version)
        metrics["async/policy_version_lag/min"] = float(lag.min())
        metrics["async/policy_version_lag/mean"] = float(lag.mean())
        metrics["async/policy_version_lag/max"] = float(lag.max())
        return batch, metrics

    # ------------------------------------------------------------------ off-policy correction
    def behaviour_logprobs(self, batch: Any, metrics: dict[str, float]) -> None:
        """Called by the step after ``old_logprob`` was recomputed with the trainer's current
        weights: measure the gap to the behaviour policy and choose the ratio's denominator
        (module doc)."""
        t = batch.tensors
        if "old_logprob" not in t:  # no recomputed pass this step: the ratio needs none
            t["old_logprob"] = t["rollout_logprob"]
            return
        behaviour, prox = t["rollout_logprob"], t["old_logprob"]
        metrics.update(mismatch_metrics(behaviour, prox, batch.response_mask))
        if self.use_rollout_log_probs:
            t["prox_logprob"] = prox
            t["old_logprob"] = behaviour

    # ------------------------------------------------------------------ checkpoints
    def write_checkpoint(self, tmp: Path) -> None:
        """The weights, and the batches in flight (waited for), before the checkpoint is
        marked complete."""
        super().write_checkpoint(tmp)
        inflight = self.parts.engine.export_prefetched()
        if mdist.rank() == 0:
            (tmp / "async").mkdir(exist_ok=True)
        mdist.barrier()
        torch.save({"inflight": inflight, "queued": {str(s): k for s, k in self._queued.items()}},
                   tmp / "async" / f"rank{mdist.rank()}.pt")

    def maybe_resume(self) -> int | None:
        step = super().maybe_resume()
        if step is None:
            return None
        ckpt = self.ckpt.step_dir(step) if self.cfg.trainer.resume == "auto" else Path(
            self.cfg.trainer.resume)
        path = ckpt / "async" / f"rank{self.rank}.pt"
        if not path.is_file():
            raise UserInputError(
                f"trainer.resume: {ckpt} has no asynchronous-rollout state for rank "
                f"{self.rank} (it was written by a synchronous run, or with fewer ranks); "
                "resume it with async_training.staleness_threshold=0 and the same ranks")
        state = torch.load(path, weights_only=True)
        self.parts.engine.import_prefetched(state["inflight"])
        self._queued = {int(s): _freeze(k) for s, k in state["queued"].items()}
        return step


def mismatch_metrics(behaviour: torch.Tensor, current: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Behaviour (rollout) logprobs vs the trainer's current ones, both [B, L], over the
    response ``mask`` [B, L]: ``rollout_corr/kl`` (k1 estimate of KL(behaviour || current),
    mean over tokens), ``rollout_corr/k3_kl``, and the token ratio current / behaviour
    (``ratio_mean``, ``ratio_min``, ``ratio_max``)."""
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1)
    log_ratio = (current.double() - behaviour.double()) * m
    ratio = torch.exp(log_ratio)
    on = m.bool()
    if not on.any():
        return {}
    return {
        "rollout_corr/kl": float((-log_ratio).sum() / n),
        "rollout_corr/k3_kl": float(((ratio - 1 - log_ratio) * m).sum() / n),
        "rollout_corr/ratio_mean": float((ratio * m).sum() / n),
        "rollout_corr/ratio_min": float(ratio[on].min()),
        "rollout_corr/ratio_max": float(ratio[on].max()),
    }


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x
