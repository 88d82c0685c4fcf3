"""Run megatron-core 0.16.1 on CPU / gloo: the patches it needs, and nothing else.

megatron-core assumes CUDA in a few hundred places. Every patch below was needed to make a real
code path work on a CPU-only torch (measured in the team notes, ``../shared/notes/mcore_cpu.md``); none of
them changes numerics. They are applied only when ``torch.cuda.is_available()`` is False:
on a GPU host `apply()` does nothing and the two context managers are null contexts.

Process-wide patches, installed once by `apply()` (idempotent):

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")``: ~175 megatron call sites use
   it as the device of new tensors (RoPE ``inv_freq``, DDP buffers, ...).
2. ``torch.cuda.synchronize`` is a no-op: called by the 1F1B p2p path (``batch_p2p_sync``) and
   by dist_checkpointing's writer (``preload_tensors``).
3. ``torch.cuda.current_stream`` returns a null stream (megatron >= 0.19 calls it in
   ``param_and_grad_buffer.start_grad_sync``; harmless on 0.16).
4. ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` build their mask on the CPU
   (they hard-code ``device="cuda"``; they also run inside activation recompute, i.e. during
   autograd backward, where a TorchFunctionMode does not reach).
5. A CPU RNG-states tracker (same API as megatron's ``CudaRNGStatesTracker``, on top of
   ``torch.get/set_rng_state``) replaces the CUDA one: ``get_cuda_rng_tracker().fork()`` runs
   in every attention forward and in every tensor-parallel weight init.
6. ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` become
   empty / no-op: activation recompute saves and restores the CUDA RNG state (the CPU state is
   saved separately by megatron, and the tracker states by patch 5).
7. ``CheckpointWithoutOutput.__init__`` sets ``self.fp8 = bool(fp8)``: megatron writes
   ``fp8 is not None`` there, so the default ``fp8=False`` turns fp8 on and layernorm/MLP
   recompute then fails with ``NameError: FP8GlobalStateManager`` when TransformerEngine is
   absent.

Scoped patches (context managers the backend enters around its calls into megatron):

8. `cuda_to_cpu()`: a ``TorchFunctionMode`` that turns ``device="cuda"`` in tensor factories,
   ``Tensor.cuda()`` and ``Tensor.to("cuda")`` into the CPU (schedules, optimizer and grad-norm
   code create scalars with ``device="cuda"``), and drops ``pin_memory=True`` (RoPE's
   context-parallel slicing, ``get_pos_emb_on_this_cp_rank``, pins its index tensor).
9. `cuda_type_strings()`: inside it, the no-argument ``Tensor.type()`` of a CPU float tensor
   reports ``torch.cuda.<T>Tensor``: megatron's optimizers accept parameters only after checking
   that string (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``,
   ``clip_grad_by_total_norm_fp32``). Scoped to optimizer construction, step and load.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_TYPE_STRINGS = threading.local()


def needed() -> bool:
    """True when CUDA is not available, i.e. when megatron needs these patches."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Install the process-wide patches 1-7 (idempotent; a no-op when CUDA is available)."""
    global _APPLIED
    if _APPLIED or not needed():
        return
    _patch_torch_cuda()
    _patch_masks()
    _install_cpu_rng_tracker()
    _patch_recompute()
    _patch_tensor_type()
    _APPLIED = True


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Patch 8: map ``cuda`` devices to the CPU for torch functions called inside (CPU only)."""
    if not needed():
        yield
        return
    with _CudaToCpuMode():
        yield


@contextlib.contextmanager
def cuda_type_strings() -> Iterator[None]:
    """Patch 9: ``Tensor.type()`` reports ``torch.cuda.*`` for CPU float tensors (CPU only)."""
    if not needed():
        yield
        return
    previous = getattr(_TYPE_STRINGS, "on", False)
    _TYPE_STRINGS.on = True
    try:
        yield
    finally:
        _TYPE_STRINGS.on = previous


# --------------------------------------------------------------------------------------------


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self, event: object = None) -> None:
        return None


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()


def _patch_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def causal(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def sliding(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        upper = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    for module in (utils, fused_softmax):
        module.get_default_causal_mask = causal
        module.get_sliding_window_causal_mask = sliding


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named RNG states kept as CPU generator states; ``fork`` swaps the CPU state."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_recompute() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None

    original_init = mrandom.CheckpointWithoutOutput.__init__

    @functools.wraps(original_init)
    def init(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = bool(fp8)

    mrandom.CheckpointWithoutOutput.__init__ = init


def _patch_tensor_type() -> None:
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def tensor_type(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        if args or kwargs or not getattr(_TYPE_STRINGS, "on", False):
            return name
        if isinstance(name, str) and name.startswith("torch.") and not name.startswith(
            "torch.cuda."
        ):
            return "torch.cuda." + name[len("torch.") :]
        return name

    torch.Tensor.type = tensor_type
