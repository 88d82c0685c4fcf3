"""Asynchronous rollout with bounded staleness (verl's one-step-off-policy recipe and
``async_training.staleness_threshold``): the engine generates the batches of the next
``staleness`` steps while the trainer trains on the current one.

With staleness s (the engine is a `ProcessRolloutEngine`: megarl's torch engine or vLLM in its
own process, on its own cores):

    step k:  collect batch k (queued during step k-1-s, or now for the first steps)
             queue the batches of steps k+1 .. k+s that are not queued yet, each on the newest
             published version (the weights after step k-1: the engine picks them up before
             it starts)
             score, old/ref logprobs, advantages, updates -> publish the new weights (the ring)

so with s = 1, while step k trains, batch k+1 is generated with the weights published after
step k-1. A version counts the actor updates that made the weights (0: the initial ones; with
``trainer.critic_warmup`` w the weights after step k are version max(0, k - w), as the warmup
steps do not update the actor), so a sample's lag is the number of actor updates between the
weights that sampled it and those that train on it. Every sample carries the version that
sampled it (``policy_version``, lag metrics ``async/policy_version_lag/{min,mean,max}``).
Dynamic sampling's refill rounds and the ReMax greedy baselines generate at once on the newest
published version (their samples say so).

Off-policy correction (`AsyncRLTrainer.behaviour_logprobs`; mu: the behaviour policy, i.e. the
engine's sampling logprobs of the version that sampled; pi_prox: the trainer's recomputation
with its weights before this step's update, one or more versions newer):

- ``async_training.use_rollout_log_probs=true`` (verl's default): the PPO ratio is taken against
  mu, exact for any lag with no weight history kept on the trainer; pi_prox gives the mismatch
  metrics ``rollout_corr/*`` and the truncated importance weights `pi_prox / mu` of
  ``algorithm.rollout_correction.rollout_is`` are measured only, since the ratio corrects
  already, unless the loss takes no ratio (``policy_loss.loss_mode=reinforce``): then they are
  applied, and a run with such a loss and ``rollout_is=null`` is refused
  (`megarl.trainer.correction.check_lagged_correction`).
- ``use_rollout_log_probs=false``: the ratio is taken against pi_prox. Only the truncated
  weights `pi_prox / mu` (``rollout_is=token|sequence``, applied) correct for the behaviour
  policy: this pairing is decoupled PPO only with them. With ``rollout_is=null`` nothing does,
  and the startup notice says so.

The KL penalty in the reward (``algorithm.use_kl_in_reward``) measures pi_prox against the
reference, never mu (`megarl.trainer.advantage.place_rewards`).

Exact resume: a checkpoint waits for the batches in flight and stores them per rank
(``async/rank{r}.pt``: prompts, keys, sampling and completions with their versions); the
resumed run collects them instead of generating, and queues later batches exactly as an
uninterrupted run would (the sampler's position is never advanced by a prefetch). A run
resumed with a smaller ``staleness_threshold`` drops the restored batches that would lag more
than the new bound when collected and generates them again (it says so at start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.trainer import generation as R
from megarl.trainer.correction import check_lagged_correction
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
        engine.version_fn = lambda: self.policy_version(self.step)
        self._queued: dict[int, Any] = {}  # step -> match key of its prefetched first round
        self._queued_version: dict[int, int] = {}  # step -> the version it was queued on

    def check_settings(self) -> None:
        """A loss without a ratio needs the truncated importance weights (module doc)."""
        check_lagged_correction(self.cfg, self.algorithm.loss.has_ratio)

    def policy_version(self, step: int) -> int:
        """The version of the weights after ``step``: the actor updates made by then (the
        warmup steps ``trainer.critic_warmup`` make none)."""
        return max(0, step - self.cfg.trainer.critic_warmup)

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
        engine = self.parts.engine
        self._queued_version[step] = engine.latest_version  # the version a request names
        self._queued[step] = engine.prefetch(prompts, self._sampling(seed), mine)

    def rollout_and_score(self, timer: Any) -> tuple[Any, dict[str, float]]:
        engine = self.parts.engine
        self._queue(self.step, 0)  # queued by an earlier step, or now (the first step)
        batch, metrics = super().rollout_and_score(timer)
        for step in [s for s in self._queued if s <= self.step]:  # collected, or never will be
            engine.drop(self._queued.pop(step))
            self._queued_version.pop(step, None)
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
        (module doc). With the ratio against the behaviour logprobs the recomputation moves to
        ``prox_logprob`` (the truncated weights and the KL in the reward read it there)."""
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
        torch.save({"inflight": inflight, "queued": {str(s): k for s, k in self._queued.items()},
                    "versions": {str(s): v for s, v in self._queued_version.items()}},
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
        queued = {int(s): _freeze(k) for s, k in state["queued"].items()}
        versions = {int(s): int(v) for s, v in state.get("versions", {}).items()}
        stale = self._too_stale(versions)
        self.parts.engine.import_prefetched(
            [e for e in state["inflight"] if _freeze(e["key"]) not in {queued[s] for s in stale}])
        self._queued = {s: k for s, k in queued.items() if s not in stale}
        self._queued_version = {s: v for s, v in versions.items() if s in self._queued}
        return step

    def _too_stale(self, versions: dict[int, int]) -> list[int]:
        """The restored steps whose batch (queued on ``versions[step]``) would lag more than
        ``staleness_threshold`` actor updates when collected (a run resumed with a smaller
        bound); each is noted for the run's log and generated again when its step comes."""
        stale = []
        for step, version in sorted(versions.items()):
            lag = self.policy_version(step - 1) - version
            if lag > self.staleness:
                stale.append(step)
                self.resume_notes.append(
                    f"async: the checkpoint's batch of step {step} was sampled by policy version "
                    f"{version}, {lag} actor updates behind the weights that train step {step}, "
                    f"over async_training.staleness_threshold={self.staleness}: dropped, "
                    "generated again")
        return stale


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
