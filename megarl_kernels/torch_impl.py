"""Chunked PyTorch implementation (CPU, and GPUs without Triton).

Logits ``z = hidden @ weight.T / temperature`` are only ever formed for one tile of
``token_chunk x vocab_chunk`` entries (float32), so the extra memory is that tile (plus, in the
backward pass, a second tile buffer and a float32 ``[vocab_chunk, H]`` accumulator when the weight
is not float32) on top of the gradients themselves.

Loop order is vocabulary tile (outer) x token chunk (inner): a weight tile is read (and, for
bf16, up-cast) once per pass, and the running softmax statistics of all T tokens are tiny [T]
vectors.

- ``forward_stats``: one matmul per tile, online max / sum-exp / shifted entropy sum
  (see ``_common``), the label logit gathered when the label falls in the tile.
- ``backward_grads``: recomputes each logit tile, forms ``g = dL/dz`` in place
  (``g = glp (onehot - p) - gent p (logp + H)``), then ``dh[s:e] += g @ W_tile / temp`` and
  ``dW_tile += g.T @ h_c / temp`` with in-place ``addmm_`` (a ``dW += g.t() @ h`` would allocate a
  ``[V, H]`` temporary per chunk).

With ``MEGARL_KERNELS_COMPILE=1`` (or ``set_torch_compile(True)``) the per-tile element-wise math
is ``torch.compile``d (fused C++ loops on CPU); the matmuls stay BLAS calls.
"""

from __future__ import annotations

import os

import torch

from megarl_kernels._common import NEG_INIT

DEFAULT_TOKEN_CHUNK = 512
DEFAULT_VOCAB_CHUNK = 4096

_COMPILE = os.environ.get("MEGARL_KERNELS_COMPILE", "0") == "1"
_compiled: dict[str, object] = {}


def set_torch_compile(enabled: bool) -> None:
    """Turn ``torch.compile`` of the per-tile element-wise math on or off (process-wide)."""
    global _COMPILE
    _COMPILE = bool(enabled)


def _fwd_tile_eager(z, m, s, t):
    """Update running stats ``m, s, t`` [n] with the scaled logit tile ``z`` [n, nv] (clobbered)."""
    m_new = torch.maximum(m, z.amax(dim=1))
    z.sub_(m_new[:, None])
    e = torch.exp(z)
    s_tile = e.sum(dim=1)
    t_tile = e.mul_(z).sum(dim=1)
    shift = m - m_new
    scale = torch.exp(shift)
    return m_new, s * scale + s_tile, scale * (t + s * shift) + t_tile


def _fwd_tile_math(z, m, s, t):
    m_new = torch.maximum(m, z.amax(dim=1))
    d = z - m_new[:, None]
    e = torch.exp(d)
    shift = m - m_new
    scale = torch.exp(shift)
    return m_new, s * scale + e.sum(dim=1), scale * (t + s * shift) + (e * d).sum(dim=1)


def _bwd_tile_eager(z, lse, ent, glp, gent):
    """``g = dL/dz`` [n, nv] for the scaled logit tile ``z`` (overwritten; returned). The label
    term ``+glp`` at the label column is added by the caller."""
    z.sub_(lse[:, None])  # log p
    if gent is None:
        return z.exp_().mul_(-glp[:, None])
    p = torch.exp(z)
    # -(glp + gent (logp + H)) = logp * (-gent) - (glp + gent H)
    offset = gent * ent if glp is None else glp + gent * ent
    z.mul_(-gent[:, None]).sub_(offset[:, None])
    return p.mul_(z)


def _bwd_tile_math(z, lse, ent, glp, gent):
    logp = z - lse[:, None]
    p = torch.exp(logp)
    if gent is None:
        return -p * glp[:, None]
    coef = gent[:, None] * (logp + ent[:, None])
    if glp is not None:
        coef = coef + glp[:, None]
    return -p * coef


def _tile_fn(name: str):
    if not _COMPILE:
        return _fwd_tile_eager if name == "fwd" else _bwd_tile_eager
    if name not in _compiled:
        fn = _fwd_tile_math if name == "fwd" else _bwd_tile_math
        _compiled[name] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _compiled[name]


def _chunks(token_chunk: int | None, vocab_chunk: int | None) -> tuple[int, int]:
    return token_chunk or DEFAULT_TOKEN_CHUNK, vocab_chunk or DEFAULT_VOCAB_CHUNK


def _scaled_hidden(hidden: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """float32 ``hidden / temperature`` (no copy for float32 input at temperature 1)."""
    h = hidden.float()
    return h if inv_temp == 1.0 else h * inv_temp


def _label_slot(labels: torch.Tensor, v0: int, nv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column index clamped into the tile [n, 1], whether the label lies in the tile [n])."""
    rel = labels - v0
    inside = (rel >= 0) & (rel < nv)
    return rel.clamp(0, nv - 1)[:, None], inside


def forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_temp: float,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial softmax statistics of this weight shard, each ``[1, T]`` float32.

    ``labels`` are local to the shard (``global id - vocab_start``; out-of-range ids simply do not
    contribute to ``zl``).
    """
    n_tok, n_voc = hidden.shape[0], weight.shape[0]
    tc, vc = _chunks(token_chunk, vocab_chunk)
    dev = hidden.device
    h = _scaled_hidden(hidden, inv_temp)
    m = torch.full((n_tok,), NEG_INIT, dtype=torch.float32, device=dev)
    s = torch.zeros(n_tok, dtype=torch.float32, device=dev)
    t = torch.zeros(n_tok, dtype=torch.float32, device=dev)
    zl = torch.zeros(n_tok, dtype=torch.float32, device=dev)
    buf = torch.empty(min(tc, n_tok) * min(vc, n_voc), dtype=torch.float32, device=dev)
    tile = _tile_fn("fwd")
    for v0 in range(0, n_voc, vc):
        v1 = min(v0 + vc, n_voc)
        w = weight[v0:v1].float()
        for t0 in range(0, n_tok, tc):
            t1 = min(t0 + tc, n_tok)
            z = buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0)
            torch.mm(h[t0:t1], w.t(), out=z)
            idx, inside = _label_slot(labels[t0:t1], v0, v1 - v0)
            zl[t0:t1] += torch.where(inside, z.gather(1, idx).squeeze(1), 0.0)
            m[t0:t1], s[t0:t1], t[t0:t1] = tile(z, m[t0:t1], s[t0:t1], t[t0:t1])
    return m[None], s[None], t[None], zl[None]


def backward_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    glp: torch.Tensor | None,
    gent: torch.Tensor | None,
    inv_temp: float,
    need_dh: bool,
    need_dw: bool,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``sum(glp * logprob + gent * entropy)`` w.r.t. hidden and this weight shard.

    Returns ``(dh [T, H] float32 — this shard's part, to be summed over TP ranks — or None,
    dW [V_local, H] in the weight's dtype or None)``. ``glp``/``gent`` are float32 ``[T]`` or
    None (no gradient from that output).
    """
    n_tok, n_voc = hidden.shape[0], weight.shape[0]
    tc, vc = _chunks(token_chunk, vocab_chunk)
    dev = hidden.device
    h = _scaled_hidden(hidden, inv_temp)
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_dh else None
    dw = None
    if need_dw:
        dw = torch.zeros_like(weight) if weight.dtype == torch.float32 else torch.empty_like(weight)
    if glp is None and gent is None:
        return dh, None if dw is None else dw.zero_()
    buf = torch.empty(min(tc, n_tok) * min(vc, n_voc), dtype=torch.float32, device=dev)
    tile = _tile_fn("bwd")
    for v0 in range(0, n_voc, vc):
        v1 = min(v0 + vc, n_voc)
        w = weight[v0:v1].float()
        dw_acc = None
        if dw is not None:
            dw_acc = dw[v0:v1] if dw.dtype == torch.float32 else torch.zeros_like(w)
        for t0 in range(0, n_tok, tc):
            t1 = min(t0 + tc, n_tok)
            z = buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0)
            torch.mm(h[t0:t1], w.t(), out=z)
            g = tile(
                z,
                lse[t0:t1],
                entropy[t0:t1],
                None if glp is None else glp[t0:t1],
                None if gent is None else gent[t0:t1],
            )
            if glp is not None:
                idx, inside = _label_slot(labels[t0:t1], v0, v1 - v0)
                g.scatter_add_(1, idx, torch.where(inside, glp[t0:t1], 0.0)[:, None])
            if dh is not None:
                dh[t0:t1].addmm_(g, w, alpha=inv_temp)
            if dw_acc is not None:
                dw_acc.addmm_(g.t(), h[t0:t1])  # h is already scaled by 1/temperature
        if dw_acc is not None and dw.dtype != torch.float32:
            dw[v0:v1].copy_(dw_acc)
    return dh, dw


DEFAULT_FUSED_TOKEN_CHUNK = 256


def fused_single_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_temp: float,
    grad_fn,
    need_dh: bool,
    need_dw: bool,
    tp_group=None,
    token_chunk: int | None = None,
):
    """One pass for a loss that is a sum over tokens: 3 matmuls per token chunk, no recompute.

    For each chunk of tokens the logits over the whole local vocabulary ``[n, V_local]`` (float32;
    the memory bound is ``token_chunk * V_local`` floats, two buffers) are formed once; the
    softmax statistics are reduced over ``tp_group``; ``grad_fn(t0, t1, logprob_c, entropy_c) ->
    (dL/dlogprob_c | None, dL/dentropy_c | None)`` gives the upstream gradients of those tokens; then
    ``dh[t0:t1]`` and ``dW += g.T @ h_c`` are accumulated from the same logits. Float32 weights
    only (a bf16 weight would need a float32 ``[V, H]`` accumulator; use the two-pass path).

    Returns ``(logprob [T], entropy [T], dh float32 [T, H] summed over TP | None, dW | None)``.
    """
    from megarl_kernels._common import all_reduce_sum_, combine_partials

    if weight.dtype != torch.float32:
        raise ValueError("fused_single_pass needs a float32 weight")
    n_tok, n_voc = hidden.shape[0], weight.shape[0]
    tc = token_chunk or DEFAULT_FUSED_TOKEN_CHUNK
    dev = hidden.device
    h = _scaled_hidden(hidden, inv_temp)
    logprob = torch.empty(n_tok, dtype=torch.float32, device=dev)
    entropy = torch.empty(n_tok, dtype=torch.float32, device=dev)
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.zeros_like(weight) if need_dw else None
    zbuf = torch.empty(min(tc, n_tok) * n_voc, dtype=torch.float32, device=dev)
    ebuf = torch.empty_like(zbuf)
    for t0 in range(0, n_tok, tc):
        t1 = min(t0 + tc, n_tok)
        n = t1 - t0
        z = torch.mm(h[t0:t1], weight.t(), out=zbuf[: n * n_voc].view(n, n_voc))
        idx, inside = _label_slot(labels[t0:t1], 0, n_voc)
        zl = torch.where(inside, z.gather(1, idx).squeeze(1), 0.0)
        m = z.amax(dim=1)
        z.sub_(m[:, None])  # z - m
        e = torch.exp(z, out=ebuf[: n * n_voc].view(n, n_voc))
        s = e.sum(dim=1)
        t = torch.linalg.vecdot(e, z)  # sum e (z - m)
        lp_c, ent_c, lse_c = combine_partials(m[None], s[None], t[None], zl[None], tp_group)
        logprob[t0:t1], entropy[t0:t1] = lp_c, ent_c
        glp, gent = grad_fn(t0, t1, lp_c, ent_c)
        if glp is None and gent is None:
            continue
        # p = e^(z - m) * e^(m - lse); log p = (z - m) - (lse - m)
        p = e.mul_(torch.exp(m - lse_c)[:, None])
        z.sub_((lse_c - m)[:, None])
        if gent is None:
            g = p.mul_(-glp[:, None])
        else:
            offset = gent * ent_c if glp is None else glp + gent * ent_c
            g = p.mul_(z.mul_(-gent[:, None]).sub_(offset[:, None]))
        if glp is not None:
            g.scatter_add_(1, idx, torch.where(inside, glp, 0.0)[:, None])
        if dh is not None:
            dh[t0:t1].addmm_(g, weight, alpha=inv_temp)
        if dw is not None:
            dw.addmm_(g.t(), h[t0:t1])
    if dh is not None:
        all_reduce_sum_(dh, tp_group)
    return logprob, entropy, dh, dw


def sum_sq_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    lse: torch.Tensor,
    inv_temp: float,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> torch.Tensor:
    """``sum_v p_v^2`` over this weight shard's vocabulary, float32 ``[T]``, where
    ``p_v = exp(z_v - lse)`` and ``lse`` [T] is the log-sum-exp over the whole (all TP ranks')
    vocabulary. Each term is ``exp(2 (z_v - lse)) <= 1``: no rescaling is needed. No gradient."""
    n_tok, n_voc = hidden.shape[0], weight.shape[0]
    tc, vc = _chunks(token_chunk, vocab_chunk)
    h = _scaled_hidden(hidden, inv_temp)
    out = torch.zeros(n_tok, dtype=torch.float32, device=hidden.device)
    buf = torch.empty(min(tc, n_tok) * min(vc, n_voc), dtype=torch.float32, device=hidden.device)
    for v0 in range(0, n_voc, vc):
        v1 = min(v0 + vc, n_voc)
        w = weight[v0:v1].float()
        for t0 in range(0, n_tok, tc):
            t1 = min(t0 + tc, n_tok)
            z = buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0)
            torch.mm(h[t0:t1], w.t(), out=z)
            out[t0:t1] += z.sub_(lse[t0:t1, None]).mul_(2.0).exp_().sum(dim=1)
    return out
