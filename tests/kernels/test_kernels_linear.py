"""linear_logprob_entropy against a float64 full-logits reference, both implementations.

The Triton implementation runs under TRITON_INTERPRET=1 (set by tests/conftest.py) with small
blocks forced, so every case spans several token / vocabulary / hidden tiles and vocab splits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_reference import assert_close_scaled, make_inputs, reference_grads
from torch.utils._python_dispatch import TorchDispatchMode

import megarl_kernels as mk

IMPLS = ["torch", "triton"]
# (forward abs tol, grad tol relative to the gradient's scale)
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-5, 1.6e-2)}


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    if request.param not in mk.available_impls():
        pytest.skip("triton not importable / no interpreter")
    if request.param == "triton":
        from megarl_kernels import triton_impl

        monkeypatch.setattr(triton_impl, "INTERP_MAX_BLOCKS", (16, 128, 32))
    return request.param


def _run(impl, hidden, weight, labels, temperature, a, b, chunk_size=None):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = mk.linear_logprob_entropy(h, w, labels, temperature, impl=impl, chunk_size=chunk_size)
    loss = 0.0
    if a is not None:
        loss = loss + (lp * a).sum()
    if b is not None:
        loss = loss + (ent * b).sum()
    loss.backward()
    return lp, ent, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("grad_from", ["logprob", "entropy", "both"])
def test_matches_float64_reference(impl, dtype, temperature, grad_from):
    T, H, V = 37, 48, 517  # V is no multiple of any block; labels 0 and V-1 included
    hidden, weight, labels = make_inputs(T, H, V, dtype, seed=1, scale=4.0)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(T, generator=g) if grad_from in ("logprob", "both") else None
    b = torch.randn(T, generator=g) if grad_from in ("entropy", "both") else None
    lp, ent, dh, dw = _run(impl, hidden, weight, labels, temperature, a, b, chunk_size=(8, 100))
    rlp, rent, rdh, rdw = reference_grads(hidden, weight, labels, temperature, a, b)
    fwd_tol, grad_tol = TOL[dtype]
    assert lp.dtype == ent.dtype == torch.float32
    assert dh.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(lp.double(), rlp, atol=fwd_tol, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=fwd_tol, rtol=1e-5)
    assert float(rent.mean()) > 0.3 and float(rlp.mean()) < -0.3  # non-degenerate distributions
    assert_close_scaled(dh, rdh, grad_tol, "dh")
    assert_close_scaled(dw, rdw, grad_tol, "dW")


def test_sharp_distribution_and_large_logits(impl):
    """Logits of order 60: lse must be stable; entropy near 0 must stay accurate."""
    hidden, weight, labels = make_inputs(20, 32, 300, seed=3, scale=60.0)
    a, b = torch.ones(20), torch.ones(20)
    lp, ent, dh, dw = _run(impl, hidden, weight, labels, 1.0, a, b)
    rlp, rent, rdh, rdw = reference_grads(hidden, weight, labels, 1.0, a, b)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=1e-4, rtol=1e-4)
    assert_close_scaled(dh, rdh, 1e-4, "dh")
    assert_close_scaled(dw, rdw, 1e-4, "dW")


def test_no_output_gradient_and_frozen_weight(impl):
    hidden, weight, labels = make_inputs(9, 16, 70, seed=4)
    h = hidden.clone().requires_grad_()
    lp, ent = mk.linear_logprob_entropy(h, weight, labels, impl=impl)  # weight: no grad
    (lp * 0 + lp).sum().backward()
    _, _, rdh, _ = reference_grads(hidden, weight, labels, 1.0, torch.ones(9), None)
    assert_close_scaled(h.grad, rdh, 2e-5, "dh")
    with torch.no_grad():
        lp2, _ = mk.linear_logprob_entropy(hidden, weight, labels, impl=impl)
    torch.testing.assert_close(lp2, lp.detach())


def test_empty_batch(impl):
    hidden, weight, _ = make_inputs(4, 8, 20)
    h = hidden[:0].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = mk.linear_logprob_entropy(h, w, torch.zeros(0, dtype=torch.long), impl=impl)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 8) and float(w.grad.abs().max()) == 0.0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 24), H=st.integers(1, 40), V=st.integers(1, 300),
    temperature=st.floats(0.3, 2.0), tc=st.integers(1, 30), vc=st.integers(1, 320),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_torch(T, H, V, temperature, tc, vc, seed):
    _check_random("torch", T, H, V, temperature, (tc, vc), seed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 40), H=st.integers(1, 70), V=st.integers(1, 400),
    temperature=st.floats(0.3, 2.0), seed=st.integers(0, 2**16),
)
def test_random_shapes_triton(T, H, V, temperature, seed, monkeypatch):
    if "triton" not in mk.available_impls():
        pytest.skip("triton not importable / no interpreter")
    from megarl_kernels import triton_impl

    monkeypatch.setattr(triton_impl, "INTERP_MAX_BLOCKS", (16, 64, 16))
    _check_random("triton", T, H, V, temperature, None, seed)


def _check_random(impl, T, H, V, temperature, chunk, seed):
    hidden, weight, labels = make_inputs(T, H, V, seed=seed, scale=3.0)
    g = torch.Generator().manual_seed(seed + 1)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    lp, ent, dh, dw = _run(impl, hidden, weight, labels, temperature, a, b, chunk_size=chunk)
    rlp, rent, rdh, rdw = reference_grads(hidden, weight, labels, temperature, a, b)
    torch.testing.assert_close(lp.double(), rlp, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=3e-5, rtol=1e-5)
    # At V = 1 every gradient is exactly 0 (p = 1), and a kernel that contracts z * inv_temp
    # into an FMA (compiled Triton) gets p = 1 - O(u |z|): the floor is that rounding, carried
    # through one token's gradient terms (|a| + |b|) * |z| * (|W| for dh, |h| for dW).
    z = float((hidden.double() @ weight.double().t()).abs().max()) / temperature if V else 0.0
    terms = float((a.abs() + b.abs()).max()) * max(1.0, z) * 2.0**-22
    assert_close_scaled(dh, rdh, 5e-5, "dh", floor=terms * float(weight.abs().max()))
    assert_close_scaled(dw, rdw, 5e-5, "dW", floor=terms * float(hidden.abs().max()))


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_torch_impl_never_builds_full_logits():
    """Every tensor created in forward + backward is at most a tile, dW, or [T, H]."""
    T, H, V, tc, vc = 64, 4, 1000, 16, 128
    hidden, weight, labels = make_inputs(T, H, V, seed=5)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _LargestTensor() as probe:
        lp, ent = mk.linear_logprob_entropy(h, w, labels, 0.9, impl="torch", chunk_size=(tc, vc))
        (lp.sum() + ent.sum()).backward()
    assert probe.largest <= max(tc * vc, V * H, T * H) < T * V // 10


@pytest.mark.slow  # a cold torch.compile takes ~10 s
def test_compiled_tile_math_matches():
    """set_torch_compile(True): the torch.compile'd per-tile math gives the same results."""
    pytest.importorskip("torch._inductor")
    hidden, weight, labels = make_inputs(24, 16, 200, seed=6, scale=3.0)
    a, b = torch.randn(24), torch.randn(24)
    mk.set_torch_compile(True)
    try:
        lp, ent, dh, dw = _run("torch", hidden, weight, labels, 0.8, a, b, chunk_size=(8, 64))
    finally:
        mk.set_torch_compile(False)
    rlp, rent, rdh, rdw = reference_grads(hidden, weight, labels, 0.8, a, b)
    torch.testing.assert_close(lp.double(), rlp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=2e-5, rtol=1e-5)
    assert_close_scaled(dh, rdh, 2e-5, "dh")
    assert_close_scaled(dw, rdw, 2e-5, "dW")
