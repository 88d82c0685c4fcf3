"""Masked helpers: values worked by hand, the epsilon placements, errors."""

import math

import pytest
import torch

from megarl.algos import masked_mean, masked_sum, masked_var, masked_whiten

D = torch.float64


def test_masked_sum_mean_ignore_padding_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.5]], dtype=D)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(x, m).item() == pytest.approx(7.5)
    assert masked_mean(x, m).item() == pytest.approx(7.5 / (4 + 1e-8), rel=1e-12)
    torch.testing.assert_close(masked_sum(x, m.bool(), dim=-1), torch.tensor([3.0, 4.5], dtype=D))
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 2.25], dtype=D))


def test_masked_mean_epsilon_is_inside_the_denominator():
    # an empty mask gives 0 / (0 + 1e-8) = 0, not NaN
    x = torch.tensor([[3.0, 5.0]], dtype=D)
    assert masked_mean(x, torch.zeros(1, 2)).item() == 0.0


def test_masked_var_unbiased_and_errors():
    x = torch.tensor([[1.0, 2.0, 4.0, 100.0]], dtype=D)
    m = torch.tensor([[1, 1, 1, 0]])
    # mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9; unbiased: / 2
    assert masked_var(x, m).item() == pytest.approx(42 / 9 / 2, rel=1e-7)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(42 / 9 / 3, rel=1e-7)
    with pytest.raises(ValueError, match="single element"):
        masked_var(x, torch.tensor([[1, 0, 0, 0]]))
    with pytest.raises(ValueError, match="no element"):
        masked_var(x, torch.zeros(1, 4))


def test_masked_whiten_tiny_variance_pins_epsilon_inside_rsqrt():
    # var_unbiased = 2 * (5e-5)^2 = 5e-9, comparable to the 1e-8 epsilon:
    #   (x - mu) / sqrt(var + 1e-8) = +-5e-5 / sqrt(1.5e-8) = +-0.408248...
    # eps outside the sqrt would give ~0.707, biased variance ~0.447, no eps 1.0
    x = torch.tensor([[0.0, 1e-4, 123.0]], dtype=D)
    m = torch.tensor([[1, 1, 0]])
    out = masked_whiten(x, m)
    expected = 5e-5 / math.sqrt(5e-9 + 1e-8)
    assert out[0, 0].item() == pytest.approx(-expected, rel=1e-6)
    assert out[0, 1].item() == pytest.approx(expected, rel=1e-6)
    shifted = masked_whiten(x, m, shift_mean=False)
    assert shifted[0, 1].item() == pytest.approx(expected + 5e-5, rel=1e-6)


def test_masked_whiten_is_batch_wide_and_token_weighted():
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], dtype=D)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # four tokens 1, 1, 1, 4: mean 7/4, unbiased var = (3 * 9/16 + 81/16) / 3 = 2.25
    out = masked_whiten(x, m)
    assert out[0, 0].item() == pytest.approx((1 - 1.75) / math.sqrt(2.25 + 1e-8), rel=1e-7)
    assert out[1, 0].item() == pytest.approx((4 - 1.75) / math.sqrt(2.25 + 1e-8), rel=1e-7)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)|\(2, 2\).*\(2, 3\)"):
        masked_sum(torch.zeros(2, 2), torch.ones(2, 3))
