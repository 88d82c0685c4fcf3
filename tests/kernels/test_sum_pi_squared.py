"""``sum_v pi_v^2`` (the Optimal Token Baseline's input) of the LM head against a float64
softmax of the full logits: megarl_kernels' torch and Triton (interpreter) sweeps, both
backends' head paths, and vocabulary-parallel TP=2 (worker tests/dist/sum_pi_squared_tp.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kernels_device import compiled_triton_on_cuda
from warm_runs import run_script

import megarl_kernels as mk
from megarl.backends.torch.heads import logprob_stats, naive_sum_pi_squared

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "sum_pi_squared_tp.py"


def inputs(T=37, H=16, V=300, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    weight[:5, 0] += 8.0  # rows whose hidden[:, 0] > 0 put most mass on 5 tokens
    labels = torch.randint(0, V, (T,), generator=g)
    return hidden.to(dtype), weight.to(dtype), labels


def reference(hidden, weight, temperature):
    p = torch.softmax(hidden.double() @ weight.double().t() / temperature, -1)
    return p.square().sum(-1)


def _triton_device() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in mk.available_impls():
        return "cpu"
    if torch.cuda.is_available() and "triton" in mk.available_impls():
        return "cuda"
    return None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, (8, 64), (64, 7)])
def test_torch_kernel_matches_float64(temperature, chunk):
    hidden, weight, labels = inputs()
    lp, ent, sq = mk.linear_logprob_stats(hidden, weight, labels, temperature, impl="torch",
                                          chunk_size=chunk)
    want = reference(hidden, weight, temperature)
    torch.testing.assert_close(sq.double(), want, rtol=1e-5, atol=1e-6)
    # spread: the planted rows are peaked (near 1), the rest near uniform (near 1/V)
    assert float(want.max()) > 0.5 and float(want.min()) < 0.05
    # the logprob and entropy are linear_logprob_entropy's
    lp2, ent2 = mk.linear_logprob_entropy(hidden, weight, labels, temperature, impl="torch",
                                          chunk_size=chunk)
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(ent, ent2)


def test_triton_kernel_matches_float64(monkeypatch):
    device = _triton_device()
    if device is None:
        pytest.skip("needs TRITON_INTERPRET=1 (or a GPU with Triton)")
    from megarl_kernels import triton_impl

    monkeypatch.setattr(triton_impl, "INTERP_MAX_BLOCKS", (16, 64, 16))  # several tiles, splits
    hidden, weight, labels = inputs(T=21, V=200)
    for temperature in (1.0, 0.7):
        _, _, sq = mk.linear_logprob_stats(hidden.to(device), weight.to(device),
                                           labels.to(device), temperature, impl="triton")
        torch.testing.assert_close(sq.cpu().double(), reference(hidden, weight, temperature),
                                   rtol=1e-5, atol=1e-6)


def test_bf16_kernel_against_float64_of_the_bf16_values():
    hidden, weight, labels = inputs(dtype=torch.bfloat16)
    _, _, sq = mk.linear_logprob_stats(hidden, weight, labels, 1.0, impl="torch")
    torch.testing.assert_close(sq.double(), reference(hidden, weight, 1.0), rtol=1e-4,
                               atol=1e-5)


def test_empty_and_torch_backend_head_paths():
    hidden, weight, labels = inputs(T=0)
    assert mk.linear_logprob_stats(hidden, weight, labels, impl="torch")[2].shape == (0,)
    hidden, weight, labels = inputs(T=9)
    want = reference(hidden, weight, 0.9)
    torch.testing.assert_close(naive_sum_pi_squared(hidden, weight, 0.9).double(), want,
                               rtol=1e-5, atol=1e-6)
    for fused in (True, False):
        _, _, sq = logprob_stats(hidden, weight, labels, 0.9, None, fused=fused, impl="torch")
        torch.testing.assert_close(sq.double(), want, rtol=1e-5, atol=1e-6)


def test_megatron_fallback_matches_float64():
    from megarl.backends.megatron.heads import torch_sum_pi_squared

    hidden, weight, _ = inputs(T=11)
    torch.testing.assert_close(torch_sum_pi_squared(hidden, weight, 0.8, None).double(),
                               reference(hidden, weight, 0.8), rtol=1e-5, atol=1e-6)


@pytest.mark.dist
@pytest.mark.e2e
def test_tp2_vocab_parallel_matches_float64():
    # Triton: compiled on CUDA tensors where a GPU runs it (the interpreter may not work
    # beside a CUDA build's NumPy), else the interpreter on the CPU.
    on_cuda = compiled_triton_on_cuda()
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="0" if on_cuda else "1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = run_script([str(WORKER), "cuda" if on_cuda else "cpu"], ROOT, env, timeout=240,
                      nproc=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank{rank} OK torch naive" in out and f"rank{rank} OK megatron fallback" in out
        assert f"rank{rank} OK kernel torch" in out, out[-4000:]
        if "triton" in mk.available_impls():
            assert f"rank{rank} OK kernel triton" in out, out[-4000:]
