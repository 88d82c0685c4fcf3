"""Completions and prompts as a few flat arrays: how they cross the pipe to and from an engine
process and how the batches in flight are checkpointed (`megarl.rollout.process`).

A batch of N completions with T generated tokens in all packs into

    prompt_index   [N] int64          lengths  [N] int64 (tokens per completion)
    token_ids      [T] int64          logprobs [T] float32 (has_logprobs [N] bool)
    policy_version [N] int64 (-1: none)   finish_reason: N short strings
    routed_experts [R, layers, k] int16, routed_rows [N] int64 (-1: none)
    token_versions [T] int64, when every completion carries them (a rollout worker's)

so pickling or saving it costs O(N) Python objects, not one per token (a routing record is
[prompt + response tokens, layers, k] per completion: millions of numbers a batch). Packed
batches hold torch tensors (saved with ``torch.save``, loaded with ``weights_only=True``);
`to_wire` turns them into numpy arrays for a pipe, where a torch tensor would travel as a
shared-memory file descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megarl.rollout.protocol import Completion


def pack_completions(comps: Sequence[Completion]) -> dict[str, Any]:
    """The flat form of ``comps`` (module doc)."""
    lengths = [len(c.token_ids) for c in comps]
    has_lp = [c.logprobs is not None for c in comps]
    routed = [c.routed_experts for c in comps]
    out: dict[str, Any] = {
        "prompt_index": torch.tensor([c.prompt_index for c in comps], dtype=torch.int64),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "token_ids": torch.tensor([t for c in comps for t in c.token_ids], dtype=torch.int64),
        "has_logprobs": torch.tensor(has_lp, dtype=torch.bool),
        "logprobs": torch.cat([c.logprobs.reshape(-1).to(torch.float32) for c in comps
                               if c.logprobs is not None] or [torch.empty(0)]),
        "policy_version": torch.tensor([-1 if c.policy_version is None else c.policy_version
                                        for c in comps], dtype=torch.int64),
        "finish_reason": [c.finish_reason for c in comps],
        "routed_rows": torch.tensor([-1 if r is None else r.shape[0] for r in routed],
                                    dtype=torch.int64),
    }
    present = [r.to(torch.int16) for r in routed if r is not None]
    if present:
        out["routed_experts"] = torch.cat(present)
    if comps and all(c.token_versions is not None for c in comps):
        out["token_versions"] = torch.tensor([v for c in comps for v in c.token_versions],
                                             dtype=torch.int64)
    return out


def unpack_completions(packed: dict[str, Any]) -> list[Completion]:
    """The completions of a `pack_completions` batch (tensors or numpy arrays)."""
    p = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in packed.items()}
    token_ids = p["token_ids"].tolist()
    lengths, rows = p["lengths"].tolist(), p["routed_rows"].tolist()
    versions, has_lp = p["policy_version"].tolist(), p["has_logprobs"].tolist()
    per_token = p["token_versions"].tolist() if "token_versions" in p else None
    tok = lp = routed = 0
    out = []
    for i, (n, r) in enumerate(zip(lengths, rows)):
        logprobs = None
        if has_lp[i]:
            logprobs = p["logprobs"][lp: lp + n].clone()
            lp += n
        experts = None
        if r >= 0:
            experts = p["routed_experts"][routed: routed + r].clone()
            routed += r
        out.append(Completion(prompt_index=int(p["prompt_index"][i]),
                              token_ids=token_ids[tok: tok + n], logprobs=logprobs,
                              finish_reason=p["finish_reason"][i],
                              policy_version=None if versions[i] < 0 else versions[i],
                              routed_experts=experts,
                              token_versions=(None if per_token is None
                                              else per_token[tok: tok + n])))
        tok += n
    return out


def pack_prompts(prompts: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Prompts (token id lists) as ``ids`` [sum of lengths] and ``lengths`` [P], int64."""
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    ids = np.fromiter((int(t) for p in prompts for t in p), dtype=np.int64,
                      count=int(lengths.sum()))
    return {"ids": ids, "lengths": lengths}


def unpack_prompts(packed: dict[str, np.ndarray]) -> list[list[int]]:
    ids = packed["ids"].tolist()
    out, start = [], 0
    for n in packed["lengths"].tolist():
        out.append(ids[start: start + n])
        start += n
    return out


def to_wire(packed: dict[str, Any]) -> dict[str, Any]:
    """A packed batch with numpy arrays in place of tensors (for a pipe)."""
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
