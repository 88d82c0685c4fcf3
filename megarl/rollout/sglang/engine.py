"""`SGLangEngine`: SGLang's offline ``Engine`` colocated with the trainer, behind RolloutEngine.

Release: `SUPPORTED_SGLANG` (checked when an engine is built). Its lower bound is the first
release with every piece used here: per-request ``sampling_seed`` and
``enable_deterministic_inference`` (0.5.3) and the ``cuda_graph`` memory tag (0.5.5); the
names are checked against the released source by tests/rollout/test_sglang_contract.py.

Placement (one engine per group of ``rollout.tensor_model_parallel_size`` consecutive ranks,
as `megarl.trainer.generation` deals prompts): SGLang's offline engine starts its own tensor-parallel
workers, one subprocess per GPU, on GPUs ``base_gpu_id + tp_rank`` (``gpu_id_step=1``). So the
group's first rank hosts the engine with ``base_gpu_id`` = its LOCAL_RANK and spans the GPUs of
the whole group; the other ranks of the group host none (`_HostedByGroupLeader`): they generate
nothing (the trainer keeps the completions of each group's first rank only) and read the
weight stream without loading it (reading it keeps their collectives in step). A group must lie
within one node, and every rank must see all of its node's GPUs (torchrun's default).

Seeds: SGLang honours a request's ``sampling_seed`` only when the engine runs with
``enable_deterministic_inference=True``. That mode also forces SGLang's pytorch sampling
backend (its flashinfer sampler takes no seeds), batch-invariant kernels and an attention
backend among fa3 / flashinfer / triton (SGLang picks one by GPU; pass ``attention_backend`` to
choose): slower, but reproducible. The engine is started with it unless
``enable_deterministic_inference=False`` is passed; then seeds are ignored, said so once. The n
samples of a prompt are n requests (prompt-major), request (key, s) seeded with
``derived_seed(sampling.seed, key, s)``: the noise is a function of (seed, prompt key, sample
index) only. With deterministic inference and no seed, SGLang would give every request the same
default seed, so a fresh random seed is drawn for the call.

Memory (``enable_memory_saver=True``): ``sleep()`` releases the tags ``weights``, ``kv_cache``
and ``cuda_graph``. Released weights are not backed up (SGLang's ``enable_weights_cpu_backup``
stays off), so after a sleep only `update_weights` may come next: it resumes the weights, loads
the stream and flushes the prefix cache; `wake()` (or a `generate`) then resumes the KV cache
and the CUDA graphs. `wake()` or `generate()` after a sleep without a weight update raises
RuntimeError (the engine would run on discarded weights).

Weights are streamed in buckets (`megarl.rollout.reshard`) through
``update_weights_from_tensor(named_tensors=bucket, flush_cache=False)``, then one
``flush_cache()``.

Logprobs (``return_logprob=True``) come from ``meta_info["output_token_logprobs"]``, one
(logprob, token id, text) per generated token. SGLang reports log softmax(logits / T) of the
sampled token, i.e. BEFORE the top-k / top-p renormalisation (it matches the torch and vLLM
engines only when top_k = -1 and top_p = 1, the RL default); a greedy request reports
log softmax(logits). With ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set it would drop the temperature
as well: the adapter refuses to start with it set.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

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

logger = logging.getLogger(__name__)

# The releases this adapter was checked against (see the module docstring for the lower bound).
SUPPORTED_SGLANG = ">=0.5.5,<0.6"

# SGLang's memory tags (its GPU_MEMORY_TYPE_* constants), all released by sleep().
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
MEMORY_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)

# Makes SGLang return logprobs before the temperature (read by its sampler).
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def import_sglang() -> Any:
    """The installed sglang module, checked against `SUPPORTED_SGLANG`."""
    try:
        import sglang
    except ImportError as e:
        raise missing_engine("sglang", "sglang") from e
    check_engine_version("sglang", sglang.__version__, SUPPORTED_SGLANG, "sglang")
    return sglang


def group_base_gpu(local_rank: int, tp_size: int, local_world_size: int | None = None) -> int:
    """The first GPU of the engine that the rank ``local_rank`` belongs to: the LOCAL_RANK of
    the first rank of its group of ``tp_size`` consecutive ranks."""
    if tp_size < 1:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size} "
                         "must be at least 1")
    if local_world_size is not None and local_world_size % tp_size:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size}: an SGLang engine "
            f"spans {tp_size} GPUs of one node, but this node runs {local_world_size} ranks; "
            f"use a tensor_model_parallel_size that divides --nproc_per_node"
        )
    return local_rank - local_rank % tp_size


def hosts_engine(local_rank: int, tp_size: int) -> bool:
    """Whether this rank starts its group's engine (the group's first rank does)."""
    return local_rank % tp_size == 0


def engine_kwargs(rollout: RolloutSettings, local_rank: int,
                  local_world_size: int | None = None) -> dict[str, Any]:
    """``sglang.Engine`` arguments (besides model and tokenizer paths) for the engine of the
    rank ``local_rank``'s group, from ``rollout``'s dtype, trust_remote_code,
    tensor_model_parallel_size, expert_parallel_size, gpu_memory_utilization, max_num_seqs,
    max_model_len and seed."""
    ro = rollout
    tp = ro.tensor_model_parallel_size
    return {
        "dtype": DTYPE_NAMES[ro.dtype],
        "tp_size": tp,
        "base_gpu_id": group_base_gpu(local_rank, tp, local_world_size),
        "gpu_id_step": 1,
        "mem_fraction_static": ro.gpu_memory_utilization,
        "max_running_requests": ro.max_num_seqs,
        "context_length": ro.max_model_len,
        "random_seed": ro.seed,
        "trust_remote_code": ro.trust_remote_code,
        "enable_deterministic_inference": True,  # the trainer always seeds its sampling
        **({"ep_size": ro.expert_parallel_size} if ro.expert_parallel_size > 1 else {}),
    }


EXTRA_PREFIX = "actor_rollout_ref.rollout.engine_kwargs.sglang"
# the sglang.Engine arguments megarl sets, and the config key each one comes from
OWNED: dict[str, str] = {
    "model_path": "actor_rollout_ref.model.path",
    "tokenizer_path": "actor_rollout_ref.model.tokenizer_path",
    "dtype": "actor_rollout_ref.model.dtype",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "tp_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "ep_size": "actor_rollout_ref.rollout.expert_parallel_size",
    "base_gpu_id": "the rank's LOCAL_RANK (one engine per tensor-parallel group)",
    "gpu_id_step": "the engine's placement (one GPU per tensor-parallel rank)",
    "mem_fraction_static": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_running_requests": "actor_rollout_ref.rollout.max_num_seqs",
    "context_length": "data.max_prompt_length + data.max_response_length",
    "random_seed": "actor_rollout_ref.rollout.seed (else trainer.seed)",
    "enable_memory_saver": "actor_rollout_ref.rollout.free_cache_engine (sleep and wake)",
}


def user_engine_kwargs(rollout: RolloutSettings) -> dict[str, Any]:
    """``actor_rollout_ref.rollout.engine_kwargs.sglang``: verl's extra ``sglang.Engine``
    arguments. One megarl sets itself (`OWNED`) is a UserInputError naming the key to set
    instead; names are checked against SGLang's ``ServerArgs`` when the engine is built.
    ``enable_deterministic_inference`` may be given (see the module docstring on seeds)."""
    from megarl.rollout.vllm.engine_args import check_extra

    return check_extra(rollout.user_engine_kwargs("sglang"), OWNED, None, EXTRA_PREFIX,
                       "SGLang's engine")


def server_arg_names(sglang: Any) -> set[str] | None:
    """The fields of the installed SGLang's ``ServerArgs`` (what ``sglang.Engine`` accepts);
    None when that module cannot be read."""
    import dataclasses

    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(ServerArgs)} if dataclasses.is_dataclass(
        ServerArgs) else None


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
    outputs: list[Mapping[str, Any]], n: int, want_logprobs: bool
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
        reason = reason.get("type") if isinstance(reason, Mapping) else reason
        result.append(Completion(k // n, ids, lps, check_finish(reason, "SGLang")))
    return result


class SGLangEngine:
    """RolloutEngine on SGLang (GPU). ``engine`` may be given instead of building one (tests
    use a recording fake). engine_kwargs: more ``sglang.Engine`` arguments (dtype, tp_size,
    base_gpu_id, mem_fraction_static, max_running_requests, context_length, random_seed, ...);
    ``enable_deterministic_inference`` defaults to True (seeds take effect). With ``engine``
    given, ``enable_deterministic_inference`` says how that engine was started."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        tokenizer: str | None = None,
        bucket_bytes: int = 512 * 2**20,
        engine: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        self.seeds_effective = bool(engine_kwargs.pop("enable_deterministic_inference", True))
        if engine is None:
            engine = _build_engine(model_path, tokenizer, self.seeds_effective, engine_kwargs)
        self.engine = engine
        self.bucket_bytes = int(bucket_bytes)
        self.tokenizer = None
        self._released: set[str] = set()  # memory tags released and not yet resumed
        self._warned_filters = False
        self._warned_seeds = False

    @classmethod
    def from_rollout_settings(cls, rollout: RolloutSettings, model_path: str,
                              env: Mapping[str, str] = os.environ,
                              **overrides: Any) -> SGLangEngine:
        """The engine of this rank's group (`engine_kwargs`; LOCAL_RANK and LOCAL_WORLD_SIZE
        from ``env``): started here on the group's first rank, a stand-in elsewhere (see the
        module docstring). Also reads ``rollout``'s tokenizer_path and bucket_bytes."""
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
        kwargs = engine_kwargs(rollout, local_rank, local_world)
        kwargs.update(user_engine_kwargs(rollout))
        kwargs.update(overrides)
        bucket_bytes = rollout.bucket_bytes
        if not hosts_engine(local_rank, kwargs["tp_size"]):
            return cls(engine=_HostedByGroupLeader(), bucket_bytes=bucket_bytes,
                       enable_deterministic_inference=kwargs["enable_deterministic_inference"])
        return cls(model_path, tokenizer=rollout.tokenizer_path,
                   bucket_bytes=bucket_bytes, **kwargs)

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
        self.wake()
        self._warn_once(sampling)
        n, base = sampling.n, self._base_seed(sampling)
        input_ids = [[int(t) for t in p] for p in prompts for _ in range(n)]
        params = [to_sglang_params(sampling, None if base is None else derived_seed(base, k, s))
                  for k in keys for s in range(n)]
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params,
                                       return_logprob=sampling.logprobs)
        return parse_sglang_outputs(list(outputs), n, sampling.logprobs)

    def update_weights(self, weights: Iterable[Any]) -> None:
        """Stream buckets (or a flat (name, tensor) stream, bucketed here) into the engine;
        asleep, the weights' memory is resumed first (the rest waits for `wake`)."""
        self._resume([WEIGHTS])
        for bucket in as_buckets(weights, self.bucket_bytes):
            res = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
            del bucket
            ok, msg = _status(res)
            if not ok:
                raise RuntimeError(f"SGLang update_weights_from_tensor failed: {msg}")
        self.engine.flush_cache()

    def sleep(self) -> None:
        """Release the engine's GPU memory (weights, KV cache, CUDA graphs)."""
        tags = [t for t in MEMORY_TAGS if t not in self._released]
        if tags:
            self.engine.release_memory_occupation(tags=tags)
            self._released.update(tags)

    def wake(self) -> None:
        """Resume what `sleep` released, once `update_weights` has refilled the weights."""
        if WEIGHTS in self._released:
            raise RuntimeError(
                "SGLangEngine: wake() or generate() after sleep() without update_weights(): "
                "the released weights have no backup; load them first (the trainer syncs the "
                "weights before every generation)"
            )
        self._resume([t for t in MEMORY_TAGS if t != WEIGHTS])

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def close(self) -> None:
        """Shut the SGLang engine (its scheduler and detokenizer processes) down now."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ------------------------------------------------------------------------- helpers

    def _resume(self, tags: list[str]) -> None:
        """Resume those of ``tags`` that are released (SGLang refuses others)."""
        tags = [t for t in tags if t in self._released]
        if tags:
            self.engine.resume_memory_occupation(tags=tags)
            self._released.difference_update(tags)

    def _base_seed(self, sampling: SamplingParams) -> int | None:
        """The seed the requests' seeds derive from; a fresh one when SGLang would otherwise
        seed every request alike (deterministic inference, no seed)."""
        if sampling.seed is not None:
            return int(sampling.seed)
        if self.seeds_effective and not sampling.is_greedy:
            return secrets.randbits(31)
        return None

    def _warn_once(self, sampling: SamplingParams) -> None:
        if sampling.logprobs and not sampling.is_greedy and (
            sampling.top_k > 0 or sampling.top_p < 1.0
        ) and not self._warned_filters:
            logger.warning("SGLang logprobs ignore the top-k/top-p renormalisation "
                           "(see megarl.rollout.sglang.engine)")
            self._warned_filters = True
        if sampling.seed is not None and not self.seeds_effective and not self._warned_seeds:
            logger.warning("SGLang ignores sampling seeds: the engine runs without "
                           "enable_deterministic_inference, so its samples are not reproducible")
            self._warned_seeds = True


class _HostedByGroupLeader:
    """Stands in for ``sglang.Engine`` on a rank whose group's engine the group's first rank
    hosts: no completions, weights read and dropped, memory calls ignored."""

    def generate(self, input_ids: Any, sampling_params: Any, return_logprob: bool) -> list:
        return []

    def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool) -> tuple:
        return True, ""

    def flush_cache(self) -> None:
        pass

    def release_memory_occupation(self, tags: list[str]) -> None:
        pass

    def resume_memory_occupation(self, tags: list[str]) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _build_engine(
    model_path: str | None, tokenizer: str | None, deterministic: bool, kwargs: dict[str, Any]
) -> Any:
    """``sglang.Engine`` for the actor's HF folder, after checking the installed release."""
    sglang = import_sglang()
    if model_path is None:
        raise ValueError("SGLangEngine needs model_path (the actor's HF folder)")
    if os.environ.get(ORIGINAL_LOGPROB_ENV, "").lower() in ("1", "true"):
        raise ValueError(
            f"{ORIGINAL_LOGPROB_ENV} is set: SGLang would return logprobs before "
            "temperature, not of the sampled distribution; unset it"
        )
    known = server_arg_names(sglang)
    if known is not None:  # every argument, megarl's and the user's, is a ServerArgs field
        from megarl.rollout.vllm.engine_args import check_extra

        check_extra(kwargs, {}, known, EXTRA_PREFIX,
                    f"SGLang {sglang.__version__}'s engine (sglang.srt.server_args.ServerArgs)")
    return sglang.Engine(model_path=str(model_path), tokenizer_path=tokenizer or str(model_path),
                         enable_memory_saver=True, enable_deterministic_inference=deterministic,
                         **kwargs)


def _status(res: Any) -> tuple[bool, str]:
    """SGLang versions answer (success, message), a dict, or None."""
    if isinstance(res, tuple) and res and isinstance(res[0], bool):
        return res[0], str(res[1]) if len(res) > 1 else ""
    if isinstance(res, dict) and "success" in res:
        return bool(res["success"]), str(res.get("message", ""))
    return True, ""
