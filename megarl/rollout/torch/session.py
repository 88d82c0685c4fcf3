"""`GenerationSession`: requests that join `TorchRolloutEngine`'s running batch.

    session = engine.open_session(sampling, max_len=prompt_budget + response_budget)
    session.submit(prompt_ids, prompt_key=k, seed=s)          # any time, also between steps
    while session.busy:
        for c in session.step():                             # the completions finished now
            ...                                              # a follow-up may be submitted here

With ``version`` the session tracks the weights' versions: each completion carries the version
that sampled each of its tokens (``token_versions``), and `weights_changed` continues the
running sequences on new weights (a partial rollout: their KV cache recomputed, their tokens
so far kept with the logprobs they were sampled with).

One ``generate`` call runs every sequence from the start; a session admits each request as a
slot frees, while the others decode, and hands each completion back the step it finishes: a
multi-turn trajectory's next turn (its tool responses appended) or another prompt joins the
batch instead of waiting for a whole ``generate`` to end (docs/design.md, "The request and
sample streams").

A request's tokens depend only on (seed, prompt key, sample, position) and on its logits
(`megarl.rollout.sampling`), so they are those it gets alone or in a ``generate`` call, up to
the rounding of batched matmuls; the schedule is a function of what was submitted before
which step, so a session driven the same way gives the same bits again.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.rollout.protocol import Completion, SamplingParams
from megarl.rollout.sampling import check_sampling_params
from megarl.rollout.torch.scheduler import Run, Seq
from megarl.rollout.torch.stopping import StopStrings


class GenerationSession:
    """Continuous generation on one engine with shared ``sampling`` settings (temperature,
    top-k / top-p, stops, logprobs; each request brings its own seed, prompt key and token
    budget). ``max_len``: prompt + response tokens any request may reach (the KV cache's
    length per slot). ``version``: the version of the engine's weights, tracked from here on
    (None: not tracked). Not thread-safe: one caller submits and steps."""

    def __init__(self, engine: Any, sampling: SamplingParams, max_len: int,
                 version: int | None = None) -> None:
        check_sampling_params(sampling, engine.model.args.vocab_size)
        if not 0 < max_len <= engine.max_model_len:
            raise ValueError(f"max_len={max_len}: expected 1..max_model_len "
                             f"({engine.max_model_len})")
        if engine.asleep:
            engine.wake()
        engine._await_wake()
        self.engine, self.sampling = engine, sampling
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= set(engine.eos_token_ids)
        self.run = Run(engine, sampling, frozenset(stop_ids),
                       StopStrings(engine.tokenizer, list(sampling.stop)), max_len=max_len,
                       max_seqs=engine.max_num_seqs)
        self.run.version = version
        self._requests = 0

    @property
    def busy(self) -> bool:
        """Whether a submitted request has not been handed back yet."""
        return self.run.busy or bool(self.run.finished)

    def submit(self, prompt: list[int], *, prompt_key: int, seed: int, n: int = 1,
               max_new_tokens: int | None = None) -> int:
        """Queue ``n`` samples of ``prompt`` (noise of (seed, prompt_key, sample), as
        ``generate`` draws it); they join the batch at the next step with a free slot. Returns
        the request id their completions carry as ``prompt_index``. ``max_new_tokens``: this
        request's budget (default the session's ``sampling.max_new_tokens``), cut to fit
        ``max_len``."""
        prompt = [int(t) for t in prompt]
        vocab = self.engine.model.args.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"a request needs 1+ token ids in [0, {vocab})")
        if len(prompt) >= self.run.max_len:
            raise ValueError(f"a request of {len(prompt)} tokens leaves no room in this "
                             f"session's max_len={self.run.max_len}")
        budget = self.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        max_new = min(int(budget), self.run.max_len - len(prompt))
        if max_new < 1:
            raise ValueError(f"max_new_tokens={budget}: a request needs a budget of 1+ tokens")
        rid = self._requests
        self._requests += 1
        self.run.add([Seq(rid, s, prompt, max_new, prompt_key) for s in range(n)], seed)
        return rid

    def weights_changed(self, version: int) -> None:
        """The engine's weights were replaced (between two steps) by ``version``'s: the running
        sequences go on under them, their KV cache recomputed (module doc); requests not yet
        admitted simply run on them."""
        if self.run.version is None:
            raise ValueError("weights_changed: this session tracks no versions (open it with "
                             "version=)")
        with torch.inference_mode():
            self.run.refill(version)

    def step(self) -> list[Completion]:
        """One scheduling step (admit, prefill, decode, retire); the completions of the samples
        that finished in it, in the order they finished."""
        with torch.inference_mode():
            if self.run.busy:
                self.run.step()
            if not self.run.finished:
                return []
            self.run.collect()
        done, self.run.finished = self.run.finished, []
        out = [self.engine.completion(self.run.seqs[sid], self.sampling) for sid in done]
        for sid in done:  # handed back: a long session keeps no finished sequence
            self.run.seqs[sid] = None
        return out
