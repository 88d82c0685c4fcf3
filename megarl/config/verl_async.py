"""verl's asynchronous recipes' own keys (``verl.experimental.fully_async_policy`` and
``one_step_off_policy``: their config files' ``async_training.*`` and ``rollout.*`` beside the
trainer config they extend), read as megarl's.

- ``async_training.compute_prox_log_prob=true``: verl recomputes the old logprobs with the
  trainer's weights (a proximal policy) and keeps the rollout logprobs for rollout importance
  sampling, AReaL's decoupled PPO; megarl's ``async_training.use_rollout_log_probs=false`` is
  that (the ratio against the trainer's recomputation, ``algorithm.rollout_correction``
  weighting the behaviour policy). The proximal weights are those before each update (AReaL's
  choice); verl takes those of the sync window's first step, the same with
  ``trigger_parameter_sync_step=1``;
- ``rollout.test_freq``: validation every that many weight syncs (verl's rollouter), so
  ``trainer.test_freq`` = it x ``async_training.trigger_parameter_sync_step``;
- ``rollout.total_epochs`` is ``trainer.total_epochs`` (the passes over the prompts);
- ``async_training.checkpoint_engine.device_buffer_size_M`` is the weight stream's bucket size
  (``actor_rollout_ref.rollout.update_weights_bucket_megabytes``);
- accepted without effect: the checkpoint engine's switches (megarl streams buckets over its
  weight group), ``use_trainer_do_validate`` (validation runs on the rollout workers for the
  whole world: where it runs changes no metric), ``rollout.n`` (verl's recipes read
  ``actor_rollout_ref.rollout.n``) and the config's ``actor_rollout_ref.checkpoint_engine``
  interpolation.
"""

from __future__ import annotations

from typing import Any

from megarl.config.aliases import get_path, set_path
from megarl.config.provenance import Sources

# the recipes' keys that verl's trainer configs lack, with the recipes' defaults
# (verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml)
RECIPE_KEYS: dict[str, Any] = {
    "async_training.compute_prox_log_prob": False,
    "async_training.use_trainer_do_validate": False,
    "async_training.checkpoint_engine.enable": True,
    "async_training.checkpoint_engine.device_buffer_size_M": 4096,
    "async_training.checkpoint_engine.overlap_broadcast_and_consume": False,
    "rollout.n": 4,
    "rollout.total_epochs": 10,
    "rollout.test_freq": 1,
    "actor_rollout_ref.checkpoint_engine": None,
    "actor_rollout_ref.actor.use_rollout_log_probs": True,
}

_ENGINE = "async_training.checkpoint_engine"
RULES: list[tuple[str, str, str]] = [
    ("async_training.compute_prox_log_prob", "converted",
     "true: async_training.use_rollout_log_probs=false (the ratio against the trainer's "
     "recomputation with the weights before each update, AReaL's decoupled PPO; verl's "
     "proximal weights are the sync window's first, the same at trigger_parameter_sync_step=1)"),
    ("async_training.use_trainer_do_validate", "inert", "validation runs on the rollout "
     "workers for the whole world; where it runs changes no metric"),
    (f"{_ENGINE}.device_buffer_size_M", "mapped",
     "actor_rollout_ref.rollout.update_weights_bucket_megabytes"),
    (f"{_ENGINE}.*", "inert", "megarl streams the weights in buckets over its own weight group "
     "(rollout/weight_stream.py)"),
    ("rollout.n", "inert", "verl's recipes read actor_rollout_ref.rollout.n"),
    ("rollout.total_epochs", "mapped", "trainer.total_epochs"),
    ("rollout.test_freq", "converted", "trainer.test_freq = rollout.test_freq x "
     "async_training.trigger_parameter_sync_step (validation every that many weight syncs, "
     "as verl's rollouter; <= 0: none)"),
    ("actor_rollout_ref.checkpoint_engine", "inert", "the recipes' interpolation of "
     f"{_ENGINE}"),
    ("actor_rollout_ref.checkpoint_engine.*", "inert", "the recipes' interpolation of "
     f"{_ENGINE}"),
    ("actor_rollout_ref.actor.use_rollout_log_probs", "mapped",
     "async_training.use_rollout_log_probs"),
]


def convert(values: dict[str, tuple[Any, str]], tree: dict, raw: dict,
            sources: Sources) -> list[str]:
    """Read the ``converted`` recipe keys among ``values`` (verl-only keys: {dotted: (value,
    source)}; the ones handled are removed) into ``tree`` (the resolved config) and ``raw``
    (the user's layers merged); returns the problems, one line each."""
    problems: list[str] = []
    key = "async_training.compute_prox_log_prob"
    if key in values:
        value, source = values.pop(key)
        if not isinstance(value, bool):
            problems.append(f"{key}={value!r} (from {source}): expected true or false")
        elif value:
            target = "async_training.use_rollout_log_probs"
            set_path(tree, target, False)
            set_path(raw, target, False)
            sources.source[target] = f"{key}=true (from {source})"
    key = "rollout.test_freq"
    if key in values:
        value, source = values.pop(key)
        sync = get_path(tree, "async_training.trigger_parameter_sync_step")
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}={value!r} (from {source}): expected a whole number of "
                            "weight syncs")
        elif isinstance(sync, int) and not isinstance(sync, bool):
            freq = value * sync if value > 0 else -1
            set_path(tree, "trainer.test_freq", freq)
            set_path(raw, "trainer.test_freq", freq)
            sources.source["trainer.test_freq"] = (
                f"{key}={value} x async_training.trigger_parameter_sync_step={sync} "
                f"(from {source})")
    return problems
