"""`VLLMEngine`: vLLM's offline ``LLM`` colocated with the trainer, behind RolloutEngine.

- built from the actor's HF folder with ``enable_sleep_mode=True`` and
  ``logprobs_mode="processed_logprobs"`` (logprobs after temperature / top-k / top-p, the
  distribution actually sampled from: the RolloutEngine contract; vLLM's default would be the
  raw model distribution);
- ``sleep()`` = ``llm.sleep(level=1)`` (weights offloaded to CPU, KV cache dropped), ``wake()``
  = ``llm.wake_up()``; an `update_weights` while asleep first wakes the weights only
  (``wake_up(tags=["weights"])``) and `wake` then restores the KV cache;
- `update_weights` streams buckets (`megarl.rollout.reshard`) into every worker through
  ``llm.collective_rpc("megarl_load_weights", args=(bucket,))`` (a method of
  `megarl.rollout.vllm.worker.MegarlWorkerExtension`, which calls the model's own
  ``load_weights``), then ``megarl_finish_weights`` and ``llm.reset_prefix_cache()``;
- each prompt gets its own seed derived from SamplingParams.seed (vLLM seeds per request).

Logprobs are parsed from vLLM's per-position ``{token_id: Logprob}`` dicts (``logprobs=0``:
the sampled token only; ``flat_logprobs`` must stay off).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from megarl.rollout._adapter import (
    DTYPE_NAMES,
    as_buckets,
    check_finish,
    derived_seed,
    missing_engine,
)
from megarl.rollout.protocol import Completion, SamplingParams

WORKER_EXTENSION = "megarl.rollout.vllm.worker.MegarlWorkerExtension"


def to_vllm_kwargs(sampling: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt (``n`` samples of it)."""
    greedy = sampling.is_greedy
    return {
        "n": sampling.n,
        "temperature": 0.0 if greedy else float(sampling.temperature),
        "top_k": -1 if greedy or sampling.top_k <= 0 else int(sampling.top_k),
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
                lps = torch.tensor([_logprob(step, t) for step, t in zip(c.logprobs, ids)],
                                   dtype=torch.float32)
            result.append(Completion(i, ids, lps, check_finish(c.finish_reason, "vLLM")))
    return result


def _logprob(step: Any, token: int) -> float:
    entry = step[token]
    return float(getattr(entry, "logprob", entry))


class VLLMEngine:
    """RolloutEngine on vLLM (GPU). ``llm`` / ``sampling_params_cls`` may be given instead of
    building them (tests use recording fakes; an integrator may pass its own ``vllm.LLM``).

    model_path: the actor's HF folder. bucket_bytes: weight-update bucket size.
    engine_kwargs: more ``vllm.LLM`` arguments (dtype, tensor_parallel_size,
    gpu_memory_utilization, max_num_seqs, max_model_len, seed, ...).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        tokenizer: str | None = None,
        bucket_bytes: int = 512 * 2**20,
        llm: Any = None,
        sampling_params_cls: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        if llm is None or sampling_params_cls is None:
            try:
                import vllm
            except ImportError as e:
                raise missing_engine("vllm", "vllm") from e
            sampling_params_cls = sampling_params_cls or vllm.SamplingParams
            if llm is None:
                if model_path is None:
                    raise ValueError("VLLMEngine needs model_path (the actor's HF folder)")
                kwargs = {
                    "enable_sleep_mode": True,
                    "logprobs_mode": "processed_logprobs",
                    "worker_extension_cls": WORKER_EXTENSION,
                    **engine_kwargs,
                }
                llm = vllm.LLM(model=str(model_path), tokenizer=tokenizer or str(model_path),
                               **kwargs)
        self.llm = llm
        self.sampling_params_cls = sampling_params_cls
        self.bucket_bytes = int(bucket_bytes)
        self.tokenizer = None
        self._asleep = False
        self._weights_awake = False

    @classmethod
    def from_config(cls, cfg: Any, model_path: str, **overrides: Any) -> VLLMEngine:
        """Reads actor_rollout_ref.model.{dtype, tokenizer_path}, actor_rollout_ref.rollout.
        {tensor_model_parallel_size, gpu_memory_utilization, max_num_seqs, seed,
        update_weights_bucket_megabytes}, data.{max_prompt_length, max_response_length},
        trainer.seed. Under torchrun each rank hosts its own engine in-process (vLLM's
        ``external_launcher`` executor), so weight buckets pass by reference."""
        import importlib.util

        import torch.distributed as dist

        from megarl.rollout.reshard import bucket_bytes_from_config

        if importlib.util.find_spec("vllm") is None:
            raise missing_engine("vllm", "vllm")

        arr, ro = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
        seed = ro.seed if ro.seed is not None else cfg.trainer.seed
        kwargs: dict[str, Any] = {
            "dtype": DTYPE_NAMES[arr.model.dtype],
            "tensor_parallel_size": ro.tensor_model_parallel_size,
            "gpu_memory_utilization": ro.gpu_memory_utilization,
            "max_num_seqs": ro.max_num_seqs,
            "max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "seed": seed,
            "trust_remote_code": arr.model.trust_remote_code,
        }
        if dist.is_available() and dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs.update(overrides)
        return cls(model_path, tokenizer=arr.model.tokenizer_path,
                   bucket_bytes=bucket_bytes_from_config(cfg), **kwargs)

    # ------------------------------------------------------------------------- protocol

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        if self._asleep:
            self.wake()
        params = [
            self.sampling_params_cls(
                **to_vllm_kwargs(sampling, None if sampling.seed is None
                                 else derived_seed(sampling.seed, i))
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        return parse_vllm_outputs(outputs, sampling.logprobs)

    def update_weights(self, weights: Iterable[Any]) -> None:
        """Stream buckets (or a flat (name, tensor) stream, bucketed here) into the workers."""
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        for bucket in as_buckets(weights, self.bucket_bytes):
            self.llm.collective_rpc("megarl_load_weights", args=(bucket,))
            del bucket
        self.llm.collective_rpc("megarl_finish_weights")
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep, self._weights_awake = True, False

    def wake(self) -> None:
        if self._asleep:
            if self._weights_awake:
                self.llm.wake_up(tags=["kv_cache"])
            else:
                self.llm.wake_up()
            self._asleep, self._weights_awake = False, False
