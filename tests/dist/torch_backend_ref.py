"""Independent references for the TorchBackend checks: a plain single-process `Transformer`
(no backend code: padded batch, attention mask, autograd on the whole batch) and
torch.optim.AdamW + clip_grad_norm_, plus the test batch and loss used on both sides."""

from __future__ import annotations

import torch

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


def ref_adamw(model, batch: SequenceBatch, steps: int, kind: str = "policy", *, lr=1e-3,
              eps=1e-8, weight_decay=0.01, grad_clip=1.0) -> list[float]:
    """``steps`` AdamW updates on the whole batch; returns the pre-clip grad norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=weight_decay)
    norms = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_loss(model, batch, kind).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        opt.step()
    return norms


def max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"key mismatch: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
