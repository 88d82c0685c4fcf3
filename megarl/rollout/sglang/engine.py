"""`SGLangEngine`: SGLang's offline ``Engine`` colocated with the trainer, behind RolloutEngine.

- built from the actor's HF folder with ``enable_memory_saver=True``; ``sleep()`` =
  ``release_memory_occupation()``, ``wake()`` = ``resume_memory_occupation()``; an
  `update_weights` while asleep first resumes the weights only (``tags=["weights"]``) and `wake`
  then resumes the KV cache (``tags=["kv_cache"]``);
- `update_weights` streams buckets (`megarl.rollout.reshard`) through
  ``update_weights_from_tensor(named_tensors=bucket, flush_cache=False)``, then one
  ``flush_cache()``;
- the n samples of a prompt are sent as n requests (prompt-major), each with its own
  ``sampling_seed`` derived from SamplingParams.seed (SGLang's per-request seed);
- ``return_logprob=True``; logprobs are read from ``meta_info["output_token_logprobs"]``
  ((logprob, token id, text) per generated token).

Logprob semantics: SGLang reports log softmax(logits / T) of the sampled token, i.e. BEFORE the
top-k / top-p renormalisation (it matches the torch and vLLM engines only when top_k = -1 and
top_p = 1, the RL default). With ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set it would even drop the
temperature: leave it unset.
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)


def to_sglang_params(sampling: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """SGLang ``sampling_params`` dict of ONE request (one sample)."""
    greedy = sampling.is_greedy
    params: dict[str, Any] = {
        "temperature": 0.0 if greedy else float(sampling.temperature),
        "top_k": -1 if greedy or sampling.top_k <= 0 else int(sampling.top_k),
        "top_p": 1.0 if greedy else float(sampling.top_p),
        "max_new_tokens": int(sampling.max_new_tokens),
        "ignore_eos": bool(sampling.ignore_eos),
        "skip_special_tokens": False,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def parse_sglang_outputs(
    outputs: list[dict[str, Any]], n: int, want_logprobs: bool
) -> list[Completion]:
    """Output dicts of the n x len(prompts) requests (prompt-major) -> Completions."""
    result = []
    for k, out in enumerate(outputs):
        meta = out.get("meta_info", {})
        ids = [int(t) for t in out["output_ids"]]
        lps = None
        if want_logprobs:
            entries = meta.get("output_token_logprobs")
            if entries is None or len(entries) != len(ids):
                raise RuntimeError(
                    f"SGLang returned {0 if entries is None else len(entries)} logprobs for "
                    f"{len(ids)} tokens (request {k}); was return_logprob=True passed?"
                )
            if [int(e[1]) for e in entries] != ids:
                raise RuntimeError(f"SGLang logprob token ids differ from output_ids (request {k})")
            lps = torch.tensor([float(e[0]) for e in entries], dtype=torch.float32)
        reason = meta.get("finish_reason")
        reason = reason.get("type") if isinstance(reason, dict) else reason
        result.append(Completion(k // n, ids, lps, check_finish(reason, "SGLang")))
    return result


class SGLangEngine:
    """RolloutEngine on SGLang (GPU). ``engine`` may be given instead of building one (tests
    use a recording fake). engine_kwargs: more ``sglang.Engine`` arguments (dtype, tp_size,
    mem_fraction_static, max_running_requests, context_length, random_seed, ...)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        tokenizer: str | None = None,
        bucket_bytes: int = 512 * 2**20,
        engine: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        if engine is None:
            try:
                import sglang
            except ImportError as e:
                raise missing_engine("sglang", "sglang") from e
            if model_path is None:
                raise ValueError("SGLangEngine needs model_path (the actor's HF folder)")
            if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
                raise ValueError(
                    "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return logprobs "
                    "before temperature, not of the sampled distribution; unset it"
                )
            engine = sglang.Engine(model_path=str(model_path),
                                   tokenizer_path=tokenizer or str(model_path),
                                   enable_memory_saver=True, **engine_kwargs)
        self.engine = engine
        self.bucket_bytes = int(bucket_bytes)
        self.tokenizer = None
        self._asleep = False
        self._weights_awake = False
        self._warned_filters = False

    @classmethod
    def from_config(cls, cfg: Any, model_path: str, **overrides: Any) -> SGLangEngine:
        """Reads actor_rollout_ref.model.{dtype, tokenizer_path, trust_remote_code},
        actor_rollout_ref.rollout.{tensor_model_parallel_size, gpu_memory_utilization,
        max_num_seqs, seed, update_weights_bucket_megabytes}, data.{max_prompt_length,
        max_response_length}, trainer.seed."""
        from megarl.rollout.reshard import bucket_bytes_from_config

        arr, ro = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
        kwargs: dict[str, Any] = {
            "dtype": DTYPE_NAMES[arr.model.dtype],
            "tp_size": ro.tensor_model_parallel_size,
            "mem_fraction_static": ro.gpu_memory_utilization,
            "max_running_requests": ro.max_num_seqs,
            "context_length": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "random_seed": ro.seed if ro.seed is not None else cfg.trainer.seed,
            "trust_remote_code": arr.model.trust_remote_code,
        }
        kwargs.update(overrides)
        return cls(model_path, tokenizer=arr.model.tokenizer_path,
                   bucket_bytes=bucket_bytes_from_config(cfg), **kwargs)

    # ------------------------------------------------------------------------- protocol

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        if self._asleep:
            self.wake()
        if sampling.logprobs and not sampling.is_greedy and (
            sampling.top_k > 0 or sampling.top_p < 1.0
        ) and not self._warned_filters:
            logger.warning("SGLang logprobs ignore the top-k/top-p renormalisation "
                           "(see megarl.rollout.sglang.engine)")
            self._warned_filters = True
        n = sampling.n
        input_ids = [[int(t) for t in p] for p in prompts for _ in range(n)]
        params = [
            to_sglang_params(sampling, None if sampling.seed is None
                             else derived_seed(sampling.seed, i, s))
            for i in range(len(prompts)) for s in range(n)
        ]
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params,
                                       return_logprob=sampling.logprobs)
        return parse_sglang_outputs(list(outputs), n, sampling.logprobs)

    def update_weights(self, weights: Iterable[Any]) -> None:
        """Stream buckets (or a flat (name, tensor) stream, bucketed here) into the engine."""
        if self._asleep and not self._weights_awake:
            self.engine.resume_memory_occupation(tags=["weights"])
            self._weights_awake = True
        for bucket in as_buckets(weights, self.bucket_bytes):
            res = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
            del bucket
            ok, msg = _status(res)
            if not ok:
                raise RuntimeError(f"SGLang update_weights_from_tensor failed: {msg}")
        self.engine.flush_cache()

    def sleep(self) -> None:
        if not self._asleep:
            self.engine.release_memory_occupation()
            self._asleep, self._weights_awake = True, False

    def wake(self) -> None:
        if self._asleep:
            if self._weights_awake:
                self.engine.resume_memory_occupation(tags=["kv_cache"])
            else:
                self.engine.resume_memory_occupation()
            self._asleep, self._weights_awake = False, False


def _status(res: Any) -> tuple[bool, str]:
    """SGLang versions answer (success, message), a dict, or None."""
    if isinstance(res, tuple) and res and isinstance(res[0], bool):
        return res[0], str(res[1]) if len(res) > 1 else ""
    if isinstance(res, dict) and "success" in res:
        return bool(res["success"]), str(res.get("message", ""))
    return True, ""
