"""How far two fp32 computations of the same logprobs, gradients and AdamW steps may drift
apart (or one fp32 computation from a float64 reference), derived from the model's shape and
weights rather than measured on one CPU (whose summation order is one of many).

The rounding model throughout (probabilistic rounding analysis, Higham and Mary 2019): a sum
of n fp32 terms is off by about sqrt(n) u of their scale (u = 2^-24), with random sign; the
relative errors of successive products add (first order); the largest of N such errors is
lambda = sqrt(2 ln N) of them. Two fp32 computations that order their sums differently (two
layouts, an engine and a trainer) are each off from the exact value: their gap is at most the
sum (``sides`` = 2); an fp32 computation against a float64 reference carries one (``sides`` =
1)."""

from __future__ import annotations

import json
import math
from pathlib import Path

U32 = 2.0**-24  # fp32 unit roundoff


def extreme(count: int) -> float:
    """lambda = sqrt(2 ln N): the largest of ``count`` random-sign errors, in units of their
    scale (at least 1)."""
    return math.sqrt(2 * math.log(max(count, 3)))


def _config(policy: str | Path) -> dict:
    return json.loads((Path(policy) / "config.json").read_text())


def _weights(policy: str | Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(Path(policy).glob("*.safetensors")):
        weights.update(load_file(f))
    return weights


def _width(cfg: dict) -> int:
    """n: the most terms one layer sums per output (hidden, MLP, expert, shared-expert width)."""
    return max(cfg["hidden_size"], cfg.get("intermediate_size", 0),
               cfg.get("moe_intermediate_size", 0), cfg.get("shared_expert_intermediate_size", 0)
               or 0)


def _head_weight(weights: dict):
    """The output head: an LM head, a token-classification ``score``, or the tied embedding."""
    for name in ("lm_head.weight", "score.weight", "model.embed_tokens.weight"):
        if name in weights:
            return weights[name]
    raise KeyError("no lm_head.weight, score.weight or model.embed_tokens.weight")


def fp32_logit_err_scale(policy: str | Path, temperature: float = 1.0,
                         head: bool = False) -> float:
    """The scale of one fp32 forward's error on one logit of ``policy`` (against exact):
    |w_j| max|g| L sqrt(n) u / T (the derivation is `fp32_gap_bound`'s, one side, before its
    logsumexp factor). ``head``: count the head's own sum of H terms as one more product,
    L + 1 (it adds about sqrt(H / 2) / (L sqrt(n)) of the layers' error: 0.25 for the tiny
    test models, 0.14 for the demo's; `fp32_gap_bound` leaves it to its margin, the bounds
    added for gradients and against float64 count it). w_j: the rows of the LM head, of a
    token-classification ``score`` head, or of the tied embedding."""
    cfg, weights = _config(policy), _weights(policy)
    gain = float(weights["model.norm.weight"].abs().max())
    products = (cfg["num_hidden_layers"] + int(head)) * math.sqrt(_width(cfg)) * U32
    return float(_head_weight(weights).norm(dim=1).max()) * gain * products / temperature


def fp32_gap_scale(policy: str | Path, temperature: float = 1.0) -> float:
    """The scale of one token's gap between two fp32 forwards' logprobs of ``policy`` (the
    bound of `fp32_gap_bound` without its extreme-value factor lambda): each token's gap is a
    sum of random-sign roundings of at most this size, so the mean |gap| over any set of
    tokens is at most this too (the mean of |x| is at most its root mean square). The demo's
    policies: 5.3e-4 / 5.0 = 1.05e-4. Logprobs at ``temperature`` T are taken of the logits
    / T, whose errors are 1/T of the logits': the scale is divided by T."""
    return 2 * 2 * fp32_logit_err_scale(policy, temperature)


def fp32_gap_bound(policy: str | Path, tokens: int, temperature: float = 1.0) -> float:
    """The largest gap between two fp32 forwards' logprobs (an engine's and a trainer's, or two
    layouts') of the same weights and ``tokens`` response tokens, however each orders its sums:

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
    lam = extreme(tokens * _config(policy)["vocab_size"])
    return lam * fp32_gap_scale(policy, temperature)


def fp32_logit_gap_bound(policy: str | Path, tokens: int, temperature: float = 1.0) -> float:
    """The largest gap between two fp32 forwards' logits (of the logits / T at ``temperature``)
    of ``tokens`` positions: the bound of `fp32_gap_bound` without its factor 2 for the
    logsumexp (a logit is one of the terms the logprob's bound adds twice)."""
    return fp32_gap_bound(policy, tokens, temperature) / 2


def fp32_ref_logit_bound(policy: str | Path, tokens: int, temperature: float = 1.0) -> float:
    """The largest error of one fp32 forward's outputs (logits / T of an LM head, values or
    scores of a token-classification head) against a float64 reference, for ``tokens``
    positions: lambda x `fp32_logit_err_scale` with the head counted (one side, L + 1
    products), lambda over tokens x outputs. The tiny test models (hidden 64, MLP 128,
    2 layers, V 128; 20 tokens, T 0.7): 1.5e-5 to 1.8e-5."""
    lam = extreme(tokens * _head_weight(_weights(policy)).shape[0])
    return lam * fp32_logit_err_scale(policy, temperature, head=True)


def fp32_ref_gap_bound(policy: str | Path, tokens: int, temperature: float = 1.0,
                       spread: float = 2.0, entropy: float = 0.0) -> float:
    """The largest error of one fp32 forward's logprobs (default) or entropies against a
    float64 reference, for ``tokens`` positions:

    - a logprob z_y - logsumexp(z) moves by at most ``spread`` = 2 x the largest logit error
      (`fp32_ref_logit_bound`), an entropy H = -sum p log p by sum_v p_v |log p_v + H| of it:
      pass that, measured on the reference's distribution (at most the logits' range), as
      ``spread``;
    - plus the logsumexp's own sum of V terms: lambda sqrt(V) u, and for the entropy its sum
      of V terms p |log p| (their sum: ``entropy``, the reference's H): lambda sqrt(V) u H.

    The tiny test models (20 tokens, T 0.7): logprobs 3.2e-5 to 3.8e-5."""
    vocab = _config(policy)["vocab_size"]
    own = extreme(tokens * vocab) * math.sqrt(vocab) * U32 * (1 + entropy)
    return spread * fp32_ref_logit_bound(policy, tokens, temperature) + own


# ---------------------------------------------------------------------------- gradients


def fp32_grad_rel_scale(policy: str | Path, tokens: int, temperature: float = 1.0) -> float:
    """The scale of one fp32 backward's error on a gradient entry of ``policy``, relative to
    the largest entry of its tensor, for a loss of ``tokens`` per-token terms of the logprobs
    (and entropies) at ``temperature``. A weight's gradient sum_t dy_t x_t^T multiplies, per
    token, the backward signal dy_t at the weight's output and the forward input x_t:

    - dlogprob / dz = onehot - p (entropy: -p (log p + H)): a logit error dz moves p by
      p (dz_v - sum p dz), twice the largest logit error relative to the term:
      2 `fp32_logit_err_scale` (T and the head included);
    - x_t carries the layers before the weight, dy_t the head (a sum of V terms), the final
      norm and the layers after it (sums of at most n terms each), and the product one more:
      L + 1 products of at most max(n, V) terms, (L + 1) sqrt(max(n, V)) u (the same model
      as tests/trainer/test_rollout_correction_trainer.py's `gradient_rounding`);
    - the sum over the tokens: sqrt(tokens) u of the terms' scale.

    The per-token terms' errors have random signs, so an entry's error is this scale times the
    root sum of squares of its terms; that is about the size of the entry itself (a sum of
    random-sign terms), at most of the tensor's largest entry. The tiny test models
    (2 layers, n = V = 128; 40 tokens, T 0.7): 1.0e-5."""
    cfg = _config(policy)
    n = max(_width(cfg), cfg["vocab_size"])
    products = (cfg["num_hidden_layers"] + 1) * math.sqrt(n) * U32
    logits = 2 * fp32_logit_err_scale(policy, temperature, head=True)
    return logits + products + math.sqrt(tokens) * U32


def fp32_grad_rel_bound(policy: str | Path, tokens: int, temperature: float = 1.0,
                        sides: int = 2) -> float:
    """The largest gradient error, relative to each tensor's largest entry, of ``sides`` fp32
    backwards (module docstring): lambda (over all N parameters) x sides x
    `fp32_grad_rel_scale`. The tiny test models (about 1e5 parameters, lambda 4.8; 40 tokens,
    T 0.7): 5.0e-5 for one side, 9.9e-5 for two."""
    count = sum(t.numel() for t in _weights(policy).values())
    return extreme(count) * sides * fp32_grad_rel_scale(policy, tokens, temperature)


def fp32_grad_norm_bound(norm: float, largest: float, count: int, rel: float,
                         sides: int = 2) -> float:
    """The largest gap between ``sides`` fp32 computations' global gradient norms (``norm``,
    over ``count`` entries, the largest ``largest``) whose entries are off by at most ``rel``
    of their tensor's largest entry (`fp32_grad_rel_bound`, sides included):

    - |d||g||| = |sum g_i dg_i| / ||g||: random-sign errors add as sqrt(sum g_i^2 dg_i^2)
      <= max|dg| ||g||, so the norm moves by at most rel x ``largest``;
    - the sum of the ``count`` squares: sqrt(count) u of their sum ||g||^2, half of it
      relative on the square root, times lambda (over the ``count`` roundings) per side.

    The tiny models' step (norm 9.3, largest entry 0.7, 1e5 entries, rel 9.9e-5): 7e-5 + 8.6e-4."""
    return rel * largest + sides * extreme(count) * 0.5 * math.sqrt(count) * U32 * norm


# ---------------------------------------------------------------------------- AdamW


class AdamErrorBound:
    """An entry-wise bound on |w_a - w_b| of two AdamW runs (torch.optim.AdamW's update)
    from the same weights, whose gradients differ by at most ``delta`` (entry-wise) per step.
    It follows a reference run's gradients g (after clipping), a float64 copy of its moments,
    and for each step k (a_j, b_j: the bias-corrected EMA weights of step j in m^ and v^):

        m^ = sum_j a_j g_j,  s = sqrt(v^) = sqrt(sum_j b_j g_j^2),  u = m^ / (s + eps)
        |dm^| <= Dm = sum_j a_j delta_j;  |ds| <= Ds = sqrt(sum_j b_j delta_j^2)  (Minkowski)
        |du| <= Dm / (s_lo + eps) + |m^| Ds / ((s_lo + eps)(s + eps)),  s_lo = max(s - Ds, 0)

    capped at 2 C_k (|u| <= C_k = sqrt(sum_j a_j^2 / b_j) by Cauchy-Schwarz, for both runs).
    The weights: w <- w (1 - lr wd) - lr u, so |dw| <- |dw| (1 - lr wd) + lr |du| plus the
    two fp32 roundings of each update (u |w| each, per side). At step 1 with |g| >> eps
    this is 2 lr delta / |g|, where the exact first-order change is lr eps delta / |g|^2:
    Adam's update divides by sqrt(v) + eps, so a gradient error moves the weights most where
    the gradient itself is near 0, up to lr delta / eps; an entry whose gradient is well above
    delta moves by a small fraction of lr. A planted optimizer or gradient bug moves the
    entries with large gradients by O(lr): far outside this bound there.

    ``delta`` must also cover what the runs' earlier weight gap does to this step's gradients
    (the caller measures it: see tests/dist/torch_backend_worker.py)."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, sides: int = 2) -> None:
        self.b1, self.b2 = betas
        self.eps, self.wd, self.sides = eps, weight_decay, sides
        self.k = 0
        self._a: list[float] = []  # EMA weights of the steps so far, before bias correction
        self._b: list[float] = []
        self.m: dict = {}
        self.v: dict = {}
        self.dm: dict = {}
        self.dv: dict = {}
        self.bound: dict = {}

    def step(self, lr: float, grads: dict, delta: dict, weights: dict) -> dict:
        """One AdamW step at ``lr``: ``grads`` the reference's gradients as the optimizer saw
        them, ``delta`` an entry-wise bound (tensor or float per name) on the other run's
        gradient minus them, ``weights`` the reference weights after the step. Returns the
        bound so far ({name: float64 tensor})."""
        import torch

        self.k += 1
        b1, b2 = self.b1, self.b2
        self._a = [x * b1 for x in self._a] + [1 - b1]
        self._b = [x * b2 for x in self._b] + [1 - b2]
        c1, c2 = 1 - b1**self.k, 1 - b2**self.k
        cap = 2 * math.sqrt(sum((a / c1) ** 2 / (b / c2) for a, b in zip(self._a, self._b)))
        for name, g in grads.items():
            g = g.detach().double().cpu()
            d = torch.as_tensor(delta[name], dtype=torch.float64).expand_as(g)
            zero = torch.zeros_like(g)
            self.m[name] = b1 * self.m.get(name, zero) + (1 - b1) * g
            self.v[name] = b2 * self.v.get(name, zero) + (1 - b2) * g * g
            self.dm[name] = b1 * self.dm.get(name, zero) + (1 - b1) * d
            self.dv[name] = b2 * self.dv.get(name, zero) + (1 - b2) * d * d
            m_hat, s = self.m[name] / c1, (self.v[name] / c2).sqrt()
            dm_hat, ds = self.dm[name] / c1, (self.dv[name] / c2).sqrt()
            lo = (s - ds).clamp(min=0) + self.eps
            du = (dm_hat / lo + m_hat.abs() * ds / (lo * (s + self.eps))).clamp(max=cap)
            w = weights[name].detach().double().cpu().abs()
            self.bound[name] = (self.bound.get(name, zero) * (1 - lr * self.wd) + lr * du
                                + self.sides * 2 * U32 * w)
        return self.bound


def bound_ratio(a: dict, b: dict, bound: dict) -> float:
    """max over all entries of |a - b| / bound (<= 1: within the bound); names must agree."""
    if set(a) != set(b) or set(a) != set(bound):
        raise AssertionError(f"name mismatch: {sorted((set(a) ^ set(b)) | (set(a) ^ set(bound)))}")
    return max(float(((a[k].double().cpu() - b[k].double().cpu()).abs()
                      / bound[k].clamp(min=1e-300)).max()) for k in a)
