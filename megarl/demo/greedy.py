"""A small greedy decoder for evaluating the demo models while the assets are built.

This is not the rollout engine (megarl/rollout): one plain KV cache behind the model's
``kv_cache.attend`` hook, left-padded prompts, argmax decoding (`generate` takes any per-token
pick, e.g. a seeded sampler).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megarl.data.batching import pad_left


class DenseKVCache:
    """Keys/values of every layer concatenated along time; masks left padding.

    key_mask: bool [B, S] of the cached + current keys (True = real token), kept by the caller
    through ``extend(new_mask)`` before each forward.
    """

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.key_mask: torch.Tensor | None = None

    def extend(self, new_mask: torch.Tensor) -> None:
        km = new_mask.bool()
        self.key_mask = km if self.key_mask is None else torch.cat([self.key_mask, km], dim=1)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [B, nh, T, hd], k/v [B, nkv, T, hd] -> [B, nh, T, hd]."""
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        t, s = q.shape[2], k.shape[2]
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        causal = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        mask = (causal[None] & self.key_mask[:, None, :]) | _self_positions(t, s, q.device)[None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def _self_positions(t: int, s: int, device) -> torch.Tensor:
    """[t, s] True where query i meets its own key (s - t + i): keeps padded rows finite."""
    eye = torch.zeros(t, s, dtype=torch.bool, device=device)
    eye[torch.arange(t), torch.arange(s - t, s)] = True
    return eye


def greedy_generate(
    model, prompts: list[list[int]], eos_id: int, pad_id: int, max_new_tokens: int,
    batch_size: int = 256,
) -> list[list[int]]:
    """Argmax continuation of each prompt, up to and including EOS (or max_new_tokens)."""
    return generate(model, prompts, eos_id, pad_id, max_new_tokens, batch_size,
                    pick=lambda logits: logits.argmax(-1))


@torch.no_grad()
def generate(
    model, prompts: list[list[int]], eos_id: int, pad_id: int, max_new_tokens: int,
    batch_size: int, pick: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[int]]:
    """Continuation of each prompt, up to and including EOS (or max_new_tokens), one token per
    step from ``pick(logits [B, V]) -> token ids [B]`` (called for every row, finished or not).
    Prompts are left-padded in batches of ``batch_size`` and decoded with a KV cache."""
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask = pad_left(chunk, pad_id)
        cache = DenseKVCache()
        cache.extend(mask)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, position_ids=pos, kv_cache=cache)[:, -1]
        next_pos = pos[:, -1:] + 1
        done = torch.zeros(len(chunk), dtype=torch.bool)
        gen = []
        for _ in range(max_new_tokens):
            tok = pick(logits)
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            gen.append(tok)
            done |= tok == eos_id
            if bool(done.all()):
                break
            cache.extend(torch.ones(len(chunk), 1, dtype=torch.bool))
            logits = model(tok[:, None], position_ids=next_pos, kv_cache=cache)[:, -1]
            next_pos = next_pos + 1
        g = torch.stack(gen, dim=1).tolist()
        for row in g:
            resp = []
            for t in row:
                resp.append(t)
                if t == eos_id:
                    break
            out.append(resp)
    model.train(was_training)
    return out
