"""Next-token sampling shared by the torch engine: temperature, top-k, top-p, greedy.

No full-vocabulary ``torch.multinomial`` and no per-element random noise: every row draws ONE
uniform ``u`` from a counter-based hash of (seed, request index, sample index, token position)
(`counter_uniforms`) and picks its token by inverse CDF. The noise therefore depends only on
which token of which sample of which request is being drawn, never on the batch it is drawn
in or the cache slot it sits in, so continuous batching reproduces one-by-one generation.

Sampling distribution (the one the returned logprobs refer to), in the order HF and vLLM apply
the filters:

    z = logits / temperature                          (fp32)
    top-k (k > 0): keep the k largest z (exactly k; ties at the k-th value broken by topk)
    top-p (< 1):   over the kept tokens in descending probability, keep token i while the mass
                   of the tokens before it is < top_p (the first token is always kept)
    p = softmax(z) restricted to the kept set and renormalised

Greedy (``SamplingParams.is_greedy``) returns the argmax of the logits and, as its logprob, the
argmax's log-probability under softmax(logits) at temperature 1 with no filter (what a trainer
recomputes with temperature 1); greedy has no sampling distribution of its own.
"""

from __future__ import annotations

import torch

from megarl.rollout.protocol import SamplingParams

_MASK32 = 0xFFFFFFFF
_BLOCK = 1024  # two-level inverse CDF: block sums, then a cumsum inside one block
_TOP_P_FIRST_K = 256  # top-p without top-k: candidates grow x8 from here until they hold top_p


# ------------------------------------------------------------------------------- the noise


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (c split in halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer bijection with full avalanche (the 'lowbias32' finaliser)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(
    seed: int, request: torch.Tensor, sample: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of its (seed, request, sample, position).

    seed: Python int (any size; the low 64 bits are used). request / sample / position: int64
    tensors [n] (position: index of the generated token, 0 for the first). Returns float64 [n]
    with 53 random bits. Equal, bit for bit, to `uniform_at(noise_key(...), position)`.
    """
    device = request.device
    s = int(seed) & ((1 << 64) - 1)
    h = torch.full(request.shape, (s & _MASK32) ^ 0x9E3779B9, dtype=torch.int64, device=device)
    h = _mix32(h)
    h = _mix32(h ^ (s >> 32))
    for part in (request, sample, position):
        h = _mix32(h ^ (part.to(torch.int64) & _MASK32))
    a = _mix32(h ^ 0x68E31DA4) >> 5  # 27 bits
    b = _mix32(h ^ 0xB5297A4D) >> 6  # 26 bits
    return (a * (1 << 26) + b).to(torch.float64) * (1.0 / (1 << 53))


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_key(seed: int, request: int, sample: int) -> int:
    """The hash state of (seed, request, sample) that `uniform_at` finishes per position (the
    engine computes it once per sequence: a decode step then costs 3 mixes per row in Python,
    cheaper than ~60 tensor ops for the batch sizes of a CPU engine)."""
    s = int(seed) & ((1 << 64) - 1)
    h = _mix32_int((s & _MASK32) ^ 0x9E3779B9)
    h = _mix32_int(h ^ (s >> 32))
    h = _mix32_int(h ^ (int(request) & _MASK32))
    return _mix32_int(h ^ (int(sample) & _MASK32))


def uniform_at(key: int, position: int) -> float:
    """The uniform of generated token ``position`` of the sequence with `noise_key` ``key``."""
    h = _mix32_int(key ^ (int(position) & _MASK32))
    a = _mix32_int(h ^ 0x68E31DA4) >> 5
    b = _mix32_int(h ^ 0xB5297A4D) >> 6
    return (a * (1 << 26) + b) * (1.0 / (1 << 53))


# ------------------------------------------------------------------------- inverse CDF


def _below(total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """u * total, kept strictly below total (u < 1, but the product may round up to it;
    total * (1 - 2^-52) rounds to at least one ulp below a positive total)."""
    return torch.minimum(u * total, total * (1.0 - 2.0**-52))


def _inverse_cdf_full(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token index [n] drawn from each row of ``probs`` [n, V] (need not sum to 1) with the
    uniforms ``u`` [n]. Small V: one float64 cumsum. Large V: the block holding u * total is
    found from block sums (float64 cumsum over V / 1024 blocks), then the token inside that
    block from a cumsum of 1024 entries. ``searchsorted(right=True)`` of a target strictly
    below the total lands on an entry whose CDF step is positive: a zero-probability token is
    never drawn."""
    n, vocab = probs.shape
    if vocab <= 2 * _BLOCK:
        cdf = probs.to(torch.float64).cumsum(-1)
        return torch.searchsorted(cdf, _below(cdf[:, -1:], u[:, None]), right=True)[:, 0]
    n_full = vocab // _BLOCK
    sums = [probs[:, : n_full * _BLOCK].reshape(n, n_full, _BLOCK).sum(-1)]
    if vocab % _BLOCK:
        sums.append(probs[:, n_full * _BLOCK :].sum(-1, keepdim=True))
    block_sums = torch.cat(sums, dim=1).to(torch.float64)  # [n, nb]
    cdf = block_sums.cumsum(-1)
    target = _below(cdf[:, -1:], u[:, None])
    block = torch.searchsorted(cdf, target, right=True)  # [n, 1]
    before = cdf.gather(1, (block - 1).clamp(min=0)) * (block > 0)
    frac = ((target - before) / block_sums.gather(1, block)).clamp(max=1.0 - 2.0**-52)

    cols = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=vocab - 1)).to(torch.float64)
    inside = inside.masked_fill(cols >= vocab, 0.0).cumsum(-1)
    j = torch.searchsorted(inside, frac * inside[:, -1:], right=True)
    return (block * _BLOCK + j)[:, 0]


def _inverse_cdf_sorted(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column [n] drawn from non-negative ``weights`` [n, k] (zeros never drawn)."""
    cdf = weights.to(torch.float64).cumsum(-1)
    return torch.searchsorted(cdf, _below(cdf[:, -1:], u[:, None]), right=True)[:, 0]


# ------------------------------------------------------------------------- the sampler


def check_sampling_params(sampling: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the bad field of ``sampling``."""
    if not isinstance(sampling.n, int) or sampling.n < 1:
        raise ValueError(f"SamplingParams.n must be an int >= 1, got {sampling.n!r}")
    if sampling.temperature < 0 or sampling.temperature != sampling.temperature:
        raise ValueError(
            f"SamplingParams.temperature must be >= 0 (0 = greedy), got {sampling.temperature!r}"
        )
    if not (0.0 < sampling.top_p <= 1.0):
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {sampling.top_p!r}")
    top_k = sampling.top_k
    if not isinstance(top_k, int) or (top_k < 1 and top_k not in (0, -1)):
        raise ValueError(
            f"SamplingParams.top_k must be -1 (off) or a positive int, got {sampling.top_k!r}"
        )
    if not isinstance(sampling.max_new_tokens, int) or sampling.max_new_tokens < 1:
        raise ValueError(
            f"SamplingParams.max_new_tokens must be an int >= 1, got {sampling.max_new_tokens!r}"
        )
    bad = [t for t in sampling.stop_token_ids if not (0 <= int(t) < vocab_size)]
    if bad:
        raise ValueError(
            f"SamplingParams.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
        )


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits: [n, V] any float dtype (computed in fp32). u: float64 [n] uniforms in [0, 1) (ignored
    when greedy). Returns (token ids int64 [n], logprob float32 [n] of each token under the
    sampling distribution described in the module docstring).
    """
    logits = logits.float()
    if sampling.is_greedy:
        token = logits.argmax(-1)
        probs = torch.softmax(logits, -1)
        return token, probs.gather(1, token[:, None])[:, 0].log()
    if u is None:
        raise ValueError("sample_next needs uniforms u unless sampling is greedy")
    vocab = logits.shape[-1]
    z = logits if sampling.temperature == 1.0 else logits / sampling.temperature
    probs = torch.softmax(z, -1)
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else 0
    if not top_k and sampling.top_p >= 1.0:
        token = _inverse_cdf_full(probs, u)
        return token, probs.gather(1, token[:, None])[:, 0].log()

    if top_k:
        vals, idx = probs.topk(top_k, dim=-1)  # sorted, descending
        vals = vals / vals.sum(-1, keepdim=True)
    else:
        vals, idx = _top_p_candidates(probs, sampling.top_p)
    if sampling.top_p < 1.0:
        before = vals.to(torch.float64).cumsum(-1) - vals.to(torch.float64)
        vals = torch.where(before < sampling.top_p, vals, torch.zeros_like(vals))
    kept = vals.to(torch.float64).sum(-1)
    j = _inverse_cdf_sorted(vals, u)
    chosen = vals.gather(1, j[:, None])[:, 0].to(torch.float64)
    return idx.gather(1, j[:, None])[:, 0], (chosen.log() - kept.log()).float()


def _top_p_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fewest top tokens (sorted descending) whose mass reaches ``top_p`` in every row,
    found by topk with k growing x8 (a full sort only when the nucleus is that wide)."""
    vocab = probs.shape[-1]
    k = min(_TOP_P_FIRST_K, vocab)
    while True:
        vals, idx = probs.topk(k, dim=-1)
        if k == vocab or bool((vals.to(torch.float64).sum(-1) >= top_p).all()):
            return vals, idx
        k = min(k * 8, vocab)
