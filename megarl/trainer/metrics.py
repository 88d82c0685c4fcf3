"""Per-step data metrics under verl's names (critic/score/mean, response_length/mean, ...)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from megarl.trainer.batch import RolloutBatch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.to(torch.float64)
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()),
            f"{prefix}/min": float(v.min())}


def data_metrics(batch: RolloutBatch, max_response_length: int,
                 max_prompt_length: int) -> dict[str, float]:
    t = batch.tensors
    mask = batch.response_mask  # the model's tokens (what advantages / returns live on)
    # response lengths count every response token, appended multi-turn ones included (verl's
    # attention-mask lengths; the budget data.max_response_length counts them too)
    padding = batch.response_padding_mask
    valid = padding.sum(-1) > 0  # aborted (empty) responses are excluded, as verl
    sel = mask.bool()
    m: dict[str, float] = {}
    m.update(_stats("critic/score", t["token_level_scores"].sum(-1)[valid]))
    m.update(_stats("critic/rewards", t["token_level_rewards"].sum(-1)[valid]))
    m.update(_stats("critic/verifiable_reward", t["verifiable"][valid]))
    if "advantages" in t:
        m.update(_stats("critic/advantages", t["advantages"][sel]))
        m.update(_stats("critic/returns", t["returns"][sel]))
    if "values" in t:
        values, returns = t["values"][sel], t["returns"][sel]
        m.update(_stats("critic/values", values))
        var_r = returns.var(unbiased=True) if returns.numel() > 1 else torch.tensor(0.0)
        var_d = (returns - values).var(unbiased=True) if returns.numel() > 1 else torch.tensor(0.0)
        m["critic/vf_explained_var"] = float(1.0 - var_d / (var_r + 1e-5))
    if "step_mask" in t:
        m.update(_stats("num_of_steps", t["step_mask"].sum(-1)[valid]))
    lengths = padding.sum(-1)
    m.update(_stats("response_length", lengths))
    m["response_length/clip_ratio"] = float((lengths >= max_response_length).float().mean())
    m["response/aborted_ratio"] = float((~valid).float().mean())
    correct = t["verifiable"] > 0.5
    if correct.any():
        m["response_length/correct_mean"] = float(lengths[correct].float().mean())
    if (~correct).any():
        m["response_length/incorrect_mean"] = float(lengths[~correct].float().mean())
    plen = batch.prompt_mask.sum(-1)
    m.update(_stats("prompt_length", plen))
    m["prompt_length/clip_ratio"] = float((plen >= max_prompt_length).float().mean())
    # pass@n: a prompt is solved when any of its responses is correct
    solved: dict[int, bool] = defaultdict(bool)
    for g, ok in zip(batch.group_index.tolist(), correct.tolist()):
        solved[g] |= ok
    m["critic/pass_at_n/mean"] = sum(solved.values()) / max(len(solved), 1)
    return m


class Timer:
    """Accumulates wall time per named phase: ``with timer("gen"): ...`` -> timing_s/gen.

    ``Timer.sink``: when a list, every timed phase of every timer is also appended to it as
    (name, start, end) in ``time.perf_counter()`` seconds (the system-wide monotonic clock on
    Linux, comparable with the engine process's spans): a timeline for profiling tools
    (bench/async_step.py --timeline). None (default): nothing is kept."""

    sink: list[tuple[str, float, float]] | None = None

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.times[name] += end - start
            if Timer.sink is not None:
                Timer.sink.append((name, start, end))

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}


# Phases whose cost scales with the generated tokens; the others scale with all tokens (verl).
_PER_RESPONSE_TOKEN = ("gen",)


def per_token_timing(times: dict[str, float], prompt_tokens: int,
                     response_tokens: int) -> dict[str, float]:
    """timing_per_token_ms/{phase}: ms of each timed phase per token it processed (verl's
    names): generation per response token, every other phase per prompt + response token."""
    out = {}
    for name, seconds in times.items():
        tokens = response_tokens if name in _PER_RESPONSE_TOKEN else prompt_tokens + response_tokens
        if tokens > 0:
            out[f"timing_per_token_ms/{name}"] = 1e3 * seconds / tokens
    return out
