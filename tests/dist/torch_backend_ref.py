"""Independent references for the TorchBackend checks: a plain single-process `Transformer`
(no backend code: padded batch, attention mask, autograd on the whole batch) and
torch.optim.AdamW + clip_grad_norm_, plus the test batch and loss used on both sides."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fp32_bounds

from fp32_bounds import AdamErrorBound, fp32_grad_norm_bound, fp32_grad_rel_bound  # noqa: E402

from megarl.backends.protocol import SequenceBatch
from megarl.models import load_model

TEMPERATURE = 0.7
ENT_COEF = 0.01


def make_batch(seed: int = 0, B: int = 6, P: int = 6, L: int = 5, vocab: int = 128):
    """B rows: left-padded prompts (1..P tokens), right-padded responses (1..L tokens), and
    per-token ``adv`` / ``mask`` tensors for the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + L), generator=g)
    mask = torch.zeros(B, P + L, dtype=torch.long)
    for i in range(B):
        p = 1 + (i * 5 + 2) % P
        r = 1 + (i * 3 + 1) % L
        mask[i, P - p : P + r] = 1
    ids = ids * mask
    adv = torch.randn(B, L, generator=g)
    resp = mask[:, P:].float()
    return SequenceBatch(ids, mask, L, {"adv": adv, "mask": resp, "returns": torch.randn(B, L, generator=g)})


def policy_loss(out, mb: SequenceBatch, total_tokens: float, dp: int):
    """-(logprob * adv) - ENT_COEF * entropy, token-mean over the WHOLE batch (global
    normaliser), times dp (the backend averages over DP ranks)."""
    m = mb.tensors["mask"]
    per_tok = -(out.logprob * mb.tensors["adv"]) - ENT_COEF * out.entropy
    loss = (per_tok * m).sum() / total_tokens * dp
    return loss, {"tokens": float(m.sum()) / total_tokens * dp}


def value_loss(out, mb: SequenceBatch, total_tokens: float, dp: int):
    m = mb.tensors["mask"]
    loss = ((out.values - mb.tensors["returns"]) ** 2 * m).sum() / total_tokens * dp
    return loss, {"tokens": float(m.sum()) / total_tokens * dp}


def reference_model(path: str, head: str = "lm", num_labels=None, **kw):
    return load_model(path, head=head, num_labels=num_labels, **kw)


def ref_logits(model, batch: SequenceBatch) -> torch.Tensor:
    """[B, P+L, V] logits of the padded batch (HF positions cumsum(mask) - 1)."""
    return model(batch.input_ids, attention_mask=batch.attention_mask)


def ref_logprob_entropy(model, batch: SequenceBatch, temperature: float = TEMPERATURE):
    """(logprob [B, L], entropy [B, L]) from the padded forward, 0 outside the response."""
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    logits = ref_logits(model, batch)[:, P - 1 : -1].double() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch.input_ids[:, P:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    m = batch.attention_mask[:, P:].double()
    return lp * m, ent * m


def ref_values(model, batch: SequenceBatch) -> torch.Tensor:
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    v = ref_logits(model, batch)[:, P - 1 : -1, 0]
    return v * batch.attention_mask[:, P:]


def ref_scores(model, batch: SequenceBatch) -> torch.Tensor:
    L = batch.response_length
    return ref_logits(model, batch)[:, -L:] * batch.attention_mask[:, -L:, None]


class _Out:
    def __init__(self, model, batch, temperature):
        if model.head == "lm":
            lp, ent = ref_logprob_entropy(model, batch, temperature)
            self.logprob, self.entropy = lp.float(), ent.float()
        else:
            self.values = ref_values(model, batch).float()


def ref_loss(model, batch: SequenceBatch, kind: str = "policy", temperature=TEMPERATURE):
    total = float(batch.tensors["mask"].sum())
    fn = policy_loss if kind == "policy" else value_loss
    return fn(_Out(model, batch, temperature), batch, total, 1)[0]


def ref_grads(model, batch: SequenceBatch, kind: str = "policy") -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ref_loss(model, batch, kind).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def ref_adamw_bound(path: str, batch: SequenceBatch, other: list[dict[str, torch.Tensor]], *,
                    lr: float, eps: float, weight_decay: float, grad_clip: float):
    """torch.optim.AdamW with clip_grad_norm_ on the whole batch, on a fresh reference model of
    ``path``, one step per entry of ``other`` (the weights another fp32 run of the same steps
    had after each), plus how far that run may be from it (tests/fp32_bounds.py): returns
    (reference weights, pre-clip grad norms, norm bounds, entry-wise weight bound {name:
    tensor}).

    Step k's gradients of the two runs differ by
    - rounding: `fp32_grad_rel_bound` (two fp32 backwards, relative to each tensor's largest
      entry) x that entry, from the model's shape and weights;
    - from step 2, the weight gap the earlier steps left: measured as the float64 gradients
      at the other run's and at the reference's weights before step k, entry by entry;
    and after clipping by min(1, clip / norm) by that coefficient, plus the coefficient's own
    error (the norm bound / norm) times the clipped gradient. The pre-clip norm gap is
    `fp32_grad_norm_bound` plus the float64 norms' gap at the two weight sets.
    `AdamErrorBound` carries the gradient bound through AdamW's moments into the weights."""
    model = reference_model(path)
    params = dict(model.named_parameters())
    count = sum(p.numel() for p in params.values())
    tokens = int(batch.attention_mask.sum())
    rel = fp32_grad_rel_bound(path, tokens, TEMPERATURE, sides=2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=weight_decay)
    tracker = AdamErrorBound(eps=eps, weight_decay=weight_decay, sides=2)
    norms, norm_bounds = [], []
    for k in range(len(other)):
        if k:  # what the weight gap so far does to this step's gradients (float64, exact)
            mine = {n: p.detach().clone() for n, p in params.items()}
            g_other, n_other = _f64_grads(path, {**mine, **other[k - 1]}, batch)
            g_mine, n_mine = _f64_grads(path, mine, batch)
            carried = {n: (g_other[n] - g_mine[n]).abs() for n in g_mine}
            carried_norm = abs(n_other - n_mine)
        else:
            carried, carried_norm = {n: 0.0 for n in params}, 0.0
        opt.zero_grad(set_to_none=True)
        ref_loss(model, batch).backward()
        raw = {n: p.grad.detach().double().clone() for n, p in params.items()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        largest = max(float(g.abs().max()) for g in raw.values())
        norm_bound = fp32_grad_norm_bound(norm, largest, count, rel) + carried_norm
        coef = min(1.0, grad_clip / (norm + 1e-6))
        clipped = {n: p.grad.detach().double().clone() for n, p in params.items()}
        delta = {n: coef * (rel * float(raw[n].abs().max()) + carried[n])
                 + (clipped[n].abs() * norm_bound / norm if coef < 1 else 0.0)
                 for n in params}
        opt.step()
        bound = tracker.step(lr, clipped, delta, dict(model.named_parameters()))
        norms.append(norm)
        norm_bounds.append(norm_bound)
    state = model.state_dict()
    return state, norms, norm_bounds, bound


def _f64_grads(path: str, weights: dict[str, torch.Tensor], batch: SequenceBatch):
    """float64 gradients of `ref_loss` at ``weights`` (HF names) and their global norm."""
    model = reference_model(path)
    model.load_state_dict({n: w.detach().cpu() for n, w in weights.items()}, strict=False)
    model.double()
    ref_loss(model, batch).backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    return grads, float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))


def max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"key mismatch: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
