"""Float64 references for the kernel tests: full [T, V] logits, computed the plain way."""

from __future__ import annotations

import torch


def make_inputs(T, H, V, dtype=torch.float32, seed=0, scale=1.0, edge_labels=True):
    """hidden [T, H], weight [V, H] (logits of order `scale`), labels [T] with 0 and V-1 used."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / max(H, 1) ** 0.5)
    labels = torch.randint(0, V, (T,), generator=g)
    if edge_labels and T >= 2:
        labels[0], labels[-1] = 0, V - 1
    return hidden.to(dtype), weight.to(dtype), labels


def reference(hidden, weight, labels, temperature=1.0):
    """(logprob, entropy) in float64 from the full logits; differentiable in float64 leaves."""
    logits = hidden.double() @ weight.double().t() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprob = logp.gather(1, labels[:, None].long()).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logprob, entropy


def reference_grads(hidden, weight, labels, temperature, a, b):
    """float64 (logprob, entropy, d/dhidden, d/dweight) of sum(a * logprob + b * entropy);
    a or b None means that output takes no part in the loss."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    lp, ent = reference(h, w, labels, temperature)
    loss = 0.0
    if a is not None:
        loss = loss + (lp * a.double()).sum()
    if b is not None:
        loss = loss + (ent * b.double()).sum()
    dh, dw = torch.autograd.grad(loss, [h, w])
    return lp.detach(), ent.detach(), dh, dw


def assert_close_scaled(got, want, rel, name, floor=1e-9):
    """|got - want| <= rel * max|want| + floor elementwise (errors relative to the tensor scale;
    ``floor`` covers references that are exactly 0, e.g. every gradient at V = 1)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bound = rel * float(want.abs().max()) + floor
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} (scale {float(want.abs().max()):.3e})"
