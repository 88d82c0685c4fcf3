"""LoRA adapters handed to a vLLM engine as they are, not merged into the base weights.

With ``actor_rollout_ref.model.lora_rank > 0`` a vLLM engine keeps the base model it was
started from and receives only the adapter tensors at each weight sync (A [r, in] and B [out,
r] of every adapted linear: about ``2 r / hidden`` of the adapted weights' bytes), instead of
every merged weight ``W + (alpha / r) B A``, as verl does:

- the engine is started with ``enable_lora=True``, ``max_lora_rank`` = the smallest rank vLLM
  accepts that is >= the run's (`lora_engine_kwargs`), one adapter slot, and sleeps at level 1
  (the base weights kept on the host while the trainer trains, not dropped);
- each sync builds vLLM's ``LoRAModel`` from the full tensors in every worker
  (`install_adapter`: ``LoRAModel.from_lora_tensors``, PEFT's names and scaling; with tensor
  parallelism each worker's LoRA layers take their own slice, as for an adapter read from a
  folder) under a new adapter id (one per weight version) and drops the previous one; every
  request then runs with that adapter (``LoRARequest`` of the new id), so the prefix cache of
  an older version is never reused;
- vLLM 0.32 has no public call that adds an adapter from tensors (a ``LoRARequest`` names a
  folder), so `install_adapter` uses the worker's adapter manager
  (``model_runner.lora_manager._adapter_manager``) of the releases in
  `megarl.rollout.vllm.launch.SUPPORTED_VLLM`.

Two wrappers split the work: `AdapterSyncedEngine` is the engine's side (its
``update_weights`` takes an adapter stream), built by `megarl.rollout.build.engine_from_spec`
from a spec whose settings carry ``lora``, in the trainer's process or in an asynchronous
engine process; `AdapterSource` is the trainer's side (its ``update_weights`` drops the
actor's merged stream and sends ``actor.export_adapter()`` instead), around that engine or
around the `megarl.rollout.process.ProcessRolloutEngine` whose ring then carries the adapters.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megarl.models.lora import PEFT_PREFIX, LoraSettings, peft_adapter_config
from megarl.rollout.reshard import as_named

log = logging.getLogger(__name__)

# vLLM 0.32's LoRAConfig.max_lora_rank choices (vllm/config/lora.py, MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
IN_MEMORY_PATH = "megarl://in-memory-adapter"  # LoRARequest needs a path; never read


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments for an engine that runs one rank-``rank`` adapter. ``rank`` must
    be <= 512 (vLLM's largest; see `adapter_sync_refusal`)."""
    fit = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if not fit:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank "
                         f"{VLLM_MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fit[0], "max_loras": 1, "max_cpu_loras": 1}


def adapter_sync_refusal(rank: int, *, engine: str) -> str | None:
    """Why a run syncs merged weights instead of adapters (None: adapters are sent).

    engine: actor_rollout_ref.rollout.name."""
    if rank <= 0:
        return "LoRA is off"
    if engine != "vllm":
        return f"the {engine} engine takes merged weights"
    if rank > VLLM_MAX_LORA_RANKS[-1]:
        return f"lora_rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}"
    return None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def supported_modules(worker: Any) -> list[str]:
    """Runs in each vLLM worker: the module names (last component, HF spelling: q_proj,
    gate_proj, ...) an adapter may target in this model."""
    inner = worker.model_runner.lora_manager._adapter_manager
    names: set[str] = set()
    for module in inner.supported_lora_modules:
        names.update(inner.packed_modules_mapping.get(module, [module]))
    return sorted(names)


def install_adapter(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor],
                    peft_config: dict[str, Any]) -> int:
    """Runs in each vLLM worker: replace the loaded adapters by ``tensors`` (PEFT file keys
    ``base_model.model.<module>.lora_{A,B}.weight``) with PEFT settings ``peft_config``, under
    id ``lora_id``. Returns how many modules it adapts."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    inner = manager._adapter_manager
    helper = PEFTHelper.from_dict({**peft_config,
                                   "vllm_max_position_embeddings":
                                       manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = inner.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager.remove_all_adapters()
    inner.add_adapter(lora)
    return len(lora.loras)


class AdapterSyncedEngine:
    """A vLLM engine (started with `lora_engine_kwargs`) whose weight syncs are LoRA adapters.

    ``update_weights(stream)``: the stream is the adapter ((``<module>.lora_{A,B}.weight``,
    full tensor) pairs, as ``actor.export_adapter`` or a weight-ring slot gives them), handed
    to every worker as a new adapter version (`load_adapter`); the first one is checked
    against the modules vLLM adapts. Everything else is the wrapped engine's.
    ``last_sync_bytes``: the bytes the last sync handed the engine."""

    def __init__(self, engine: Any, settings: LoraSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._ids = itertools.count(1)
        self.lora_request: Any = None
        self.last_sync_bytes = 0
        self._checked = False

    def check_targets(self, targets: Iterable[str]) -> None:
        """Raise ValueError naming the adapted modules this vLLM model cannot adapt."""
        ok = set(self.engine.llm.collective_rpc(supported_modules)[0])
        bad = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in ok})
        if bad:
            raise ValueError(f"vLLM cannot run adapters on {bad[:4]} (it adapts {sorted(ok)})")
        self._checked = True

    def update_weights(self, weights: Iterable[Any]) -> None:
        self.load_adapter(as_named(weights))

    def load_adapter(self, adapter: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand the engine ``adapter`` ((``<module>.lora_{A,B}.weight``, full tensor) pairs)
        as a new adapter version; the next `generate` runs with it."""
        from vllm.lora.request import LoRARequest

        # copies: vLLM folds the scaling into its B tensors in place (LoRAModel.optimize)
        tensors = {PEFT_PREFIX + name: t.detach().clone() for name, t in adapter}
        targets = sorted({n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in tensors})
        if not self._checked:
            self.check_targets(targets)
        config = peft_adapter_config(self.settings, targets)
        lora_id = next(self._ids)
        wake_weights = getattr(self.engine, "wake_weights", None)
        if wake_weights is not None:  # the adapter slots live with the (sleeping) weights
            wake_weights()
        self.engine.llm.collective_rpc(install_adapter, args=(lora_id, tensors, config))
        self.engine.llm.reset_prefix_cache()
        self.lora_request = LoRARequest(f"megarl-adapter-{lora_id}", lora_id, IN_MEMORY_PATH)
        self.engine.lora_request = self.lora_request
        self.last_sync_bytes = tensor_bytes(tensors.values())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class AdapterSource:
    """The trainer's side of adapter sync, around an `AdapterSyncedEngine` or an engine
    process built with one: ``update_weights(stream)`` closes the actor's merged export
    (``actor.export_weights()``, a lazy generator, never started, so nothing was gathered) and
    sends ``adapter_source()`` (``actor.export_adapter``: collective over the actor's ranks
    like the merged stream) instead. Everything else is the wrapped engine's."""

    def __init__(self, engine: Any,
                 adapter_source: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        self.engine = engine
        self.adapter_source = adapter_source

    def update_weights(self, weights: Iterable[Any], **labels: Any) -> None:
        """``labels``: what the wrapped engine's publish takes beside the stream (an engine
        process's ``version``)."""
        close = getattr(weights, "close", None)
        if close is not None:
            close()
        self.engine.update_weights(self.adapter_source(), **labels)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
