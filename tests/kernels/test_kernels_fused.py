"""fused_ppo_loss / fused_pacs_loss equal megarl.algos composed with the log-probs (values,
metrics and gradients), and loss_scale_from_agg reproduces megarl.algos.agg_loss."""

from __future__ import annotations

import math

import pytest
import torch
from kernels_reference import assert_close_scaled, make_inputs, reference

import megarl_kernels as mk
from megarl import algos

IMPLS = ["torch", "triton"]
LENGTHS = [5, 1, 9, 3, 7, 6]  # B = 6 responses, packed T = 31 tokens
GROUPS = torch.tensor([1, 0, 1, 0, 1, 0])  # two prompts, interleaved


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    if request.param not in mk.available_impls():
        pytest.skip("triton not importable / no interpreter")
    if request.param == "triton":
        from megarl_kernels import triton_impl

        monkeypatch.setattr(triton_impl, "INTERP_MAX_BLOCKS", (16, 128, 32))
    return request.param


def _layout(lengths):
    """seq_index [T] and (row, col) of each packed token in a right-padded [B, L] layout."""
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    col = torch.cat([torch.arange(n) for n in lengths])
    return seq, col, len(lengths), max(lengths)


def _pad(flat, seq, col, B, L):
    """[T] -> [B, L] (zeros outside the mask), differentiable."""
    out = torch.zeros(B, L, dtype=flat.dtype)
    return out.index_put((seq, col), flat)


def _mask(seq, col, B, L):
    return _pad(torch.ones(seq.numel()), seq, col, B, L) > 0


def _problem(temperature, seed=0):
    seq, col, B, L = _layout(LENGTHS)
    T = seq.numel()
    hidden, weight, labels = make_inputs(T, 24, 300, seed=seed, scale=3.0)
    with torch.no_grad():
        lp, _ = reference(hidden, weight, labels, temperature)
    g = torch.Generator().manual_seed(seed + 7)
    old = (lp + 0.9 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    old[3] = lp[3] - 25.0  # |log-ratio| > 20: clamped, no gradient through that token
    adv = torch.randn(T, generator=g)
    old[5], adv[5] = float(lp[5]) - 1.5, -1.0  # ratio e^1.5 > clip_ratio_c with A < 0: dual clip
    return hidden, weight, labels, old, adv, (seq, col, B, L)


def _grads_of(fn, hidden, weight):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fn(h, w)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


@pytest.mark.parametrize(
    "agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_fused_ppo_equals_composed(impl, agg_mode, entropy_coeff):
    temperature = 0.8
    hidden, weight, labels, old, adv, (seq, col, B, L) = _problem(temperature)
    mask = _mask(seq, col, B, L)
    norm = {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 9, "loss_scale_factor": 12}
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)

    def composed(h, w):
        lp, ent = mk.linear_logprob_entropy(h, w, labels, temperature, impl=impl)
        pad = lambda x: _pad(x, seq, col, B, L)  # noqa: E731
        loss, metrics = algos.policy_loss(
            "vanilla", logprob=pad(lp), old_logprob=pad(old), advantages=pad(adv),
            response_mask=mask, agg_mode=agg_mode, **kw, **norm,
        )
        if entropy_coeff:
            loss = loss - entropy_coeff * algos.agg_loss(pad(ent), mask, agg_mode, **norm)
        return loss, metrics

    def fused(h, w):
        scale = mk.loss_scale_from_agg(agg_mode, seq, **norm)
        return mk.fused_ppo_loss(
            h, w, labels, old, adv, loss_scale=scale, temperature=temperature,
            entropy_coeff=entropy_coeff, impl=impl, chunk_size=(8, 64), **kw,
        )

    c_loss, c_met, c_dh, c_dw = _grads_of(composed, hidden, weight)
    f_loss, f_met, f_dh, f_dw = _grads_of(fused, hidden, weight)
    assert 0.05 < c_met["pg_clipfrac"] < 0.9 and c_met["pg_clipfrac_lower"] > 0  # clips exercised
    torch.testing.assert_close(f_loss, c_loss, rtol=1e-5, atol=1e-6)
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert f_met[k] == pytest.approx(c_met[k], rel=1e-5, abs=1e-6), k
    assert_close_scaled(f_dh, c_dh, 1e-5, "dh")
    assert_close_scaled(f_dw, c_dw, 1e-5, "dW")


def test_fused_ppo_against_float64_composition(impl):
    """Independent of linear_logprob_entropy: algos on float64 full-logits log-probs."""
    hidden, weight, labels, old, adv, (seq, col, B, L) = _problem(1.0, seed=3)
    mask = _mask(seq, col, B, L)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = reference(h64, w64, labels)
    pad = lambda x: _pad(x, seq, col, B, L)  # noqa: E731
    ref_loss, _ = algos.policy_loss(
        "vanilla", logprob=pad(lp), old_logprob=pad(old.double()), advantages=pad(adv.double()),
        response_mask=mask, agg_mode="token-mean",
    )
    ref_loss = ref_loss - 0.02 * algos.agg_loss(pad(ent), mask, "token-mean")
    ref_loss.backward()
    f_loss, metrics, f_dh, f_dw = _grads_of(
        lambda h, w: mk.fused_ppo_loss(h, w, labels, old, adv, loss_scale=1.0 / seq.numel(),
                                       entropy_coeff=0.02, impl=impl), hidden, weight)
    assert float(f_loss) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert metrics["entropy"] == pytest.approx(float(ent.detach().mean()), rel=1e-5)
    assert_close_scaled(f_dh, h64.grad, 1e-4, "dh")
    assert_close_scaled(f_dw, w64.grad, 1e-4, "dW")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ppo_one_and_two_pass_agree(dtype, monkeypatch):
    """torch impl: the single pass (fp32 weight) and the two-pass path (bf16) both equal the
    composed computation (bf16 at bf16 gradient precision)."""
    from megarl_kernels import torch_impl

    calls = []
    real = torch_impl.fused_single_pass
    monkeypatch.setattr(torch_impl, "fused_single_pass", lambda *a: calls.append(1) or real(*a))
    hidden, weight, labels, old, adv, _ = _problem(0.9)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    kw = dict(loss_scale=0.03, entropy_coeff=0.05, temperature=0.9, impl="torch", chunk_size=(8, 64))
    f_loss, f_met, f_dh, f_dw = _grads_of(
        lambda h, w: mk.fused_ppo_loss(h, w, labels, old, adv, **kw), hidden, weight)
    assert len(calls) == (1 if dtype == torch.float32 else 0)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = mk.linear_logprob_entropy(h, w, labels, 0.9, impl="torch")
    mask = torch.ones(1, lp.numel(), dtype=torch.bool)
    c_loss, _ = algos.policy_loss("vanilla", logprob=lp[None], old_logprob=old[None],
                                  advantages=adv[None], response_mask=mask,
                                  agg_mode="token-mean", batch_num_tokens=1 / 0.03)
    c_loss = c_loss - 0.05 * 0.03 * ent.sum()
    c_loss.backward()
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(f_loss, c_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_close_scaled(f_dh, h.grad, rel, "dh")
    assert_close_scaled(f_dw, w.grad, rel, "dW")


def test_fused_backward_scales_and_partial_grads(impl):
    hidden, weight, labels, old, adv, _ = _problem(1.0)
    _, _, dh1, dw1 = _grads_of(
        lambda h, w: mk.fused_ppo_loss(h, w, labels, old, adv, loss_scale=0.1, impl=impl),
        hidden, weight)
    _, _, dh3, dw3 = _grads_of(
        lambda h, w: (lambda r: (3.0 * r[0], r[1]))(
            mk.fused_ppo_loss(h, w, labels, old, adv, loss_scale=0.1, impl=impl)),
        hidden, weight)
    torch.testing.assert_close(dh3, 3 * dh1)
    torch.testing.assert_close(dw3, 3 * dw1)
    h = hidden.clone().requires_grad_()  # frozen weight: only dh
    loss, _ = mk.fused_ppo_loss(h, weight, labels, old, adv, loss_scale=0.1, impl=impl)
    loss.backward()
    torch.testing.assert_close(h.grad, dh1)


@pytest.mark.parametrize("reward_method", ["1", "2"])
@pytest.mark.parametrize("adv_estimator", ["rloo", "grpo", "naive"])
@pytest.mark.parametrize("weight_mode", ["question", None])
def test_fused_pacs_equals_composed(impl, reward_method, adv_estimator, weight_mode):
    temperature = 0.9
    hidden, weight, labels, old, _, (seq, col, B, L) = _problem(temperature, seed=5)
    mask = _mask(seq, col, B, L)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    kw = dict(beta=0.7, reward_method=reward_method, adv_estimator=adv_estimator,
              weight_mode=weight_mode, global_batch_size=8, dp_size=2)

    def composed(h, w):
        lp, _ = mk.linear_logprob_entropy(h, w, labels, temperature, impl=impl)
        return algos.pacs_loss(
            logprob=_pad(lp, seq, col, B, L), old_logprob=_pad(old, seq, col, B, L),
            response_mask=mask, scores=scores, group_index=GROUPS, **kw,
        )

    def fused(h, w):
        return mk.fused_pacs_loss(h, w, labels, old, seq, GROUPS, scores,
                                  temperature=temperature, impl=impl, chunk_size=(8, 64), **kw)

    c_loss, c_met, c_dh, c_dw = _grads_of(composed, hidden, weight)
    f_loss, f_met, f_dh, f_dw = _grads_of(fused, hidden, weight)
    torch.testing.assert_close(f_loss, c_loss, rtol=1e-5, atol=1e-6)
    for k in ("pacs_loss", "reward_mean", "adv_mean"):
        assert f_met[k] == pytest.approx(c_met[k], rel=1e-5, abs=1e-6), k
    assert float(c_dh.abs().max()) > 1e-4  # a real gradient
    assert_close_scaled(f_dh, c_dh, 1e-5, "dh")
    assert_close_scaled(f_dw, c_dw, 1e-5, "dW")


def test_fused_pacs_on_policy_is_ln2():
    """Method "1" with old == current log-probs: psi = 0 so the loss is ln 2 (balanced weights)."""
    hidden, weight, labels, _, _, (seq, _, _, _) = _problem(1.0)
    with torch.no_grad():
        lp, _ = mk.linear_logprob_entropy(hidden, weight, labels, impl="torch")
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    loss, metrics = mk.fused_pacs_loss(hidden, weight, labels, lp, seq, GROUPS, scores, impl="torch")
    assert float(loss) == pytest.approx(math.log(2.0), abs=1e-6)
    assert metrics["adv_mean"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_loss_scale_from_agg_matches_agg_loss(agg_mode):
    seq, col, B, L = _layout(LENGTHS)
    values = torch.randn(seq.numel(), dtype=torch.float64)
    for norm in ({}, {"dp_size": 4, "batch_num_tokens": 77, "global_batch_size": 10}):
        norm = dict(norm)
        if agg_mode == "seq-mean-token-sum-norm":
            norm["loss_scale_factor"] = L
        want = algos.agg_loss(_pad(values, seq, col, B, L), _mask(seq, col, B, L), agg_mode, **norm)
        terms = mk.loss_scale_from_agg(agg_mode, seq, **norm).double() * values
        # the float32 scales are exact to ~6e-8 each; the sum may cancel, so bound its error by
        # the sum of the terms' magnitudes, not by the (possibly tiny) sum itself
        assert abs(float(terms.sum()) - float(want)) <= 1e-6 * float(terms.abs().sum())


def test_fused_input_errors():
    hidden, weight, labels, old, adv, (seq, _, _, _) = _problem(1.0)
    with pytest.raises(ValueError, match="old_logprob"):
        mk.fused_ppo_loss(hidden, weight, labels, old[:-1], adv, loss_scale=1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        mk.fused_ppo_loss(hidden, weight, labels, old, adv, loss_scale=1.0, clip_ratio_c=1.0)
    scores = torch.ones(6)
    with pytest.raises(ValueError, match="seq_index"):
        mk.fused_pacs_loss(hidden, weight, labels, old, seq + 3, GROUPS, scores)
    with pytest.raises(ValueError, match="reward_method"):
        mk.fused_pacs_loss(hidden, weight, labels, old, seq, GROUPS, scores, reward_method="3")
    with pytest.raises(ValueError, match="scores"):
        mk.fused_pacs_loss(hidden, weight, labels, old, seq, GROUPS, scores * 2)


def test_fused_ppo_on_policy_equals_detached_composition(impl):
    """old_logprob=None (one mini-batch, one epoch): ratio exactly 1, ppo_kl exactly 0, and the
    gradient equals policy_loss with old_logprob = logprob.detach()."""
    hidden, weight, labels, _, adv, (seq, col, B, L) = _problem(1.0)
    mask = _mask(seq, col, B, L)
    norm = {"dp_size": 1, "batch_num_tokens": seq.numel()}

    def composed(h, w):
        lp, _ = mk.linear_logprob_entropy(h, w, labels, impl=impl)
        pad = lambda x: _pad(x, seq, col, B, L)  # noqa: E731
        return algos.policy_loss("vanilla", logprob=pad(lp), old_logprob=pad(lp.detach()),
                                 advantages=pad(adv), response_mask=mask, **norm)

    def fused(h, w):
        scale = mk.loss_scale_from_agg("token-mean", seq, **norm)
        return mk.fused_ppo_loss(h, w, labels, None, adv, loss_scale=scale, impl=impl,
                                 chunk_size=(8, 64))

    c_loss, _, c_dh, c_dw = _grads_of(composed, hidden, weight)
    f_loss, f_met, f_dh, f_dw = _grads_of(fused, hidden, weight)
    assert f_met["ppo_kl"] == 0.0 and f_met["pg_clipfrac"] == 0.0
    # on-policy PPO loss is -mean(A) whatever the logits: an independent check of the value
    assert float(f_loss) == pytest.approx(float(-adv.mean()), rel=1e-5)
    torch.testing.assert_close(f_loss, c_loss, rtol=1e-5, atol=1e-6)
    assert_close_scaled(f_dh, c_dh, 1e-5, "dh")
    assert_close_scaled(f_dw, c_dw, 1e-5, "dW")
