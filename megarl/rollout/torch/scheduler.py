"""The continuous-batching loop of `TorchRolloutEngine` over the slots of the KV cache
(prefill newly admitted sequences, decode the active ones, sample, retire the finished ones and
admit the waiting), and the per-sequence state it schedules (`Seq`).

A `Run` serves one ``generate`` call (every sequence added at the start, stepped until none is
left) or a `megarl.rollout.torch.session.GenerationSession`, whose requests join between steps
while others decode. One step is the same in both: a sequence added before a step is
scheduled exactly as if it had been there from the start, so the schedule, hence every batch's
rounding, is a function of what was added when, never of timing.

A session's weights may change between two steps (a partial rollout): `Run.refill` recomputes
the KV cache of every active sequence (its prompt and the tokens sampled so far) under the new
weights, and each sequence records from which token on each weights version sampled it
(``Seq.versions``)."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from megarl.models.moe import record_experts, stack_layers
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sampling import noise_key, sample_next, uniform_at
from megarl.rollout.torch.kv_cache import to_device
from megarl.rollout.torch.stopping import StopStrings


class Seq:
    """One (prompt, sample) being generated."""

    __slots__ = ("req", "sample", "prompt", "max_new", "prompt_key", "count", "tokens",
                 "logprobs", "finish", "key", "routing", "versions")

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
        # (first token, weights version) of each version that sampled it; empty when the run
        # tracks no versions
        self.versions: list[tuple[int, int]] = []

    @property
    def cached(self) -> int:
        """Positions already in the KV cache (the last sampled token is not yet)."""
        return len(self.prompt) + self.count - 1

    def token_versions(self) -> list[int] | None:
        """The weights version that sampled each of ``tokens`` (None: not tracked)."""
        if not self.versions:
            return None
        out: list[int] = []
        ends = [start for start, _ in self.versions[1:]] + [len(self.tokens)]
        for (start, version), end in zip(self.versions, ends):
            out += [version] * (end - start)
        return out


class Run:
    """The scheduling loop over slots (module doc)."""

    def __init__(
        self,
        engine: Any,  # the TorchRolloutEngine of this call (its model, cache and settings)
        sampling: SamplingParams,
        stop_ids: frozenset[int],
        stops: StopStrings,
        max_len: int,
        max_seqs: int,
    ) -> None:
        """``max_len``: prompt + response tokens of any sequence this run will hold;
        ``max_seqs``: sequences it could hold at once (slots = the fewest of this,
        ``engine.max_num_seqs`` and what the KV cache budget fits)."""
        self.e, self.sampling = engine, sampling
        self.stop_ids, self.stops = stop_ids, stops
        self.max_len = max_len
        self.seqs: list[Seq | None] = []  # None: finished and handed back (a session)
        self.pending: deque[int] = deque()
        self.active: list[int] = []  # active[i] is the sequence in cache slot i
        self.finished: list[int] = []  # retired since the caller last took them
        self.slots = min(engine.max_num_seqs, max_seqs)
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
        # the last sampled token of the sequence in each slot: the next decode's input
        self.last = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.stop_t = (to_device(sorted(stop_ids), torch.long, self.device) if stop_ids
                       else None)
        # (sequence ids, tokens [n], logprobs [n]) of every sampling call, on the device
        self.sampled: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        self.version: int | None = None  # the weights' version, when the caller tracks them

    def add(self, seqs: list[Seq], seed: int) -> list[int]:
        """Queue ``seqs`` (their noise drawn from ``seed``); returns their sequence ids."""
        for s in seqs:
            if len(s.prompt) + s.max_new > self.max_len:
                raise ValueError(f"a sequence of {len(s.prompt)} prompt + {s.max_new} new tokens "
                                 f"exceeds this run's {self.max_len}")
            s.key = noise_key(seed, s.prompt_key, s.sample)
        first = len(self.seqs)
        self.seqs.extend(seqs)
        sids = list(range(first, len(self.seqs)))
        self.pending.extend(sids)
        return sids

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.active)

    def loop(self) -> None:
        """Step until every added sequence is finished."""
        while self.busy:
            self.step()

    def step(self) -> None:
        """Admit waiting sequences into free slots (prefill), then decode the active ones; the
        sequences retired meanwhile are appended to ``finished``."""
        pending = self.pending
        if pending and len(self.active) < self.slots:
            new = []
            while pending and len(self.active) + len(new) < self.slots:
                new.append(pending.popleft())
            self.prefill(new, first_slot=len(self.active))
            self.active = self.retire(self.active + new)
            if pending and len(self.active) < self.slots:
                return  # some finished on their first token: admit more first
        if self.active:
            self.decode(self.active)
            self.active = self.retire(self.active)

    # ------------------------------------------------------------------------- steps

    def refill(self, version: int) -> None:
        """The model's weights changed to ``version`` between two steps: recompute the KV cache
        of every active sequence (its prompt and every sampled token but the last, which is the
        next decode's input) under them; the tokens sampled from now on are ``version``'s.
        Waiting sequences need nothing: their prefill runs on the new weights."""
        self.version = version
        if not self.active:
            return
        if self.e.return_routed_experts:
            raise ValueError("a partial rollout cannot keep the routing record of a sequence "
                             "whose cache is recomputed (routing replay): let requests finish "
                             "on their weights (async_training.partial_rollout=false)")
        self.collect()  # every sampled token on the host
        seqs = [self.seqs[sid] for sid in self.active]
        for s in seqs:
            s.versions.append((s.count, version))
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].cached)
        for chunk in self._chunks(order, [seqs[i].cached for i in order]):
            self._prefill_rows([seqs[i].prompt + seqs[i].tokens[:-1] for i in chunk], chunk,
                               list(range(len(chunk))))

    def _chunks(self, items: list[int], lengths: list[int]) -> list[list[int]]:
        """``items`` (sorted by their ``lengths``) cut into runs whose padded rows stay within
        the prefill token budget."""
        out: list[list[int]] = []
        for item, length in zip(items, lengths):
            if out and (len(out[-1]) + 1) * length <= self.e.prefill_token_budget:
                out[-1].append(item)
            else:
                out.append([item])
        return out

    def _prefill_rows(self, rows: list[list[int]], dst: list[int], src: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``rows`` (token lists, right-padded here) through the model, row src[i]'s keys
        and values written into cache slot dst[i]: (hidden [rows, t, H], routing or None)."""
        t = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        self.cache.begin_prefill(dst, src)
        if self.device.type != "cpu":
            ids = ids.to(self.device, non_blocking=True)
        pos = torch.arange(t, device=self.device).expand(len(rows), t)
        return self._forward(ids, pos)

    def prefill(self, new: list[int], first_slot: int) -> None:
        """Prefill the prompts of sequences ``new`` (slots first_slot...) and sample their
        first tokens. Samples of one prompt share a row; rows are batched by length under the
        token budget."""
        if self.version is not None:
            for sid in new:
                self.seqs[sid].versions = [(0, self.version)]
        by_req: dict[int, list[int]] = {}
        for k, sid in enumerate(new):
            by_req.setdefault(self.seqs[sid].req, []).append(k)
        reqs = sorted(by_req, key=lambda r: len(self.seqs[new[by_req[r][0]]].prompt))
        lengths = [len(self.seqs[new[by_req[r][0]]].prompt) for r in reqs]
        for chunk in self._chunks(reqs, lengths):
            self._prefill_chunk(chunk, by_req, new, first_slot)

    def _prefill_chunk(
        self, reqs: list[int], by_req: dict[int, list[int]], new: list[int], first_slot: int
    ) -> None:
        prompts = [self.seqs[new[by_req[r][0]]].prompt for r in reqs]
        lengths = [len(p) for p in prompts]
        t = max(lengths)
        dst, src, sids = [], [], []
        for row, r in enumerate(reqs):
            for k in by_req[r]:
                dst.append(first_slot + k)
                src.append(row)
                sids.append(new[k])
        hidden, routing = self._prefill_rows(prompts, dst, src)
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

    def _stopped(self, seqs: list[Seq], tokens: torch.Tensor) -> list[bool]:
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
        """Copy the tokens and logprobs sampled since the last call to the host (one transfer
        each) into the sequences, in the order they were sampled (with stop strings the tokens
        are there already: `_stopped` read them)."""
        if not self.sampled:
            return
        tokens = torch.cat([t for _, t, _ in self.sampled]).tolist()
        logprobs = torch.cat([lp for _, _, lp in self.sampled]).tolist()
        sids = (sid for ids, _, _ in self.sampled for sid in ids)
        for sid, tok, lp in zip(sids, tokens, logprobs, strict=True):
            seq = self.seqs[sid]
            if not self.stops:
                seq.tokens.append(tok)
            seq.logprobs.append(lp)
        self.sampled = []

    def retire(self, active: list[int]) -> list[int]:
        """Drop finished sequences and move live ones from the top slots into the holes (their
        cache rows and last tokens), so the live sequences occupy slots 0..n-1."""
        live = [s for s in active if self.seqs[s].finish is None]
        if len(live) == len(active):
            return active
        self.finished.extend(s for s in active if self.seqs[s].finish is not None)
        n = len(live)
        holes = [i for i in range(n) if self.seqs[active[i]].finish is not None]
        movers = [i for i in range(n, len(active)) if self.seqs[active[i]].finish is None]
        self.cache.move(movers, holes, [self.seqs[active[m]].cached for m in movers])
        out = active[:n]
        for h, m in zip(holes, movers):
            out[h] = active[m]
            self.last[h] = self.last[m]
        return out
