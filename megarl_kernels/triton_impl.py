"""Fused Triton kernels (GPU; on CPU only under ``TRITON_INTERPRET=1``, for tests).

Importing this module imports Triton; ``megarl_kernels`` only imports it when the Triton
implementation is chosen. ``TRITON_INTERPRET`` must be set before this import (``@triton.jit``
reads it at decoration time).

Kernels (logit tiles ``z = h_tile @ w_tile.T / temperature`` are accumulated with ``tl.dot`` over
H tiles and never stored):

- ``_fwd_kernel``, grid (token blocks, vocabulary splits): each program streams its range of
  vocabulary tiles with an online max / sum-exp / shifted entropy sum and writes partial stats;
  the splits (and TP ranks) are combined in ``_common.combine_partials``.
- ``_bwd_kernel``, grid (token blocks, vocabulary tiles): each program recomputes one logit tile,
  forms ``g = dL/dz`` and accumulates both ``dh += g @ W_tile`` and ``dW_tile += g.T @ h`` with
  float32 atomics, so the logits are recomputed once for both gradients (two separate dh / dW
  kernels would recompute them twice). Accumulation order is therefore not deterministic.

``UPCAST`` (set when ``TRITON_INTERPRET=1``) casts bf16/fp16 operands to float32 before ``tl.dot``:
the interpreter's ``tl.dot`` multiplies the raw bf16 bits (triton-lang/triton#11584). On a GPU,
bf16 operands go to the tensor cores with float32 accumulation (``g`` is cast to the input dtype
for the gradient matmuls); float32 operands use ``input_precision="ieee"``.

Block sizes and layout limits (``tl.dot`` needs every dimension >= 16, registers, shared memory)
can only be checked on a GPU; the interpreter is more permissive.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megarl_kernels._common import NEG_INIT

UPCAST = os.environ.get("TRITON_INTERPRET", "0") == "1"

# GPU block sizes (untuned: no GPU was available when this was written).
GPU_BLOCKS = {"fwd": (64, 128, 64), "bwd": (64, 128, 64)}  # (BLOCK_T, BLOCK_V, BLOCK_H)
GPU_NUM_WARPS = 8
# Interpreter cost is ~1-2 ms per (program x tile) step, so use few, large blocks there.
INTERP_MAX_BLOCKS = (64, 1024, 128)
DEFAULT_VOCAB_LAUNCH = 32768  # vocabulary rows per backward launch (bounds the fp32 dW buffer)


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_t, offs_v, mask_t, mask_v, H, stride_h, stride_w,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """float32 [BLOCK_T, BLOCK_V] tile of h @ w.T (masked rows/cols are 0)."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        offs_h = k0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        a = tl.load(h_ptr + offs_t[:, None] * stride_h + offs_h[None, :],
                    mask=mask_t[:, None] & mask_h[None, :], other=0.0)
        b = tl.load(w_ptr + offs_v[:, None] * stride_w + offs_h[None, :],
                    mask=mask_v[:, None] & mask_h[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, t_ptr, zl_ptr,
                T, V, H, stride_h, stride_w, inv_temp, tiles_per_prog,
                BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, NEG: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    lab = tl.load(lab_ptr + offs_t, mask=mask_t, other=-1)
    m = tl.full((BLOCK_T,), NEG, dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    t = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zl = tl.zeros((BLOCK_T,), dtype=tl.float32)
    first = pid_v * tiles_per_prog
    last = tl.minimum(first + tiles_per_prog, tl.cdiv(V, BLOCK_V))
    for vt in range(first, last):
        offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = _logits_tile(h_ptr, w_ptr, offs_t, offs_v, mask_t, mask_v, H, stride_h, stride_w,
                         BLOCK_T, BLOCK_V, BLOCK_H, UPCAST, IEEE) * inv_temp
        z = tl.where(mask_v[None, :], z, NEG)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        d = z - m_new[:, None]
        e = tl.exp(d)  # exactly 0 on masked columns, where d ~ -1e30
        shift = m - m_new
        scale = tl.exp(shift)
        t = scale * (t + s * shift) + tl.sum(e * d, axis=1)
        s = scale * s + tl.sum(e, axis=1)
        m = m_new
        hit = (offs_v[None, :] == lab[:, None]) & mask_v[None, :]
        zl += tl.sum(tl.where(hit, z, 0.0), axis=1)
    out = pid_v * T + offs_t
    tl.store(m_ptr + out, m, mask=mask_t)
    tl.store(s_ptr + out, s, mask=mask_t)
    tl.store(t_ptr + out, t, mask=mask_t)
    tl.store(zl_ptr + out, zl, mask=mask_t)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dh_ptr, dw_ptr,
                T, V, H, stride_h, stride_w, stride_dh, stride_dw, inv_temp,
                HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_t = offs_t < T
    mask_v = offs_v < V
    valid = mask_t[:, None] & mask_v[None, :]
    z = _logits_tile(h_ptr, w_ptr, offs_t, offs_v, mask_t, mask_v, H, stride_h, stride_w,
                     BLOCK_T, BLOCK_V, BLOCK_H, UPCAST, IEEE) * inv_temp
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    logp = z - lse[:, None]
    p = tl.where(valid, tl.exp(logp), 0.0)
    coef = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    if HAS_GENT:
        ent = tl.load(ent_ptr + offs_t, mask=mask_t, other=0.0)
        gent = tl.load(gent_ptr + offs_t, mask=mask_t, other=0.0)
        coef += gent[:, None] * (logp + ent[:, None])
    if HAS_GLP:
        glp = tl.load(glp_ptr + offs_t, mask=mask_t, other=0.0)
        coef += glp[:, None]
    g = -p * coef
    if HAS_GLP:
        lab = tl.load(lab_ptr + offs_t, mask=mask_t, other=-1)
        hit = (offs_v[None, :] == lab[:, None]) & valid
        g += tl.where(hit, glp[:, None], 0.0)
    g = g * inv_temp  # dL/d(h . w)
    for k0 in range(0, H, BLOCK_H):
        offs_h = k0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        if NEED_DH:
            w = tl.load(w_ptr + offs_v[:, None] * stride_w + offs_h[None, :],
                        mask=mask_v[:, None] & mask_h[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            if IEEE:
                part = tl.dot(g, w, input_precision="ieee")
            else:
                part = tl.dot(g.to(w.dtype), w)
            tl.atomic_add(dh_ptr + offs_t[:, None] * stride_dh + offs_h[None, :], part,
                          mask=mask_t[:, None] & mask_h[None, :])
        if NEED_DW:
            hh = tl.load(h_ptr + offs_t[:, None] * stride_h + offs_h[None, :],
                         mask=mask_t[:, None] & mask_h[None, :], other=0.0)
            if UPCAST:
                hh = hh.to(tl.float32)
            if IEEE:
                part = tl.dot(tl.trans(g), hh, input_precision="ieee")
            else:
                part = tl.dot(tl.trans(g.to(hh.dtype)), hh)
            tl.atomic_add(dw_ptr + offs_v[:, None] * stride_dw + offs_h[None, :], part,
                          mask=mask_v[:, None] & mask_h[None, :])


@triton.jit
def _sq_kernel(h_ptr, w_ptr, lse_ptr, q_ptr, T, V, H, stride_h, stride_w, inv_temp,
               tiles_per_prog, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_H: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Partial ``sum_v exp(2 (z_v - lse))`` of one vocabulary split, ``lse`` the global one."""
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    q = tl.zeros((BLOCK_T,), dtype=tl.float32)
    first = pid_v * tiles_per_prog
    last = tl.minimum(first + tiles_per_prog, tl.cdiv(V, BLOCK_V))
    for vt in range(first, last):
        offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = _logits_tile(h_ptr, w_ptr, offs_t, offs_v, mask_t, mask_v, H, stride_h, stride_w,
                         BLOCK_T, BLOCK_V, BLOCK_H, UPCAST, IEEE) * inv_temp
        p2 = tl.exp(2.0 * (z - lse[:, None]))
        q += tl.sum(tl.where(mask_t[:, None] & mask_v[None, :], p2, 0.0), axis=1)
    tl.store(q_ptr + pid_v * T + offs_t, q, mask=mask_t)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _blocks(kind: str, n_tok: int, n_voc: int, hidden_size: int) -> tuple[int, int, int]:
    if not UPCAST:
        return GPU_BLOCKS[kind]
    bt, bv, bh = INTERP_MAX_BLOCKS
    return (max(16, min(bt, _pow2(n_tok))), max(16, min(bv, _pow2(n_voc))),
            max(16, min(bh, _pow2(hidden_size))))


def _ieee(*tensors: torch.Tensor) -> bool:
    """float32 dots in full precision (not TF32); under the interpreter everything is float32."""
    return UPCAST or all(x.dtype == torch.float32 for x in tensors)


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, enough to exercise the split combination


def forward_stats(hidden, weight, labels, inv_temp, token_chunk=None, vocab_chunk=None):
    """Partial softmax statistics ``(m, s, t, zl)``, each ``[P, T]`` float32 (P vocab splits).

    ``labels`` are local to this shard. ``token_chunk``/``vocab_chunk`` are not used: the kernel
    is tiled and its memory is O(P * T).
    """
    h, w = hidden.contiguous(), weight.contiguous()
    lab = labels.contiguous()
    n_tok, hid = h.shape
    n_voc = w.shape[0]
    if n_tok == 0:
        empty = torch.empty((1, 0), dtype=torch.float32, device=h.device)
        return empty, empty, empty, empty
    bt, bv, bh = _blocks("fwd", n_tok, n_voc, hid)
    n_tblocks, n_vtiles = triton.cdiv(n_tok, bt), triton.cdiv(n_voc, bv)
    splits = max(1, min(n_vtiles, triton.cdiv(_target_programs(h.device), n_tblocks)))
    tiles_per_prog = triton.cdiv(n_vtiles, splits)
    splits = triton.cdiv(n_vtiles, tiles_per_prog)
    out = torch.empty((4, splits, n_tok), dtype=torch.float32, device=h.device)
    _fwd_kernel[(n_tblocks, splits)](
        h, w, lab, out[0], out[1], out[2], out[3],
        n_tok, n_voc, hid, h.stride(0), w.stride(0), float(inv_temp), tiles_per_prog,
        BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, UPCAST=UPCAST, IEEE=_ieee(h, w), NEG=NEG_INIT,
        **({} if UPCAST else {"num_warps": GPU_NUM_WARPS}),
    )
    return out[0], out[1], out[2], out[3]


def backward_grads(hidden, weight, labels, lse, entropy, glp, gent, inv_temp, need_dh, need_dw,
                   token_chunk=None, vocab_chunk=None):
    """Same contract as ``torch_impl.backward_grads``: ``(dh float32 [T, H] | None,
    dW [V_local, H] in the weight dtype | None)``. The vocabulary is processed in launches of
    ``vocab_chunk`` rows (default 32768) so a non-float32 weight needs only a float32
    ``[vocab_chunk, H]`` accumulation buffer."""
    h, w = hidden.contiguous(), weight.contiguous()
    lab = labels.contiguous()
    n_tok, hid = h.shape
    n_voc = w.shape[0]
    dev = h.device
    dh = torch.zeros((n_tok, hid), dtype=torch.float32, device=dev) if need_dh else None
    dw = None
    if need_dw:
        dw = torch.zeros_like(w) if w.dtype == torch.float32 else torch.empty_like(w)
    if (glp is None and gent is None) or n_tok == 0:
        return dh, None if dw is None else dw.zero_()
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    launch = vocab_chunk or DEFAULT_VOCAB_LAUNCH
    bt, bv, bh = _blocks("bwd", n_tok, min(launch, n_voc), hid)
    for v0 in range(0, n_voc, launch):
        v1 = min(v0 + launch, n_voc)
        w_part = w[v0:v1]
        dw_part = dummy
        if dw is not None:
            dw_part = dw[v0:v1] if dw.dtype == torch.float32 else torch.zeros(
                (v1 - v0, hid), dtype=torch.float32, device=dev)
        _bwd_kernel[(triton.cdiv(n_tok, bt), triton.cdiv(v1 - v0, bv))](
            h, w_part, lab - v0 if v0 else lab, lse, entropy,
            dummy if glp is None else glp, dummy if gent is None else gent,
            dummy if dh is None else dh, dw_part,
            n_tok, v1 - v0, hid, h.stride(0), w.stride(0),
            hid if dh is None else dh.stride(0), hid if dw is None else dw_part.stride(0),
            float(inv_temp),
            HAS_GLP=glp is not None, HAS_GENT=gent is not None,
            NEED_DH=dh is not None, NEED_DW=dw is not None,
            BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, UPCAST=UPCAST, IEEE=_ieee(h, w),
            **({} if UPCAST else {"num_warps": GPU_NUM_WARPS}),
        )
        if dw is not None and dw.dtype != torch.float32:
            dw[v0:v1].copy_(dw_part)
    return dh, dw


def sum_sq_probs(hidden, weight, lse, inv_temp, token_chunk=None, vocab_chunk=None):
    """Same contract as ``torch_impl.sum_sq_probs``: float32 ``[T]`` sum of ``p_v^2`` over this
    shard's vocabulary given the global ``lse`` [T] (P vocabulary splits, summed here)."""
    h, w = hidden.contiguous(), weight.contiguous()
    n_tok, hid = h.shape
    n_voc = w.shape[0]
    if n_tok == 0:
        return torch.zeros(0, dtype=torch.float32, device=h.device)
    bt, bv, bh = _blocks("fwd", n_tok, n_voc, hid)
    n_tblocks, n_vtiles = triton.cdiv(n_tok, bt), triton.cdiv(n_voc, bv)
    splits = max(1, min(n_vtiles, triton.cdiv(_target_programs(h.device), n_tblocks)))
    tiles_per_prog = triton.cdiv(n_vtiles, splits)
    splits = triton.cdiv(n_vtiles, tiles_per_prog)
    out = torch.empty((splits, n_tok), dtype=torch.float32, device=h.device)
    _sq_kernel[(n_tblocks, splits)](
        h, w, lse.float().contiguous(), out, n_tok, n_voc, hid, h.stride(0), w.stride(0),
        float(inv_temp), tiles_per_prog,
        BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, UPCAST=UPCAST, IEEE=_ieee(h, w),
        **({} if UPCAST else {"num_warps": GPU_NUM_WARPS}),
    )
    return out.sum(dim=0)
