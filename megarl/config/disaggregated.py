"""The disaggregated mode's settings (``actor_rollout_ref.hybrid_engine=false``, verl's
fully-async recipe): its derived values and its checks, in one place.

- ``rollout.nnodes`` x ``rollout.n_gpus_per_node`` rollout workers (one engine each) beside
  the trainer's ranks;
- a learner step trains on ``ppo_mini_batch_size x async_training.require_batches`` prompts
  (``data.train_batch_size`` 0, verl's spelling, is that number);
- new weights every ``async_training.trigger_parameter_sync_step`` steps;
- ``async_training.staleness_threshold``: a share (>= 0) of extra prompts generated ahead;
- ``rollout.total_rollout_steps``: the run's length in prompts (verl's), unless
  ``trainer.total_training_steps`` is set.

- ``async_training.partial_rollout``: requests running at a sync go on under the new weights
  (their KV cache recomputed; each token carries the version that sampled it).

What is not built yet is refused naming it: workers on other nodes, an engine other than
megarl's torch engine, rollout tensor parallelism, multi-turn rollouts.
"""

from __future__ import annotations

from typing import Any, Protocol

from megarl.config.schema import Config


class Checker(Protocol):
    def fail(self, keys: str | tuple[str, ...], text: str) -> None: ...


def is_disaggregated(cfg: Config) -> bool:
    """Whether rollouts run on rollout workers of their own."""
    return not cfg.actor_rollout_ref.hybrid_engine


def prompts_per_step(cfg: Config) -> int:
    """Prompts a disaggregated learner step trains on."""
    return (cfg.actor_rollout_ref.actor.ppo_mini_batch_size
            * cfg.async_training.require_batches)


def window_prompts(cfg: Config) -> int:
    """Prompts out at most per sync window: R x T x (1 + staleness_threshold) (verl's rule)."""
    at = cfg.async_training
    return int(prompts_per_step(cfg) * at.trigger_parameter_sync_step
               * (1 + float(at.staleness_threshold)))


def worker_capacity(cfg: Config) -> int:
    """Sequences a rollout worker may hold (running or queued in its session): its share of a
    whole window, so the window goes out as soon as it opens and no worker waits for the
    trainer to hand out more while it trains, and at least twice its engine's slots."""
    workers = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    share = -(-window_prompts(cfg) * cfg.actor_rollout_ref.rollout.n // max(workers, 1))
    return max(2 * cfg.actor_rollout_ref.rollout.max_num_seqs, share)


def learner_steps(cfg: Config) -> int | None:
    """Learner steps of ``rollout.total_rollout_steps`` prompts (None: not set)."""
    total = cfg.rollout.total_rollout_steps
    if not is_disaggregated(cfg) or total is None:
        return None
    return int(total) // prompts_per_step(cfg)


def fill(cfg: Config, explicit: set[str] = frozenset()) -> None:
    """``data.train_batch_size`` 0 (verl's fully-async scripts) = the prompts of a step; a
    multiple k of ``ppo_mini_batch_size`` with ``async_training.require_batches`` unset
    (verl's one-step-off scripts: a step of train_batch_size prompts in k updates) sets
    require_batches to k; ``data.gen_batch_size`` 1 (verl asserts it in its fully-async
    recipe: one prompt per rollout step) is how the workers are fed anyway, so it is read as
    unset. ``explicit``: the dotted keys the user wrote."""
    if not is_disaggregated(cfg):
        return
    mini, batch = cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if batch == 0:
        cfg.data.train_batch_size = prompts_per_step(cfg)
    elif ("async_training.require_batches" not in explicit and isinstance(mini, int)
          and mini > 0 and isinstance(batch, int) and batch > mini and batch % mini == 0):
        cfg.async_training.require_batches = batch // mini
    if cfg.data.gen_batch_size == 1:
        cfg.data.gen_batch_size = None


def check(cfg: Config, c: Checker) -> None:
    """Problems of the disaggregated keys, in either mode."""
    at, workers = cfg.async_training, cfg.rollout
    s = at.staleness_threshold
    if not is_disaggregated(cfg):
        if workers.total_rollout_steps is not None:
            c.fail(("rollout.total_rollout_steps", "actor_rollout_ref.hybrid_engine"),
                   "the run's length in prompts handed to rollout workers: a disaggregated "
                   "mode key (hybrid_engine=false); colocated runs take "
                   "trainer.total_training_steps")
        if workers.nnodes or workers.n_gpus_per_node:
            c.fail(("rollout.nnodes", "actor_rollout_ref.hybrid_engine"),
                   "rollout workers of their own run with actor_rollout_ref.hybrid_engine=false "
                   "(the disaggregated mode); colocated rollouts share the training ranks: "
                   "set rollout.nnodes=0 and rollout.n_gpus_per_node=0, or hybrid_engine=false")
        if at.partial_rollout:
            c.fail(("async_training.partial_rollout", "actor_rollout_ref.hybrid_engine"),
                   "requests that go on across a weight sync are the disaggregated mode's "
                   "(actor_rollout_ref.hybrid_engine=false with rollout workers); colocated "
                   "rollouts end before the weights change: set it to false")
        if isinstance(s, float) and not s.is_integer():
            c.fail(("async_training.staleness_threshold", "actor_rollout_ref.hybrid_engine"),
                   f"{s!r}: colocated rollouts lag by whole steps (0, 1, 2, ...); a share of "
                   "samples is the disaggregated mode's (actor_rollout_ref.hybrid_engine=false "
                   "with rollout.nnodes / rollout.n_gpus_per_node)")
        return
    _check_workers(cfg, c)
    if isinstance(s, bool) or s < 0:
        c.fail("async_training.staleness_threshold", f"must be >= 0 (a share of extra prompts "
               f"generated ahead of a sync window), got {s!r}")
    for key in ("require_batches", "trigger_parameter_sync_step"):
        value = getattr(at, key)
        if value < 1:
            c.fail(f"async_training.{key}", f"must be >= 1, got {value!r}")
    if workers.total_rollout_steps is not None and \
            workers.total_rollout_steps < prompts_per_step(cfg):
        c.fail("rollout.total_rollout_steps",
               f"{workers.total_rollout_steps} prompts do not make one learner step of "
               f"{prompts_per_step(cfg)} (actor.ppo_mini_batch_size x "
               "async_training.require_batches)")
    want = prompts_per_step(cfg)
    if cfg.data.train_batch_size != want:
        c.fail(("data.train_batch_size", "async_training.require_batches"),
               f"{cfg.data.train_batch_size} prompts, but a disaggregated step trains on "
               f"actor.ppo_mini_batch_size x async_training.require_batches = {want}; set "
               f"data.train_batch_size={want} or 0")
    if at.partial_rollout and cfg.actor_rollout_ref.actor.router_replay.mode == "R3":
        c.fail(("async_training.partial_rollout", "actor_rollout_ref.actor.router_replay.mode"),
               "R3 replays the experts the engine chose, but a partial rollout recomputes a "
               "running request's prefix under new weights, which route it anew; set "
               "partial_rollout=false (each request finishes on its weights) or router_replay "
               "R2")
    for key, why in _unbuilt(cfg):
        c.fail(key, why)


def _check_workers(cfg: Config, c: Checker) -> None:
    w = cfg.rollout
    if w.nnodes < 1 or w.n_gpus_per_node < 1:
        c.fail(("actor_rollout_ref.hybrid_engine", "rollout.nnodes", "rollout.n_gpus_per_node"),
               f"hybrid_engine=false runs rollouts on workers of their own: rollout.nnodes "
               f"({w.nnodes}) and rollout.n_gpus_per_node ({w.n_gpus_per_node}) must be >= 1")
    elif w.nnodes > 1:
        c.fail("rollout.nnodes", f"{w.nnodes}: rollout workers on other nodes need the "
               "launcher's rollout world, not built yet; rollout.nnodes=1 starts them on the "
               "trainer's first node")


def _unbuilt(cfg: Config) -> list[tuple[Any, str]]:
    ro = cfg.actor_rollout_ref.rollout
    out = []
    if ro.name != "torch":
        out.append((("actor_rollout_ref.rollout.name", "actor_rollout_ref.hybrid_engine"),
                    f"{ro.name!r}: the disaggregated mode's workers run megarl's torch engine "
                    "(vLLM and SGLang workers are not built yet); set rollout.name=torch"))
    if ro.tensor_model_parallel_size != 1:
        out.append(("actor_rollout_ref.rollout.tensor_model_parallel_size",
                    "a rollout worker is one engine on one device (engine groups of several "
                    "ranks are not built yet); set it to 1"))
    if ro.multi_turn.enable:
        out.append(("actor_rollout_ref.rollout.multi_turn.enable",
                    "multi-turn rollouts on rollout workers are not built yet; use the "
                    "colocated modes (hybrid_engine=true)"))
    if cfg.algorithm.filter_groups.enable:
        out.append(("algorithm.filter_groups.enable",
                    "dynamic sampling's refill rounds are not built for rollout workers; use the "
                    "colocated modes"))
    if cfg.actor_rollout_ref.model.lora_rank > 0:
        out.append(("actor_rollout_ref.model.lora_rank",
                    "LoRA adapters on rollout workers are not built yet (merged weights could "
                    "be sent, but are not); use the colocated modes"))
    return out
