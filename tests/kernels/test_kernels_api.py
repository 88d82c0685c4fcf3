"""Implementation selection and input validation of megarl_kernels."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernels_reference import make_inputs

import megarl_kernels as mk
from megarl_kernels import _dispatch

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu_even_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch.resolve("auto", CPU) == "torch"
    if _dispatch.triton_importable():
        assert _dispatch.resolve("auto", torch.device("cuda")) == "triton"
        assert "triton" in mk.available_impls()
    assert mk.available_impls()[0] == "torch"


def test_set_default_impl_and_env_var(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    try:
        mk.set_default_impl("torch")
        assert _dispatch.resolve("auto", torch.device("cuda")) == "torch"
        mk.set_default_impl(None)
        monkeypatch.setenv(_dispatch.ENV_VAR, "torch")
        assert _dispatch.resolve("auto", torch.device("cuda")) == "torch"
        monkeypatch.setenv(_dispatch.ENV_VAR, "bogus")
        with pytest.raises(ValueError, match="bogus"):
            _dispatch.resolve("auto", CPU)
    finally:
        mk.set_default_impl(None)
    with pytest.raises(ValueError, match="valid"):
        mk.set_default_impl("cuda")


def test_forced_impl_is_the_one_that_runs(monkeypatch):
    """impl='triton' really runs the Triton kernels (spy), impl='torch' does not."""
    if "triton" not in mk.available_impls():
        pytest.skip("triton not importable / no interpreter")
    from megarl_kernels import triton_impl

    calls = []
    real = triton_impl.forward_stats
    monkeypatch.setattr(triton_impl, "forward_stats", lambda *a: calls.append(1) or real(*a))
    hidden, weight, labels = make_inputs(5, 8, 30)
    mk.linear_logprob_entropy(hidden, weight, labels, impl="torch")
    assert not calls
    mk.linear_logprob_entropy(hidden, weight, labels, impl="triton")
    assert calls


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if not _dispatch.triton_importable():
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _dispatch.resolve("triton", CPU)


def test_import_does_not_import_triton_or_megarl():
    code = ("import sys, megarl_kernels, torch; h=torch.randn(3,4); w=torch.randn(7,4);"
            "megarl_kernels.linear_logprob_entropy(h, w, torch.tensor([0,1,6]));"
            "bad=[m for m in sys.modules if m == 'triton' or m.startswith('megarl.')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h, w, y: (h[0], w, y), "hidden"),
        (lambda h, w, y: (h, w[:, :-1], y), "disagree on H"),
        (lambda h, w, y: (h, w, y[:-1]), "labels"),
        (lambda h, w, y: (h, w, y.float()), "integer"),
        (lambda h, w, y: (h, w, y + 100), r"\[0, 30\)"),
        (lambda h, w, y: (h, w, y - 100), r"\[0, 30\)"),
        (lambda h, w, y: (h.double(), w, y), "float32/bfloat16"),
        (lambda h, w, y: (h.bfloat16(), w, y), "one dtype"),
    ],
)
def test_input_errors(mutate, match):
    hidden, weight, labels = make_inputs(5, 8, 30)
    with pytest.raises(ValueError, match=match):
        mk.linear_logprob_entropy(*mutate(hidden, weight, labels))


def test_bad_options():
    hidden, weight, labels = make_inputs(5, 8, 30)
    with pytest.raises(ValueError, match="temperature"):
        mk.linear_logprob_entropy(hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match="impl"):
        mk.linear_logprob_entropy(hidden, weight, labels, impl="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        mk.linear_logprob_entropy(hidden, weight, labels, chunk_size=(0, 4))
