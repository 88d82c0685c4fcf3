"""`TorchRolloutEngine`: batched generation with megarl's own `Transformer` in plain PyTorch.

Continuous batching over a preallocated slot KV cache (`SlotKVCache`): up to ``max_num_seqs``
sequences decode together; a finished sequence frees its slot at once and the next waiting
(prompt, sample) is prefilled into it. The n samples of a prompt admitted together share one
prefill. Sampling noise is a function of (seed, prompt key, sample index, token position)
only (the key is the prompt's index unless ``prompt_keys`` are given) (`megarl.rollout.sampling`), so outputs do not depend on ``max_num_seqs`` or on the order
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
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserInputError
from megarl.models import Transformer, load_model, read_hf_config
from megarl.models.moe import record_experts, routing_dtype, sparse_layers, stack_layers
from megarl.rollout.protocol import Completion, SamplingParams, resolve_prompt_keys
from megarl.rollout.sampling import check_sampling_params, noise_key, sample_next, uniform_at
from megarl.rollout.torch.kv_cache import SlotKVCache, to_device
from megarl.rollout.torch.stopping import StopStrings
from megarl.rollout.torch.weights import load_weight_stream
from megarl.utils.dtypes import canonical_dtype, torch_dtype

logger = logging.getLogger(__name__)


class _Seq:
    """One (prompt, sample) being generated."""

    __slots__ = ("req", "sample", "prompt", "max_new", "prompt_key", "count", "tokens",
                 "logprobs", "finish", "key", "routing")

    def __init__(self, req: int, sample: int, prompt: list[int], max_new: int,
                 prompt_key: int) -> None:
        self.req, self.sample, self.prompt, self.max_new = req, sample, prompt, max_new
        self.prompt_key = prompt_key  # the request number of the sampling noise
        self.count = 0  # tokens sampled so far (their values may still be on the device)
        self.tokens: list[int] = []  # filled when the run ends (with stop strings: as sampled)
        self.logprobs: list[float] = []  # filled when the run ends
        self.finish: str | None = None
        self.key = 0  # noise_key(seed, prompt_key, sample), set by the run
        self.routing: list[torch.Tensor] = []  # [n, n_sparse, k] per forward that ran its tokens

    @property
    def cached(self) -> int:
        """Positions already in the KV cache (the last sampled token is not yet)."""
        return len(self.prompt) + self.count - 1


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
        model = load_model(path, head="lm", dtype=dtype, device=device).eval()
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
    def settings(cfg: Any, model_path: str, device: torch.device | str | None = None
                 ) -> dict[str, Any]:
        """The engine of a run as plain data: `from_pretrained`'s arguments (``path``, the dtype
        by name, ``device`` as a string). Reads actor_rollout_ref.model.{dtype, tokenizer_path},
        actor_rollout_ref.rollout.{max_num_seqs, gpu_memory_utilization} and
        data.{max_prompt_length, max_response_length} (their sum is max_model_len). The KV
        cache gets at most gpu_memory_utilization x the device's free memory (CUDA: total
        minus allocated; CPU: MemAvailable) now. With actor_rollout_ref.actor.router_replay.mode
        =R3 the engine records routed experts."""
        from megarl.data.locations import resolve_path

        arr = cfg.actor_rollout_ref
        dtype_name = canonical_dtype(arr.model.dtype, "actor_rollout_ref.model.dtype")
        device = torch.device(device if device is not None else "cpu")
        return {
            "path": resolve_path(model_path),
            "dtype": dtype_name,
            "device": str(device),
            "tokenizer": arr.model.tokenizer_path or model_path,
            "max_num_seqs": arr.rollout.max_num_seqs,
            "max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "kv_cache_bytes": _cache_budget(device, arr.rollout.gpu_memory_utilization),
            "return_routed_experts": arr.actor.router_replay.mode == "R3",
        }

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> TorchRolloutEngine:
        """The engine of `settings` (another process's included: the dict is picklable)."""
        kwargs = dict(settings)
        return cls.from_pretrained(kwargs.pop("path"), dtype=torch_dtype(kwargs.pop("dtype")),
                                   **kwargs)

    @classmethod
    def from_config(
        cls, cfg: Any, model_path: str, device: torch.device | str | None = None
    ) -> TorchRolloutEngine:
        """Engine for a run (`settings`)."""
        return cls.from_settings(cls.settings(cfg, model_path, device))

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
        run = _Run(
            self,
            seqs,
            sampling,
            seed,
            frozenset(stop_ids),
            StopStrings(self.tokenizer, list(sampling.stop)),
        )
        with torch.inference_mode():
            run.loop()
            run.collect()
        return [
            Completion(
                prompt_index=s.req,
                token_ids=s.tokens,
                logprobs=(torch.tensor(s.logprobs, dtype=torch.float32)
                          if sampling.logprobs else None),
                finish_reason=s.finish or "length",
                routed_experts=self._routing_of(s) if self.return_routed_experts else None,
            )
            for s in seqs
        ]

    def _routing_of(self, s: _Seq) -> torch.Tensor:
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
        load_weight_stream(self.model, _flatten(weights), strict=strict)

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
    ) -> list[_Seq]:
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
            seqs.extend(_Seq(i, s, prompt, max_new, keys[i]) for s in range(sampling.n))
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


class _Run:
    """One generate() call: the scheduling loop over slots."""

    def __init__(
        self,
        engine: TorchRolloutEngine,
        seqs: list[_Seq],
        sampling: SamplingParams,
        seed: int,
        stop_ids: frozenset[int],
        stops: StopStrings,
    ) -> None:
        self.e, self.seqs, self.sampling, self.seed = engine, seqs, sampling, seed
        self.stop_ids, self.stops = stop_ids, stops
        max_len = max(len(s.prompt) + s.max_new for s in seqs)
        self.slots = min(engine.max_num_seqs, len(seqs))
        if engine.kv_cache_bytes is not None:
            a = engine.model.args
            per_slot = (2 * len(engine.model.model.layers) * a.num_key_value_heads * max_len
                        * a.head_dim * torch.empty(0, dtype=engine.dtype).element_size())
            fit = engine.kv_cache_bytes // per_slot
            if fit < 1:
                raise ValueError(
                    f"the KV cache budget ({engine.kv_cache_bytes / 2**20:.0f} MiB) holds no "
                    f"sequence of {max_len} tokens ({per_slot / 2**20:.1f} MiB); raise "
                    f"actor_rollout_ref.rollout.gpu_memory_utilization or lower "
                    f"data.max_prompt_length / max_response_length"
                )
            self.slots = min(self.slots, int(fit))
        self.cache = engine._get_cache(self.slots, max_len)
        self.device = engine.device
        for s in seqs:
            s.key = noise_key(seed, s.prompt_key, s.sample)
        # the last sampled token of the sequence in each slot: the next decode's input
        self.last = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.stop_t = (to_device(sorted(stop_ids), torch.long, self.device) if stop_ids
                       else None)
        # (sequence ids, tokens [n], logprobs [n]) of every sampling call, on the device
        self.sampled: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []

    def loop(self) -> None:
        pending = deque(range(len(self.seqs)))
        active: list[int] = []  # active[i] is the sequence in cache slot i
        while pending or active:
            if pending and len(active) < self.slots:
                new = []
                while pending and len(active) + len(new) < self.slots:
                    new.append(pending.popleft())
                self.prefill(new, first_slot=len(active))
                active = self.retire(active + new)
                if pending and len(active) < self.slots:
                    continue  # some finished on their first token: admit more first
            if active:
                self.decode(active)
                active = self.retire(active)

    # ------------------------------------------------------------------------- steps

    def prefill(self, new: list[int], first_slot: int) -> None:
        """Prefill the prompts of sequences ``new`` (slots first_slot...) and sample their
        first tokens. Samples of one prompt share a row; rows are batched by length under the
        token budget."""
        by_req: dict[int, list[int]] = {}
        for k, sid in enumerate(new):
            by_req.setdefault(self.seqs[sid].req, []).append(k)
        reqs = sorted(by_req, key=lambda r: len(self.seqs[new[by_req[r][0]]].prompt))
        budget = self.e.prefill_token_budget
        chunk: list[int] = []
        for r in reqs:
            length = len(self.seqs[new[by_req[r][0]]].prompt)
            if chunk and (len(chunk) + 1) * length > budget:
                self._prefill_chunk(chunk, by_req, new, first_slot)
                chunk = []
            chunk.append(r)
        if chunk:
            self._prefill_chunk(chunk, by_req, new, first_slot)

    def _prefill_chunk(
        self, reqs: list[int], by_req: dict[int, list[int]], new: list[int], first_slot: int
    ) -> None:
        prompts = [self.seqs[new[by_req[r][0]]].prompt for r in reqs]
        lengths = [len(p) for p in prompts]
        t = max(lengths)
        ids = torch.zeros(len(prompts), t, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        dst, src, sids = [], [], []
        for row, r in enumerate(reqs):
            for k in by_req[r]:
                dst.append(first_slot + k)
                src.append(row)
                sids.append(new[k])
        self.cache.begin_prefill(dst, src)
        if self.device.type != "cpu":
            ids = ids.to(self.device, non_blocking=True)
        pos = torch.arange(t, device=self.device).expand(len(prompts), t)
        hidden, routing = self._forward(ids, pos)
        if routing is not None:  # [rows * t, n_sparse, k] -> each sample its prompt's rows
            routing = routing.view(len(prompts), t, *routing.shape[1:])
            for sid, row in zip(sids, src):
                self.seqs[sid].routing.append(routing[row, : lengths[row]])
        rows = torch.arange(len(prompts), device=self.device)
        last = hidden[rows, to_device(lengths, torch.long, self.device) - 1]
        logits = self.e._logits(last)
        self.sample_into(sids, logits[to_device(src, torch.long, self.device)],
                         to_device(dst, torch.long, self.device))

    def decode(self, active: list[int]) -> None:
        seqs = [self.seqs[s] for s in active]
        n = len(seqs)
        positions = [s.cached for s in seqs]
        pos = to_device(positions, torch.long, self.device)
        self.cache.begin_decode(pos, max(positions) + 1)
        hidden, routing = self._forward(self.last[:n, None], pos[:, None])
        if routing is not None:  # the token each sequence fed in: its last sampled one
            for s, r in zip(seqs, routing.split(1)):
                s.routing.append(r)
        self.sample_into(active, self.e._logits(hidden[:, -1]), slice(0, n))

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states [b, t, H], routing [b * t, n_sparse, k] on the device, or
        None when the engine does not record it)."""
        if not self.e.return_routed_experts:
            return self.e.model(ids, position_ids=pos, kv_cache=self.cache, output="hidden"), None
        with record_experts(self.e.model) as chosen:
            hidden = self.e.model(ids, position_ids=pos, kv_cache=self.cache, output="hidden")
        return hidden, stack_layers(chosen, self.e.model.args)

    def sample_into(self, sids: list[int], logits: torch.Tensor,
                    slots: torch.Tensor | slice) -> None:
        """Sample one token for each sequence in ``sids`` (rows of ``logits``), keep it on the
        device as the next input of the sequence's cache slot (``slots``: one per sid), and
        apply the stop rules."""
        seqs = [self.seqs[s] for s in sids]
        u = None
        if not self.sampling.is_greedy:
            u = to_device([uniform_at(s.key, s.count) for s in seqs], torch.float64,
                          self.device)
        tokens, logprobs = sample_next(logits, self.sampling, u)
        self.last[slots] = tokens
        self.sampled.append((sids, tokens, logprobs))
        for s, stop in zip(seqs, self._stopped(seqs, tokens)):
            s.count += 1
            if stop:
                s.finish = "stop"
            elif s.count >= s.max_new:
                s.finish = "length"

    def _stopped(self, seqs: list[_Seq], tokens: torch.Tensor) -> list[bool]:
        """Whether each of ``seqs`` just sampled a stop token or completed a stop string
        (``tokens`` [n] on the device): the step's one read of the device, skipped when no
        stop is possible. Stop strings need the text, so the tokens come to the host."""
        if self.stops:
            flags = []
            for s, tok in zip(seqs, tokens.tolist()):
                s.tokens.append(tok)
                flags.append(tok in self.stop_ids or self.stops.hit(s.tokens))
            return flags
        if self.stop_t is None:
            return [False] * len(seqs)
        return torch.isin(tokens, self.stop_t).tolist()

    def collect(self) -> None:
        """Copy every sampled token and logprob to the host (one transfer each) into the
        sequences, in the order they were sampled."""
        if not self.sampled:
            return
        tokens = torch.cat([t for _, t, _ in self.sampled]).tolist()
        logprobs = torch.cat([lp for _, _, lp in self.sampled]).tolist()
        for s in self.seqs:
            s.tokens, s.logprobs = [], []
        sids = (sid for ids, _, _ in self.sampled for sid in ids)
        for sid, tok, lp in zip(sids, tokens, logprobs, strict=True):
            seq = self.seqs[sid]
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
        self.sampled = []

    def retire(self, active: list[int]) -> list[int]:
        """Drop finished sequences and move live ones from the top slots into the holes (their
        cache rows and last tokens), so the live sequences occupy slots 0..n-1."""
        live = [s for s in active if self.seqs[s].finish is None]
        if len(live) == len(active):
            return active
        n = len(live)
        holes = [i for i in range(n) if self.seqs[active[i]].finish is not None]
        movers = [i for i in range(n, len(active)) if self.seqs[active[i]].finish is None]
        self.cache.move(movers, holes, [self.seqs[active[m]].cached for m in movers])
        out = active[:n]
        for h, m in zip(holes, movers):
            out[h] = active[m]
            self.last[h] = self.last[m]
        return out


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


def _flatten(weights: Iterable[Any]) -> Iterable[tuple[str, torch.Tensor]]:
    for item in weights:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:  # a bucket: list of (name, tensor)
            yield from item
