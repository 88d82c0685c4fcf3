"""`TorchRolloutEngine`: batched generation with megarl's own `Transformer` in plain PyTorch.

Continuous batching (`megarl.rollout.torch.scheduler`) over a preallocated slot KV cache
(`SlotKVCache`): up to ``max_num_seqs`` sequences decode together; a finished sequence frees its
slot at once and the next waiting (prompt, sample) is prefilled into it. The n samples of a
prompt admitted together share one prefill. Sampling noise is a function of (seed, prompt key,
sample index, token position) only (the key is the prompt's index unless ``prompt_keys`` are
given; `megarl.rollout.sampling`), so outputs do not depend on ``max_num_seqs`` or on the order
sequences happen to be scheduled in: continuous batching equals one-by-one generation, for
greedy and seeded sampling alike (up to float reassociation in batched matmuls).

The engine can wrap the training model object itself (no weight copy; `update_weights` then
sees the same storages and skips them) or own a model loaded from an HF folder.

With ``return_routed_experts`` (MoE policies; vLLM's engine argument of the same idea is
``enable_return_routed_experts``) each `Completion` carries the experts every prompt and
response token was routed to in every sparse layer (`megarl.models.moe.record_experts`), for
routing replay in the trainer: ``[len(prompt) + len(token_ids), n_sparse, k]`` int16, the last
response token's row -1 (the engine never runs it: it only predicts the token after it).

Host and device: sampled tokens, logprobs and recorded experts stay on the device until the
generate call ends (one copy to the host then); the host keeps the schedule (positions, token
counts, the uniforms of the sampling noise), which it knows without reading the device, and
sends it with copies that do not wait for the queued kernels. The one read of the device per
step is whether a sequence sampled a stop token (or, with stop strings, the tokens
themselves): it decides which sequences leave the batch before the next step. Deciding later
would change which sequences share a batch, hence the rounding of the batched kernels; read
every step, the schedule and the outputs are bit for bit those of a loop that reads every
token. Steps where no stop is possible (``ignore_eos``, no stop ids or strings) read nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.models import Transformer, load_model, read_hf_config
from megarl.models.moe import routing_dtype, sparse_layers
from megarl.rollout.protocol import Completion, SamplingParams, resolve_prompt_keys
from megarl.rollout.reshard import as_named
from megarl.rollout.sampling import check_sampling_params
from megarl.rollout.settings import RolloutSettings
from megarl.rollout.torch.kv_cache import SlotKVCache
from megarl.rollout.torch.scheduler import Run, Seq
from megarl.rollout.torch.session import GenerationSession
from megarl.rollout.torch.stopping import StopStrings
from megarl.rollout.torch.weights import load_weight_stream
from megarl.utils.dtypes import canonical_dtype, torch_dtype

logger = logging.getLogger(__name__)


class TorchRolloutEngine:
    """RolloutEngine on a megarl `Transformer` (LM head, whole model in this process).

    model:           the Transformer to generate with (shared, not copied).
    tokenizer:       optional HF tokenizer; needed only for stop strings.
    max_num_seqs:    KV-cache slots = sequences decoded at once.
    max_model_len:   prompt + response tokens per sequence at most (cache length); default the
                     model's max_position_embeddings. Responses are cut ("length") to fit.
    eos_token_ids:   ids that end a sequence unless SamplingParams.ignore_eos; default the
                     config's eos_token_id.
    prefill_token_budget: padded prompt tokens per prefill forward at most (memory bound).
    kv_cache_bytes:  cap on the KV cache; fewer slots than max_num_seqs are used when
                     max_num_seqs x (prompt + response) would not fit (None: no cap).
    offload_weights_on_sleep: move weights to CPU in sleep() (default: only for an engine that
                     owns its model on a GPU; never for a shared training model).
    return_routed_experts: record each token's experts per sparse layer into
                     ``Completion.routed_experts`` (MoE models only; see module docstring).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        tokenizer: Any = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        prefill_token_budget: int = 16384,
        kv_cache_bytes: int | None = None,
        offload_weights_on_sleep: bool | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        if not isinstance(model, Transformer):
            raise TypeError(f"TorchRolloutEngine needs a megarl Transformer, got {type(model)}")
        if model.lm_head is None or model.model.embed_tokens is None or model.model.norm is None:
            raise ValueError(
                "TorchRolloutEngine needs a whole LM model (head='lm', embeddings and final norm "
                "present), not a token-classification model or a pipeline stage"
            )
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError(
                "TorchRolloutEngine needs a plain, unsharded model; this one has DTensor "
                "(FSDP / tensor-parallel) parameters. Build the engine with from_pretrained / "
                "from_config and feed it backend.export_weights() through update_weights"
            )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if return_routed_experts and not model.args.is_moe:
            raise UserInputError(
                "return_routed_experts needs a mixture-of-experts model; this one is dense "
                "(routing replay applies to MoE policies only: set "
                "actor_rollout_ref.actor.router_replay.mode=disabled)"
            )
        self.return_routed_experts = bool(return_routed_experts)
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len or model.args.max_position_embeddings)
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(model.args.hf_config.get("eos_token_id"))
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.prefill_token_budget = int(prefill_token_budget)
        self.kv_cache_bytes = None if kv_cache_bytes is None else int(kv_cache_bytes)
        weight = model.output_weight()
        self.device, self.dtype = weight.device, weight.dtype
        if offload_weights_on_sleep is None:
            offload_weights_on_sleep = False
        self.offload_weights_on_sleep = bool(offload_weights_on_sleep)
        self._cache: SlotKVCache | None = None
        self._asleep = False
        self._offloaded = False
        self._woken: torch.cuda.Event | None = None  # wake()'s host -> GPU copies, queued

    # ------------------------------------------------------------------------- construction

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tokenizer: Any = "auto",
        **kwargs: Any,
    ) -> TorchRolloutEngine:
        """Load an HF folder (config.json + safetensors) into an engine that owns its model.

        tokenizer: "auto" loads the folder's tokenizer when it has one, a path loads that
        folder's, None means none, anything else is used as the tokenizer object. EOS ids come
        from config.json and generation_config.json (their union).
        """
        path = Path(path)
        hf_config = read_hf_config(path, kwargs.pop("hf_overrides", None))
        model = load_model(path, head="lm", dtype=dtype, device=device,
                           hf_config=hf_config).eval()
        if "eos_token_ids" not in kwargs:
            kwargs["eos_token_ids"] = _eos_ids(path)
        if tokenizer == "auto":
            has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            tokenizer = _load_tokenizer(str(path)) if has_tok else None
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _load_tokenizer(str(tokenizer))
        kwargs.setdefault("offload_weights_on_sleep", torch.device(device).type == "cuda")
        return cls(model, tokenizer=tokenizer, **kwargs)

    @staticmethod
    def engine_settings(rollout: RolloutSettings, model_path: str,
                        device: torch.device | str | None = None) -> dict[str, Any]:
        """The engine of a run as plain data: `from_pretrained`'s arguments (``path``, the dtype
        by name, ``device`` as a string) from ``rollout``'s dtype, tokenizer_path,
        max_num_seqs, max_model_len, override_config, routed_experts and
        gpu_memory_utilization: the KV cache gets at most that share of the device's free
        memory (CUDA: total minus allocated; CPU: MemAvailable) now."""
        from megarl.data.locations import resolve_path

        dtype_name = canonical_dtype(rollout.dtype, "actor_rollout_ref.model.dtype")
        device = torch.device(device if device is not None else "cpu")
        return {
            "path": resolve_path(model_path),
            "dtype": dtype_name,
            "device": str(device),
            "tokenizer": rollout.tokenizer_path or model_path,
            "max_num_seqs": rollout.max_num_seqs,
            "max_model_len": rollout.max_model_len,
            "kv_cache_bytes": _cache_budget(device, rollout.gpu_memory_utilization),
            "return_routed_experts": rollout.routed_experts,
            "hf_overrides": dict(rollout.override_config),
        }

    @classmethod
    def spec_settings(cls, rollout: RolloutSettings, model_path: str, device: torch.device | str,
                      *, own_process: bool = False) -> dict[str, Any]:
        """`engine_settings` for an `megarl.rollout.build.EngineSpec`; in an engine process of
        its own the weights stay where they are on sleep (no trainer memory to give back)."""
        settings = cls.engine_settings(rollout, model_path, device)
        if own_process:
            settings["offload_weights_on_sleep"] = False
        return settings

    @staticmethod
    def settings_dtype(settings: dict[str, Any]) -> str:
        """The dtype name the engine of ``settings`` holds its weights in."""
        return settings["dtype"]

    @staticmethod
    def settings_on_device(settings: dict[str, Any], device: str) -> dict[str, Any]:
        """``settings`` for a process that numbers the engine's device ``device``."""
        return {**settings, "device": device}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> TorchRolloutEngine:
        """The engine of `settings` (another process's included: the dict is picklable)."""
        kwargs = dict(settings)
        return cls.from_pretrained(kwargs.pop("path"), dtype=torch_dtype(kwargs.pop("dtype")),
                                   **kwargs)

    @classmethod
    def from_rollout_settings(cls, rollout: RolloutSettings, model_path: str,
                              device: torch.device | str | None = None) -> TorchRolloutEngine:
        """The engine of a run in this process (`engine_settings`)."""
        return cls.from_settings(cls.engine_settings(rollout, model_path, device))

    # ------------------------------------------------------------------------- protocol

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        """``sampling.n`` completions per prompt, prompt-major (see RolloutEngine)."""
        vocab = self.model.args.vocab_size
        check_sampling_params(sampling, vocab)
        seqs = self._make_seqs(prompts, sampling, prompt_keys)
        if not seqs:
            return []
        if self._asleep:
            self.wake()
        self._await_wake()
        seed = sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= set(self.eos_token_ids)
        run = Run(self, sampling, frozenset(stop_ids),
                  StopStrings(self.tokenizer, list(sampling.stop)),
                  max_len=max(len(s.prompt) + s.max_new for s in seqs), max_seqs=len(seqs))
        run.add(seqs, seed)
        with torch.inference_mode():
            run.loop()
            run.collect()
        return [self.completion(s, sampling) for s in seqs]

    def open_session(self, sampling: SamplingParams, max_len: int,
                     version: int | None = None) -> GenerationSession:
        """Continuous generation: requests submitted at any step join the running batch
        (`megarl.rollout.torch.session`). ``max_len``: prompt + response tokens any request
        may reach; ``version``: the weights' version, tracked per token from here on."""
        return GenerationSession(self, sampling, max_len, version)

    def completion(self, s: Seq, sampling: SamplingParams) -> Completion:
        """The `Completion` of a finished sequence whose tokens were collected."""
        return Completion(
            prompt_index=s.req,
            token_ids=s.tokens,
            logprobs=(torch.tensor(s.logprobs, dtype=torch.float32)
                      if sampling.logprobs else None),
            finish_reason=s.finish or "length",
            routed_experts=self._routing_of(s) if self.return_routed_experts else None,
            token_versions=s.token_versions(),
        )

    def _routing_of(self, s: Seq) -> torch.Tensor:
        """[len(prompt) + len(tokens), n_sparse, k] int16: the recorded rows, then -1 for the
        last token (never run)."""
        a = self.model.args
        pad = torch.full((1, len(sparse_layers(a)), a.num_experts_per_tok), -1,
                         dtype=routing_dtype(a.num_experts))
        out = torch.cat([torch.cat(s.routing).cpu(), pad])
        if out.shape[0] != len(s.prompt) + len(s.tokens):  # a scheduling bug, not user input
            raise RuntimeError(f"recorded routing of {out.shape[0]} tokens for a sequence of "
                               f"{len(s.prompt) + len(s.tokens)}")
        return out

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
    ) -> None:
        """Copy (HF name, full tensor) pairs into the model in place (see load_weight_stream).
        Accepts a flat stream or the buckets of `megarl.rollout.reshard` (lists of pairs)."""
        self._await_wake()
        load_weight_stream(self.model, as_named(weights), strict=strict)

    def sleep(self) -> None:
        """Free the KV cache; with offload_weights_on_sleep also move the weights to CPU.

        On CUDA the weights go to pinned memory with copies queued on the current stream;
        the device is synchronised before anything reads them and before the freed GPU
        memory goes back to the driver (a GPU block freed earlier is reused only by work
        queued after the copies on that stream)."""
        self._await_wake()
        self._cache = None
        if self.offload_weights_on_sleep and not self._offloaded:
            pin = self.device.type == "cuda"
            for p in _unique_tensors(self.model):
                cpu = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                cpu.copy_(p.data, non_blocking=pin)
                p.data = cpu
            if pin:
                torch.cuda.synchronize(self.device)
            self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._woken = None
        self._asleep = True

    def wake(self) -> None:
        """Undo sleep(): weights back on the device (the cache comes back at the next
        generate). On CUDA the copies from pinned memory are queued on the current stream,
        without waiting; their pinned sources are freed at once (torch's pinned-memory cache
        keeps a block until the copy that reads it has run), and the engine's next use waits
        for them on whatever stream it runs (`_await_wake`)."""
        if self._offloaded:
            for p in _unique_tensors(self.model):
                p.data = p.data.to(self.device, non_blocking=True)
            self._offloaded = False
            if self.device.type == "cuda":
                self._woken = torch.cuda.Event()
                self._woken.record(torch.cuda.current_stream(self.device))
        self._asleep = False

    def _await_wake(self) -> None:
        """Order the current stream after wake()'s copies (queued on the stream current at
        wake, which need not be the one this call computes on); no host wait."""
        if self._woken is not None:
            torch.cuda.current_stream(self.device).wait_event(self._woken)

    @property
    def asleep(self) -> bool:
        """Between sleep() and the next wake() or generate()."""
        return self._asleep

    def close(self) -> None:
        """Free the KV cache now (the model is the caller's: it is not freed)."""
        self._cache = None

    # ------------------------------------------------------------------------- internals

    def _make_seqs(
        self, prompts: list[list[int]], sampling: SamplingParams,
        prompt_keys: Sequence[int] | None,
    ) -> list[Seq]:
        vocab = self.model.args.vocab_size
        keys = resolve_prompt_keys(prompt_keys, len(prompts))
        seqs = []
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                    f"(raise data.max_prompt_length/max_response_length or shorten the prompt)"
                )
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            max_new = min(sampling.max_new_tokens, self.max_model_len - len(prompt))
            seqs.extend(Seq(i, s, prompt, max_new, keys[i]) for s in range(sampling.n))
        return seqs

    def _get_cache(self, slots: int, max_len: int) -> SlotKVCache:
        a = self.model.args
        layers = len(self.model.model.layers)
        cache = self._cache
        if cache is None or not cache.fits(layers, slots, max_len, self.dtype, self.device):
            self._cache = None  # free before allocating the new one
            self._cache = SlotKVCache(
                layers, slots, a.num_key_value_heads, max_len, a.head_dim, self.dtype, self.device
            )
        return self._cache

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


# ----------------------------------------------------------------------------- helpers


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _eos_ids(path: Path) -> list[int]:
    ids = _as_id_list(read_hf_config(path).get("eos_token_id"))
    gen = path / "generation_config.json"
    if gen.is_file():
        import json

        with open(gen, encoding="utf-8") as f:
            ids += _as_id_list(json.load(f).get("eos_token_id"))
    return sorted(set(ids))


def _load_tokenizer(path: str) -> Any:
    from megarl.data.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _cache_budget(device: torch.device, fraction: float) -> int:
    """fraction x the memory free on ``device`` now, in bytes."""
    from megarl.rollout.memory import device_memory

    free, _ = device_memory(device)
    return int(fraction * free)


def _unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
