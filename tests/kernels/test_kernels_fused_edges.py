"""Edges of megarl_kernels.losses that the composed-equality tests do not reach, each against a
float64 brute-force loop written here (full logits, per-response Python loops):

- PACS weight modes ``only_positive`` / ``only_negative``, groups with one label only, a
  singleton group and a pair, integer labels, grpo without std, an all-equal grpo group;
- PPO with ``entropy_coeff = 1``, a dual-clip bound in (1, 2], a log-ratio below -20, a 0-d
  ``loss_scale`` and float64 side inputs, the default implementation;
- the autograd function: a loss scaled by exactly 2, a frozen hidden (weight gradient only),
  a second backward through a retained graph, which implementation runs;
- the error messages, matched whole.

Planted bugs each test was checked against (by hand, then by mutmut) are named in the docstrings.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from kernels_reference import assert_close_scaled, make_inputs, reference

import megarl_kernels as mk

# B = 8 responses in 4 groups: a mixed triple, an all-correct pair, a singleton, an all-wrong pair
LENGTHS = [4, 2, 5, 3, 1, 6, 2, 3]
GROUPS = torch.tensor([7, 7, 7, 3, 3, 9, 5, 5])
SCORES = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def _seq(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _problem(seed=0, lengths=LENGTHS):
    seq = _seq(lengths)
    T = seq.numel()
    hidden, weight, labels = make_inputs(T, 16, 120, seed=seed, scale=3.0)
    with torch.no_grad():
        lp, _ = reference(hidden, weight, labels)
    g = torch.Generator().manual_seed(seed + 11)
    old = (lp + 0.7 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    return hidden, weight, labels, old, seq


def _bce(x, y):
    return max(x, 0.0) - x * y + math.log1p(math.exp(-abs(x)))


def _pacs_ref(lp, old, seq, groups, scores, *, beta, reward_method, adv_estimator, weight_mode,
              norm_adv_by_std=True, global_batch_size=None, dp_size=1, zero_std=()):
    """float64 PACS loss by loops over responses and groups (lp differentiable [T])."""
    B = len(scores)
    r = []
    for i in range(B):
        tok = (seq == i).nonzero().squeeze(-1)
        if reward_method == "1":
            r.append(beta * (lp[tok] - old[tok].double()).sum())
        else:
            r.append(beta * lp[tok].sum() / max(len(tok), 1))
    members = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    psi = [None] * B
    for g, idx in members.items():
        n = len(idx)
        for i in idx:
            if adv_estimator == "naive":
                psi[i] = r[i]
            elif adv_estimator == "rloo":
                psi[i] = r[i] * 0 if n == 1 else r[i] - sum(r[j] for j in idx if j != i) / (n - 1)
            else:
                if n == 1:
                    mean, std = 0.0, 1.0
                else:
                    mean = sum(r[j] for j in idx) / n
                    var = sum((r[j] - mean) ** 2 for j in idx) / (n - 1)
                    std = 0.0 if g in zero_std else var.sqrt()
                psi[i] = (r[i] - mean) / (std + 1e-6) if norm_adv_by_std else r[i] - mean
    loss = 0.0
    for idx in members.values():
        n = len(idx)
        n_pos = sum(1 for j in idx if scores[j] > 0.5)
        for i in idx:
            pos = scores[i] > 0.5
            if weight_mode is None:
                w = 1.0
            elif weight_mode == "only_positive":
                w = 1.0 if pos else 0.0
            elif weight_mode == "only_negative":
                w = 0.0 if pos else 1.0
            else:
                w = n / (2.0 * (n_pos if pos else n - n_pos)) if 0 < n_pos < n else 1.0
            x, y = psi[i], scores[i]
            loss = loss + w * (torch.clamp(x, min=0) - x * y + torch.log1p(torch.exp(-x.abs())))
    return loss / (global_batch_size or B) * dp_size, r, psi


def _fused_grads(fn, hidden, weight):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fn(h, w)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def _ref_grads(fn, hidden, weight, labels):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = reference(h, w, labels)
    loss, r, psi = fn(lp)
    loss.backward()
    return loss.detach(), r, psi, ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("weight_mode", ["question", "only_positive", "only_negative", None])
@pytest.mark.parametrize("reward_method, adv_estimator, norm_adv_by_std",
                         [("1", "rloo", True), ("2", "grpo", True), ("1", "grpo", False),
                          ("2", "naive", True)])
def test_fused_pacs_weight_modes_and_group_shapes_against_float64(
        weight_mode, reward_method, adv_estimator, norm_adv_by_std):
    """Groups of 3 (mixed labels), 2 (all correct), 1 and 2 (all wrong), labels given as int64.

    Planted bugs: only_negative weighting the positives swaps which responses count (loss 0.77
    instead of 0.88 with rloo); "question" weights with `|` instead of `&` (an all-correct pair weighted 0.5 instead
    of 1) or `>= 0` for a class count; singletons treated as groups (`size >= 1`: rloo divides
    0 by 0, NaN) or pairs as singletons (`size > 2`: their psi is the raw reward); grpo always
    divided by std although norm_adv_by_std=False, or `reward + mean`; labels kept int64 (BCE
    refuses them); the metric key "entropy" renamed."""
    hidden, weight, labels, old, seq = _problem(seed=2)
    scores = torch.tensor(SCORES).long()
    kw = dict(beta=0.6, reward_method=reward_method, adv_estimator=adv_estimator,
              weight_mode=weight_mode, norm_adv_by_std=norm_adv_by_std, global_batch_size=10,
              dp_size=2)
    f_loss, f_met, f_dh, f_dw = _fused_grads(
        lambda h, w: mk.fused_pacs_loss(h, w, labels, old, seq, GROUPS, scores, impl="torch",
                                        chunk_size=(8, 64), **kw), hidden, weight)
    r_loss, r, psi, ent, r_dh, r_dw = _ref_grads(
        lambda lp: _pacs_ref(lp, old, seq, GROUPS, SCORES, **kw), hidden, weight, labels)
    assert f_loss.dtype == torch.float32
    assert float(f_loss) == pytest.approx(r_loss.item(), rel=1e-5)
    assert f_met["pacs_loss"] == pytest.approx(float(r_loss), rel=1e-5)
    assert f_met["reward_mean"] == pytest.approx(float(sum(r).detach()) / len(r), rel=1e-5, abs=1e-6)
    assert f_met["adv_mean"] == pytest.approx(float(sum(psi).detach()) / len(psi), rel=1e-5, abs=1e-6)
    assert f_met["entropy"] == pytest.approx(float(ent.mean()), rel=1e-5)
    assert float(r_dh.abs().max()) > 1e-3  # a real gradient
    # grpo divides by a std of rewards that are close: float32 cancellation, hence 1e-3
    assert_close_scaled(f_dh, r_dh, 1e-3, "dh")
    assert_close_scaled(f_dw, r_dw, 1e-3, "dW")


def test_fused_pacs_grpo_all_equal_group_uses_std_zero():
    """Two identical responses (same tokens, same old log-probs) in one group: their rewards are
    bitwise equal, var = 0, and psi = (r - mean) / (0 + 1e-6), so the gradient is 1e6 times
    d(r - mean). Planted bugs: `var >= 0` (sqrt differentiated at 0: NaN gradient); the std of
    that group set to 1 instead of 0 (gradient 1e6 times too small)."""
    hidden, weight, labels, old, seq = _problem(seed=4, lengths=[3, 3, 2, 4])
    hidden[3:6], labels[3:6], old[3:6] = hidden[0:3], labels[0:3], old[0:3]
    groups = torch.tensor([0, 0, 1, 1])
    scores = [1.0, 0.0, 1.0, 0.0]
    kw = dict(beta=1.0, reward_method="1", adv_estimator="grpo", weight_mode="question")
    f_loss, _, f_dh, f_dw = _fused_grads(
        lambda h, w: mk.fused_pacs_loss(h, w, labels, old, seq, groups, torch.tensor(scores),
                                        impl="torch", **kw), hidden, weight)
    r_loss, *_, r_dh, r_dw = _ref_grads(
        lambda lp: _pacs_ref(lp, old, seq, groups, scores, zero_std=(0,), **kw),
        hidden, weight, labels)
    assert torch.isfinite(f_dh).all() and torch.isfinite(f_dw).all()
    assert float(f_loss) == pytest.approx(r_loss.item(), rel=1e-5)
    assert float(r_dh.abs().max()) > 1e4
    assert_close_scaled(f_dh, r_dh, 1e-4, "dh")
    # the two copies' weight gradients cancel exactly in float64; float32 leaves ~1e-7 of scale
    assert float((f_dw.double() - r_dw).abs().max()) <= 1e-5 * float(r_dh.abs().max())


def test_fused_pacs_defaults():
    """No keyword: beta 1, method "1", rloo, "question" weights, B = len(scores), dp 1, impl auto.
    Planted bugs: beta default 2 (loss +52%); impl default misspelt (ValueError)."""
    hidden, weight, labels, old, seq = _problem(seed=6)
    loss, _ = mk.fused_pacs_loss(hidden, weight, labels, old, seq, GROUPS, torch.tensor(SCORES))
    with torch.no_grad():
        lp, _ = reference(hidden, weight, labels)
        want, *_ = _pacs_ref(lp, old, seq, GROUPS, SCORES, beta=1.0, reward_method="1",
                             adv_estimator="rloo", weight_mode="question")
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def _ppo_ref(lp, old, adv, scale, ent, *, low, high, c, entropy_coeff):
    """float64 per-token PPO (clip-higher + dual clip) summed with weights ``scale``."""
    loss, kl, dual = 0.0, [], 0
    for t in range(lp.numel()):
        d = torch.clamp(lp[t] - float(old[t]), -20.0, 20.0)
        kl.append(-float(d.detach()))
        rho, a = torch.exp(d), float(adv[t])
        lc = torch.maximum(-a * rho, -a * torch.clamp(rho, 1 - low, 1 + high))
        lt = torch.minimum(lc, torch.tensor(-a * c, dtype=lc.dtype)) if a < 0 else lc
        dual += int(a < 0 and float(lc.detach()) > -a * c)
        loss = loss + float(scale[t]) * (lt - entropy_coeff * ent[t])
    return loss, sum(kl) / len(kl), dual / len(kl)


def test_fused_ppo_edges_against_float64():
    """entropy_coeff = 1, clip_ratio_c = 1.5, a token with log-ratio -25 (clamped to -20), a 0-d
    tensor loss_scale, float64 old_logprob and advantages, impl left to "auto".

    Planted bugs: the entropy term skipped when entropy_coeff == 1 (`!= 1.0`: loss 0.22 instead
    of -2.40); dual-clip bounds <= 2 rejected; no lower clamp of the log-ratio (ppo_kl rises by
    5/T = 0.19); a 0-d loss_scale treated as a [T] tensor (ValueError); side inputs kept
    float64 (loss float64); the metric key "pg_loss" renamed; impl default misspelt."""
    hidden, weight, labels, old, seq = _problem(seed=8)
    T = seq.numel()
    with torch.no_grad():
        lp0, _ = reference(hidden, weight, labels)
    old = old.double()
    old[2] = lp0[2] + 25.0
    adv = torch.randn(T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    old[6], adv[6] = lp0[6] - 0.8, -1.0  # ratio e^0.8 = 2.2 > c = 1.5 with A < 0: dual clip
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5)
    f_loss, f_met, f_dh, f_dw = _fused_grads(
        lambda h, w: mk.fused_ppo_loss(h, w, labels, old, adv, loss_scale=torch.tensor(0.05),
                                       entropy_coeff=1.0, **kw), hidden, weight)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = reference(h, w, labels)
    r_loss, r_kl, r_dual = _ppo_ref(lp, old, adv, torch.full((T,), 0.05), ent, low=0.2, high=0.28, c=1.5,
                            entropy_coeff=1.0)
    r_pg, *_ = _ppo_ref(lp.detach(), old, adv, torch.full((T,), 0.05), ent.detach(), low=0.2,
                       high=0.28, c=1.5, entropy_coeff=0.0)
    r_loss.backward()
    assert f_loss.dtype == torch.float32
    assert float(f_loss) == pytest.approx(r_loss.item(), rel=1e-5)
    assert f_met["pg_loss"] == pytest.approx(float(r_pg), rel=1e-5)
    assert f_met["ppo_kl"] == pytest.approx(r_kl, rel=1e-5)
    assert r_dual > 0 and f_met["pg_clipfrac_lower"] == pytest.approx(r_dual, rel=1e-6)
    assert_close_scaled(f_dh, h.grad, 1e-4, "dh")
    assert_close_scaled(f_dw, w.grad, 1e-4, "dW")


def _ppo(h, w, labels, old, adv, **kw):
    return mk.fused_ppo_loss(h, w, labels, old, adv, loss_scale=0.1, impl="torch", **kw)


def test_fused_backward_scale_two_frozen_inputs_and_second_backward():
    """Planted bugs: the incoming gradient's fast path taken for 2 instead of 1 (`grad == 2`:
    gradients half the truth); a frozen hidden or weight scaled in backward (None.mul_:
    AttributeError); the single pass used only when both gradients are wanted (`and`: a frozen
    weight falls back to two passes, 4 matmuls instead of 3); gradients handed out twice as ""
    (a second backward through a retained graph fails instead of adding nothing)."""
    from megarl_kernels import torch_impl

    hidden, weight, labels, old, seq = _problem(seed=1)
    adv = torch.randn(seq.numel(), generator=torch.Generator().manual_seed(5))
    _, _, dh1, dw1 = _fused_grads(lambda h, w: _ppo(h, w, labels, old, adv), hidden, weight)
    _, _, dh2, dw2 = _fused_grads(lambda h, w: (lambda r: (2.0 * r[0], r[1]))(
        _ppo(h, w, labels, old, adv)), hidden, weight)
    torch.testing.assert_close(dh2, 2 * dh1)
    torch.testing.assert_close(dw2, 2 * dw1)

    calls = []
    real = torch_impl.fused_single_pass
    torch_impl_patch = pytest.MonkeyPatch()
    torch_impl_patch.setattr(torch_impl, "fused_single_pass", lambda *a: calls.append(a) or real(*a))
    try:
        w = weight.clone().requires_grad_()  # frozen hidden: weight gradient only
        loss, _ = _ppo(hidden, w, labels, old, adv)
        (3.0 * loss).backward()
        torch.testing.assert_close(w.grad, 3 * dw1)
        h = hidden.clone().requires_grad_()  # frozen weight: hidden gradient only
        loss, _ = _ppo(h, weight, labels, old, adv)
        (3.0 * loss).backward(retain_graph=True)
        torch.testing.assert_close(h.grad, 3 * dh1)
        assert len(calls) == 2  # both ran the single pass
        loss.backward()  # the gradients were handed out once: nothing more is added
        torch.testing.assert_close(h.grad, 3 * dh1)
    finally:
        torch_impl_patch.undo()


def test_fused_triton_impl_runs_triton_kernels(monkeypatch):
    """impl="triton" must run triton_impl (planted bug: the torch module loaded for every name,
    same numbers, Triton never run)."""
    if "triton" not in mk.available_impls():
        pytest.skip("triton not importable / no interpreter")
    from megarl_kernels import triton_impl

    monkeypatch.setattr(triton_impl, "INTERP_MAX_BLOCKS", (16, 128, 32))
    calls = []
    real = triton_impl.forward_stats
    monkeypatch.setattr(triton_impl, "forward_stats", lambda *a: calls.append(1) or real(*a))
    hidden, weight, labels, old, seq = _problem(seed=1, lengths=[3, 2])
    loss, _ = mk.fused_ppo_loss(hidden, weight, labels, old, torch.ones(5), loss_scale=0.2,
                                impl="triton")
    with torch.no_grad():
        lp, _ = reference(hidden, weight, labels)
    want, *_ = _ppo_ref(lp, old, torch.ones(5), torch.full((5,), 0.2), torch.zeros(5), low=0.2,
                       high=0.2, c=3.0, entropy_coeff=0.0)
    assert calls and float(loss) == pytest.approx(float(want), rel=1e-5)


def _raises(msg, fn):
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        fn()


def test_fused_error_messages_whole():
    """Every message matched whole (planted bugs: a message replaced by None or altered, the
    shape printed from the wrong object, `or` turned into `and` so a list fails inside with an
    AttributeError, the accepted weight modes misspelt, seq_index == B or
    global_batch_size = 0 accepted, global_batch_size = 1 refused)."""
    hidden, weight, labels, old, seq = _problem(seed=0, lengths=[3, 2])
    adv, sc, gi = torch.ones(5), torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    ppo = lambda **k: mk.fused_ppo_loss(**{**dict(hidden=hidden, weight=weight, labels=labels,  # noqa: E731
                                                  old_logprob=old, advantages=adv,
                                                  loss_scale=1.0), **k})
    pacs = lambda **k: mk.fused_pacs_loss(**{**dict(hidden=hidden, weight=weight, labels=labels,  # noqa: E731
                                                    old_logprob=old, seq_index=seq,
                                                    group_index=gi, scores=sc), **k})
    _raises("advantages must be a [T] tensor with T=5, got torch.Size([4])",
            lambda: ppo(advantages=adv[:4]))
    _raises("advantages must be a [T] tensor with T=5, got [1.0, 2.0]",
            lambda: ppo(advantages=[1.0, 2.0]))
    _raises("advantages must be a float tensor, got torch.int64",
            lambda: ppo(advantages=torch.ones(5, dtype=torch.long)))
    _raises("old_logprob must be a [T] tensor with T=5, got torch.Size([4])",
            lambda: ppo(old_logprob=old[:4]))
    _raises("loss_scale must be a [T] tensor with T=5, got torch.Size([4])",
            lambda: ppo(loss_scale=torch.ones(4)))
    _raises("clip_ratio_c (dual-clip bound) must be > 1, got 1.0", lambda: ppo(clip_ratio_c=1.0))
    _raises("hidden must be a [T, H] tensor, got torch.Size([5])", lambda: ppo(hidden=old))
    _raises("hidden must be a [T, H] tensor, got [1.0]", lambda: ppo(hidden=[1.0]))
    ppo(clip_ratio_c=1.5)  # any bound above 1 is accepted

    _raises("old_logprob must be a [T] tensor with T=5, got torch.Size([4])",
            lambda: pacs(old_logprob=old[:4]))
    _raises("unknown PACS adv_estimator 'gae'; valid: rloo, grpo, naive",
            lambda: pacs(adv_estimator="gae"))
    _raises("unknown PACS weight_mode 'all'; valid: question, only_positive, only_negative, None",
            lambda: pacs(weight_mode="all"))
    _raises("scores must be a [B] tensor, got torch.Size([1, 2])", lambda: pacs(scores=sc[None]))
    _raises("scores must be a [B] tensor, got [1.0, 0.0]", lambda: pacs(scores=[1.0, 0.0]))
    _raises("scores must be correctness labels in [0, 1] (1 = correct)", lambda: pacs(scores=sc * 2))
    _raises("group_index must be a [B] tensor with B=2, got torch.Size([3])",
            lambda: pacs(group_index=torch.zeros(3)))
    _raises("group_index must be a [B] tensor with B=2, got [0, 0]", lambda: pacs(group_index=[0, 0]))
    _raises("seq_index must be a [T] tensor with T=5, got torch.Size([4])",
            lambda: pacs(seq_index=seq[:4]))
    _raises("seq_index must be a [T] tensor with T=5, got [0, 0, 0, 1, 1]",
            lambda: pacs(seq_index=seq.tolist()))
    _raises("seq_index must lie in [0, B=2) (one entry of scores per response)",
            lambda: pacs(seq_index=seq + 1))
    _raises("global_batch_size must be > 0, got 0", lambda: pacs(global_batch_size=0))
    loss_one, _ = pacs(global_batch_size=1)  # accepted: the mean over 1 instead of B = 2
    assert float(loss_one) == pytest.approx(2 * float(pacs()[0]), rel=1e-6)

    _raises("unknown agg_mode 'sum'; valid: ['token-mean', 'seq-mean-token-sum', "
            "'seq-mean-token-mean', 'seq-mean-token-sum-norm']",
            lambda: mk.loss_scale_from_agg("sum", seq))
    _raises("seq-mean-token-sum-norm needs loss_scale_factor (e.g. the padded response length L) "
            "for packed tokens", lambda: mk.loss_scale_from_agg("seq-mean-token-sum-norm", seq))


def test_loss_scale_from_agg_one_token_and_one_response():
    """Defaults with one token / one response: token-mean weight 1 / 1 and seq-mean weight 1 / 1
    (planted bugs: `max(n, 2)` / `max(groups, 2)` halve them)."""
    one = torch.zeros(1, dtype=torch.long)
    assert mk.loss_scale_from_agg("token-mean", one).tolist() == [1.0]
    assert mk.loss_scale_from_agg("seq-mean-token-sum", torch.zeros(3, dtype=torch.long)).tolist() \
        == [1.0, 1.0, 1.0]
