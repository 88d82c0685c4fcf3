"""The reference side of engine-logprob checks (tests only): completions as a `SequenceBatch`
laid out as the Backend protocol lays it out, and logprobs recomputed from one full forward of a
megarl `Transformer` with top-k / top-p applied by a full sort (the reference for the engines'
samplers). The gap metric itself is `megarl.algos.rollout_correction.logprob_diff_metrics`.

    batch, engine_lp = completions_to_batch(prompts, completions, pad_id)
    old, _ = actor.logprobs(batch, temperature=T)
    metrics = logprob_diff_metrics(engine_lp, old, batch.response_mask)
"""

from __future__ import annotations

import torch

from megarl.backends.protocol import SequenceBatch
from megarl.rollout.protocol import Completion


def completions_to_batch(
    prompts: list[list[int]], completions: list[Completion], pad_id: int = 0
) -> tuple[SequenceBatch, torch.Tensor]:
    """A `SequenceBatch` (prompt left-padded, response right-padded, as the Backend protocol
    lays it out) of the completions, and the engine's logprobs [B, L] in the response columns
    (0 outside the mask). Completions need logprobs."""
    rows = [(prompts[c.prompt_index], c) for c in completions]
    p_len = max(len(p) for p, _ in rows)
    r_len = max(max(len(c.token_ids) for _, c in rows), 1)
    b = len(rows)
    ids = torch.full((b, p_len + r_len), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p_len + r_len), dtype=torch.long)
    lps = torch.zeros((b, r_len), dtype=torch.float32)
    for i, (p, c) in enumerate(rows):
        if c.logprobs is None:
            raise ValueError("completions_to_batch needs completions with logprobs")
        ids[i, p_len - len(p) : p_len] = torch.tensor(p)
        mask[i, p_len - len(p) : p_len] = 1
        n = len(c.token_ids)
        ids[i, p_len : p_len + n] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, p_len : p_len + n] = 1
        lps[i, :n] = c.logprobs.float()
    return SequenceBatch(input_ids=ids, attention_mask=mask, response_length=r_len), lps


@torch.no_grad()
def recompute_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Logprobs [B, L] of the response tokens from one full forward of a megarl `Transformer`
    (no KV cache) in float32, under logits / temperature with the top-k / top-p filter applied
    by a full sort (the reference for the engine's sampler). Zero outside the response mask.
    temperature 0 means greedy: logprobs under temperature 1, unfiltered."""
    logits = model(batch.input_ids, attention_mask=batch.attention_mask).float()
    r_len = batch.response_length
    logits = logits[:, -r_len - 1 : -1]  # column P + j - 1 predicts response token j
    if temperature == 0:
        temperature, top_k, top_p = 1.0, -1, 1.0
    z = logits / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab or top_p < 1.0:
        z = _filter(z, top_k, top_p)
    lp = torch.log_softmax(z, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return torch.where(batch.response_mask.bool(), lp, torch.zeros_like(lp))


def _filter(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the kept set: the k largest, then the shortest prefix (by descending
    probability) whose preceding mass is < top_p."""
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices
    sz = z.gather(-1, order)
    keep = torch.ones_like(sz, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        keep[..., top_k:] = False
    if top_p < 1.0:
        p = torch.softmax(sz.masked_fill(~keep, float("-inf")), -1).double()
        keep &= (p.cumsum(-1) - p) < top_p
    out = torch.full_like(z, float("-inf"))
    return out.scatter(-1, order, sz.masked_fill(~keep, float("-inf")))
