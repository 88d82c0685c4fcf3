"""How far two fp32 computations of the same logprobs may drift apart, derived from the model's
shape and weights rather than measured on one CPU (whose summation order is one of many)."""

from __future__ import annotations

import json
import math
from pathlib import Path

U32 = 2.0**-24  # fp32 unit roundoff


def fp32_gap_scale(policy: str | Path, temperature: float = 1.0) -> float:
    """The scale of one token's gap between two fp32 forwards' logprobs of ``policy`` (the
    bound of `fp32_gap_bound` without its extreme-value factor lambda): each token's gap is a
    sum of random-sign roundings of at most this size, so the mean |gap| over any set of
    tokens is at most this too (the mean of |x| is at most its root mean square). The demo's
    policies: 5.3e-4 / 5.0 = 1.05e-4. Logprobs at ``temperature`` T are taken of the logits
    / T, whose errors are 1/T of the logits': the scale is divided by T."""
    from safetensors.torch import load_file

    policy = Path(policy)
    cfg = json.loads((policy / "config.json").read_text())
    weights = {}
    for f in sorted(policy.glob("*.safetensors")):
        weights.update(load_file(f))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    gain = float(weights["model.norm.weight"].abs().max())
    n = max(cfg["hidden_size"], cfg.get("intermediate_size", 0),
            cfg.get("moe_intermediate_size", 0), cfg.get("shared_expert_intermediate_size", 0)
            or 0)
    hidden_err = cfg["num_hidden_layers"] * math.sqrt(n) * U32
    return 2 * 2 * float(head.norm(dim=1).max()) * gain * hidden_err / temperature


def fp32_gap_bound(policy: str | Path, tokens: int, temperature: float = 1.0) -> float:
    """The largest gap between two fp32 forwards' logprobs (an engine's and a trainer's, or two
    layouts') of the same weights and ``tokens`` response tokens, however each orders its sums
    (probabilistic rounding analysis, Higham and Mary 2019: a sum of n fp32 terms is off by
    about sqrt(n) u of their scale, with random sign):

    - each of the L layers sums at most n terms per output (n: the longest of hidden, MLP,
      expert and shared-expert widths), so the last hidden state is off by a relative
      L sqrt(n) u (first order: the layers' errors add);
    - the final RMSNorm gives it a norm of at most sqrt(H) max|g| (g: the norm's gain); a
      logit w_j . h then moves by |w_j| max|g| L sqrt(n) u (the error's direction is random:
      its projection on w_j is 1/sqrt(H) of its norm);
    - a logprob z_t - logsumexp(z) moves by at most twice the largest logit error, and the
      gap of two forwards by at most the sum of their errors: x 2;
    - the largest of tokens x V such errors is lambda = sqrt(2 ln(tokens V)) of them.

    The demo's policies (L 4, n 384, V 384, 768 tokens: lambda 5.0; max|w_j| 2.99, max|g|
    1.87, the MoE one upcycled from the dense one with its embeddings and norms) give
    4 x 5.0 x 2.99 x 1.87 x 4 x sqrt(384) x 2^-24 = 5.3e-4. At sampling ``temperature`` T the
    logprobs are of the logits / T: the bound is divided by T (1.05e-3 at T = 0.5)."""
    cfg = json.loads((Path(policy) / "config.json").read_text())
    lam = math.sqrt(2 * math.log(tokens * cfg["vocab_size"]))
    return lam * fp32_gap_scale(policy, temperature)


def fp32_logit_gap_bound(policy: str | Path, tokens: int) -> float:
    """The largest gap between two fp32 forwards' logits of ``tokens`` positions: the bound of
    `fp32_gap_bound` without its factor 2 for the logsumexp (a logit is one of the terms the
    logprob's bound adds twice)."""
    return fp32_gap_bound(policy, tokens) / 2
