"""megarl.trainer.losses on hand-built micro-batches (no model): actor loss (PPO family, KL loss,
entropy bonus, on-policy, the fused path from hidden states, PACS's objective from
megarl.trainer.algorithm) and critic loss, with their normalisation and metrics.

References are float64 loops written here (token by token, response by response); PACS, a thin
wrapper, is checked for its wiring against ``megarl.algos.pacs_loss`` and its rescaling from a
micro-batch mean to the mini-batch. Planted bugs each check catches are named in docstrings.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import megarl_kernels
from megarl import algos
from megarl.backends.protocol import SequenceBatch
from megarl.trainer.algorithm import PacsLoss
from megarl.trainer.losses import ActorLossSettings, Norm, actor_loss_fn, critic_loss_fn

LENGTHS = [5, 2, 4, 3]  # 14 valid tokens
L = 5
NORM = Norm(dp_size=2, batch_num_tokens=40, global_batch_size=10, loss_scale_factor=7.0)
SHARE = 14 / 40 * 2
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _mask():
    return torch.tensor([[1.0] * n + [0.0] * (L - n) for n in LENGTHS])


def _micro_batch(seed=0, **extra) -> SequenceBatch:
    B = len(LENGTHS)
    mask = _mask()
    g = torch.Generator().manual_seed(seed)
    t = {
        "response_mask": mask,
        "old_logprob": -torch.rand(B, L, generator=g) * 2 * mask,
        "advantages": torch.randn(B, L, generator=g) * mask,
        "ref_logprob": -torch.rand(B, L, generator=g) * 2 * mask,
        "group_index": torch.tensor([0, 0, 1, 1]),
        "scores": torch.tensor([1.0, 0.0, 0.0, 0.0]),
        **extra,
    }
    t["advantages"][0, 1] = -1.0  # with a log-ratio of 1.5 (e^1.5 > 3): the dual clip binds
    ids = torch.zeros(B, 3 + L, dtype=torch.long)
    return SequenceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_length=L,
                         tensors=t)


def _outputs(mb, seed=1, spread=0.5):
    """logprob near old_logprob (|log-ratio| up to ~1: both clips active), entropy > 0."""
    g = torch.Generator().manual_seed(seed)
    mask = mb.tensors["response_mask"]
    lp = (mb.tensors["old_logprob"] + spread * torch.randn(mask.shape, generator=g)) * mask
    ent = (torch.rand(mask.shape, generator=g) * 3) * mask
    lp[0, 1] = mb.tensors["old_logprob"][0, 1] + 1.5
    return SimpleNamespace(logprob=lp.requires_grad_(), entropy=ent.requires_grad_(), hidden=None)


def _agg(rows, mode, norm=NORM):
    """float64 aggregation of per-token values rows[i][t] over the valid tokens."""
    if mode == "token-mean":
        return sum(sum(r[:n]) for r, n in zip(rows, LENGTHS)) / norm.batch_num_tokens * norm.dp_size
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r[:n]) for r, n in zip(rows, LENGTHS)) / norm.loss_scale_factor
    if mode == "seq-mean-token-sum":
        return sum(sum(r[:n]) for r, n in zip(rows, LENGTHS)) / norm.global_batch_size * norm.dp_size
    return sum(sum(r[:n]) / n for r, n in zip(rows, LENGTHS)) / norm.global_batch_size * norm.dp_size


def _ppo_rows(lp, old, adv, low=0.15, high=0.28, c=3.0, weights=None):
    """float64 per-token vanilla PPO loss (differentiable in lp) and the clip indicators."""
    rows, clip, lower, kl = [], 0, 0, 0.0
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(L):
            if t >= n:
                row.append(0.0)
                continue
            d = torch.clamp(lp[i, t] - float(old[i, t]), -20.0, 20.0)
            rho, a = torch.exp(d), float(adv[i, t])
            l1, l2 = -a * rho, -a * torch.clamp(rho, 1 - low, 1 + high)
            lc = torch.maximum(l1, l2)
            clip += int(float(l2.detach()) > float(l1.detach()))
            if a < 0:
                lower += int(float(lc.detach()) > -a * c)
                lc = torch.clamp(lc, max=-a * c)
            kl += -float(d.detach())
            row.append(lc if weights is None else lc * float(weights[i, t]))
        rows.append(row)
    return rows, clip / 14, lower / 14, kl / 14


def reference(hidden, weight, labels, temperature):
    """float64 (logprob [N], entropy [N]) from the full logits."""
    logp = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _settings(**kw):
    return ActorLossSettings(clip_ratio_low=0.15, clip_ratio_high=0.28, **kw)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("entropy_coeff", [0.0, 1.0])
def test_actor_ppo_loss_gradient_and_metrics(agg_mode, entropy_coeff):
    """Vanilla PPO (unfused: no hidden states), every aggregation, with and without the entropy
    bonus. Metrics: pg_loss is the normalised policy loss; clip fractions, ppo_kl and entropy are
    token means times this micro-batch's token share (14 / 40 * dp 2 = 0.7).

    Planted bugs: the norm not passed (token-mean over 14 tokens, not 40 / 2: loss x1.4);
    agg_mode not passed; the entropy bonus added instead of subtracted; the share left out of a
    ratio metric (x1/0.7) or put on pg_loss; clip_ratio_low / high not passed (0.2 instead of
    0.15 / 0.28); the bonus skipped for entropy_coeff == 1 (`!= 1.0`)."""
    mb = _micro_batch()
    out = _outputs(mb)
    loss, metrics = actor_loss_fn(_settings(agg_mode=agg_mode, entropy_coeff=entropy_coeff),
                                  NORM)(out, mb)
    loss.backward()

    lp = out.logprob.detach().double().requires_grad_()
    ent = out.entropy.detach().double()
    rows, clip, lower, kl = _ppo_rows(lp, mb.tensors["old_logprob"], mb.tensors["advantages"])
    pg = _agg(rows, agg_mode)
    want = pg - entropy_coeff * _agg(ent.tolist(), agg_mode)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(out.logprob.grad.double(), lp.grad, rtol=1e-5, atol=1e-7)
    assert clip > 0 and lower > 0  # both clips exercised
    ent_mean = sum(sum(r[:n]) for r, n in zip(ent.tolist(), LENGTHS)) / 14
    assert metrics == pytest.approx({
        "actor/pg_loss": pg.item(), "actor/pg_clipfrac": clip * SHARE,
        "actor/pg_clipfrac_lower": lower * SHARE, "actor/ppo_kl": kl * SHARE,
        "actor/entropy": ent_mean * SHARE}, rel=1e-5)


def test_actor_kl_loss_and_dual_clip_bound():
    """use_kl_loss: loss = pg + coef * agg(k3(logp - ref)), gradient through both; metrics
    kl_loss (normalised) and kl_coef * share. clip_ratio_c = 1.4 reaches the loss.
    Planted bugs: kl type not passed (k1 instead of low_var_kl: kl_loss 0.153 instead of 0.252);
    the KL against old_logprob instead of ref_logprob; kl_coef metric without the share;
    clip_ratio_c not passed (3: loss 0.685 instead of 0.544)."""
    mb = _micro_batch(seed=2)
    out = _outputs(mb, seed=3, spread=0.8)
    s = _settings(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl",
                  clip_ratio_c=1.4, agg_mode="seq-mean-token-mean")
    loss, metrics = actor_loss_fn(s, NORM)(out, mb)
    loss.backward()
    lp = out.logprob.detach().double().requires_grad_()
    ref = mb.tensors["ref_logprob"].double()
    rows, clip, lower, kl = _ppo_rows(lp, mb.tensors["old_logprob"], mb.tensors["advantages"],
                                      c=1.4)
    k3 = [[torch.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1 for t in range(L)]
          for i in range(len(LENGTHS))]
    kl_loss = _agg(k3, "seq-mean-token-mean")
    want = _agg(rows, "seq-mean-token-mean") + 0.05 * kl_loss
    want.backward()
    assert lower > 0
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(out.logprob.grad.double(), lp.grad, rtol=1e-5, atol=1e-7)
    assert metrics["actor/kl_loss"] == pytest.approx(kl_loss.item(), rel=1e-5)
    assert metrics["actor/kl_coef"] == pytest.approx(0.05 * SHARE, rel=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(lower * SHARE, rel=1e-5)


def test_actor_on_policy_and_another_loss_mode():
    """on_policy: old = logprob.detach() (no old_logprob needed), ratio 1, loss = agg(-A), ppo_kl
    0. loss_mode "reinforce" reaches policy_loss: loss = agg(-A logp), clip fractions 0.
    Planted bugs: on_policy ignored (KeyError without old_logprob); loss_mode not passed
    (vanilla instead of reinforce: loss -0.095 instead of 0.297)."""
    mb = _micro_batch(seed=4)
    del mb.tensors["old_logprob"]
    out = _outputs(_micro_batch(seed=4), seed=5)
    loss, metrics = actor_loss_fn(_settings(on_policy=True), NORM)(out, mb)
    adv = mb.tensors["advantages"].double().tolist()
    assert loss.item() == pytest.approx(_agg([[-a for a in r] for r in adv], "token-mean"), rel=1e-5)
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0

    mb = _micro_batch(seed=4)
    out = _outputs(mb, seed=5)
    loss, metrics = actor_loss_fn(_settings(loss_mode="reinforce"), NORM)(out, mb)
    lp = out.logprob.detach().double().tolist()
    want = _agg([[-a * x for a, x in zip(ra, rl)] for ra, rl in zip(adv, lp)], "token-mean")
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_actor_pacs_wiring_and_rescale(norm_adv_by_std):
    """PACS: every setting reaches algos.pacs_loss (beta, reward method, estimator, weights,
    norm) with scores / group_index from the micro-batch, and the micro-batch mean is rescaled
    to the mini-batch: x B / global_batch_size x dp = 4 / 10 x 2. No entropy bonus and no KL loss
    even when configured; a global batch size of 1 divides by 1. Planted bugs: the rescale left
    out (x1.25) or dp dropped (x0.5); beta, the estimator or norm_adv_by_std not passed (None:
    std never used); the entropy bonus applied to PACS; `max(global_batch_size, 2)` (x0.5)."""
    mb = _micro_batch(seed=6)
    out = _outputs(mb, seed=7)
    pacs = PacsLoss(beta=0.4, reward_method="2", adv_estimator="grpo",
                    weight_mode="only_positive", norm_adv_by_std=norm_adv_by_std)
    s = _settings(policy=pacs, entropy_coeff=0.5, use_kl_loss=True)
    loss, metrics = actor_loss_fn(s, NORM)(out, mb)
    loss.backward()
    lp = out.logprob.detach().clone().requires_grad_()
    want, _ = algos.pacs_loss(
        logprob=lp, old_logprob=mb.tensors["old_logprob"], response_mask=_mask(),
        scores=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_index=torch.tensor([0, 0, 1, 1]),
        beta=0.4, reward_method="2", adv_estimator="grpo", weight_mode="only_positive",
        norm_adv_by_std=norm_adv_by_std)
    want = want * (4 / 10 * 2)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(out.logprob.grad, lp.grad)
    assert out.entropy.grad is None  # no entropy term in the PACS loss
    assert set(metrics) == {"actor/pacs_loss", "actor/entropy"}
    assert metrics["actor/pacs_loss"] == pytest.approx(want.item(), rel=1e-6)
    one, _ = actor_loss_fn(s, Norm(1, 40, 1, 1.0))(_outputs(mb, seed=7), mb)
    assert one.item() == pytest.approx(want.item() / (4 / 10 * 2) * 4, rel=1e-6)


def test_actor_fused_path_from_hidden_states(monkeypatch):
    """Vanilla PPO with hidden states goes through megarl_kernels.fused_ppo_loss: loss, gradient
    w.r.t. the hidden states and metrics equal the float64 full-logits reference (log-probs at
    temperature 0.7, seq-mean-token-sum aggregation, entropy bonus). With a KL loss the unfused
    path is taken. Planted bugs: old_logprob / advantages gathered at (cols, rows) or not
    gathered; the agg mode or norm not passed to loss_scale_from_agg; entropy_coeff,
    clip_ratio_low or clip_ratio_c (2 here, 3 by default) dropped; the share missing from a ratio
    metric; the temperature or the TP group not passed."""
    mb = _micro_batch(seed=8)
    mask = _mask()
    rows, cols = mask.nonzero(as_tuple=True)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(14, 12, generator=g), torch.randn(50, 12, generator=g) * 0.6
    labels = torch.randint(0, 50, (14,), generator=g)
    with torch.no_grad():
        lp0, _ = reference(hidden, weight, labels, 0.7)
    old = torch.zeros(4, L)
    old[rows, cols] = (lp0 + 0.5 * torch.randn(14, generator=torch.Generator().manual_seed(2))).float()
    old[0, 1] = float(lp0[1]) - 1.5  # dual clip (A = -1 there)
    mb.tensors["old_logprob"] = old
    h = hidden.clone().requires_grad_()
    group = object()  # stands for a TP process group: must reach the kernel unchanged
    out = SimpleNamespace(hidden=h, weight=weight, labels=labels, flat_index=(rows, cols),
                          temperature=0.7, tp_group=group)
    s = _settings(agg_mode="seq-mean-token-sum", entropy_coeff=0.02, clip_ratio_c=2.0)
    seen = []
    real = megarl_kernels.fused_ppo_loss

    def spy(*a, tp_group, **kw):
        seen.append(tp_group)
        return real(*a, tp_group=None, **kw)

    monkeypatch.setattr(megarl_kernels, "fused_ppo_loss", spy)
    loss, metrics = actor_loss_fn(s, NORM)(out, mb)
    loss.backward()
    assert seen == [group]

    h64 = hidden.double().requires_grad_()
    lp, ent = reference(h64, weight, labels, 0.7)
    lp_pad = torch.zeros(4, L, dtype=torch.float64).index_put((rows, cols), lp)
    ent_pad = torch.zeros(4, L, dtype=torch.float64).index_put((rows, cols), ent)
    prow, clip, lower, kl = _ppo_rows(lp_pad, old, mb.tensors["advantages"], c=2.0)
    pg = _agg(prow, "seq-mean-token-sum")
    want = pg - 0.02 * _agg([[ent_pad[i, t] for t in range(L)] for i in range(4)],
                            "seq-mean-token-sum")
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    assert metrics == pytest.approx({
        "actor/pg_loss": pg.item(), "actor/pg_clipfrac": clip * SHARE,
        "actor/pg_clipfrac_lower": lower * SHARE, "actor/ppo_kl": kl * SHARE,
        "actor/entropy": ent.mean().item() * SHARE}, rel=1e-5)
    assert s.use_fused(out) and not _settings(use_kl_loss=True).use_fused(out)
    assert not _settings(policy=PacsLoss()).use_fused(out)
    assert not _settings(fused=False).use_fused(out)
    assert not _settings(loss_mode="gspo").use_fused(out)
    assert not s.use_fused(SimpleNamespace(hidden=None))
    assert not s.use_fused(SimpleNamespace(logprob=None))  # outputs without the raw pieces

    # on-policy through the fused path: ratio 1, loss = agg(-A) whatever the logits
    out = SimpleNamespace(hidden=hidden, weight=weight, labels=labels, flat_index=(rows, cols),
                          temperature=0.7, tp_group=None)
    del mb.tensors["old_logprob"]
    loss, metrics = actor_loss_fn(_settings(on_policy=True), NORM)(out, mb)
    adv = mb.tensors["advantages"].double().tolist()
    assert loss.item() == pytest.approx(_agg([[-a for a in r] for r in adv], "token-mean"), rel=1e-5)
    assert metrics["actor/ppo_kl"] == 0.0


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64])
def test_actor_rollout_is_weights_take_the_unfused_path(mask_dtype):
    """With rollout_is_weights in the micro-batch each token's policy loss is multiplied by its
    weight, through the unfused path even when hidden states are there (the kernel takes no
    weights); an int64 response_mask works the same. Planted bugs: the weights not passed or
    read under another key (the unweighted loss, 0.266 instead of 0.133); the fused kernel used despite
    the weights (it would run on the placeholder hidden states and fail)."""
    mb = _micro_batch(seed=11)
    mask = _mask()
    w = (0.2 + torch.rand(4, L, generator=torch.Generator().manual_seed(12)) * 1.5) * mask
    mb.tensors["rollout_is_weights"] = w
    mb.tensors["response_mask"] = mask.to(mask_dtype)
    out = _outputs(mb, seed=13)
    out.hidden = torch.zeros(1)  # present, but must not be used
    loss, metrics = actor_loss_fn(_settings(agg_mode="seq-mean-token-mean"), NORM)(out, mb)
    lp = out.logprob.detach().double()
    rows, *_ = _ppo_rows(lp, mb.tensors["old_logprob"], mb.tensors["advantages"], weights=w)
    want = _agg(rows, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(float(want), rel=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(float(want), rel=1e-5)
    ent = out.entropy.detach().double()
    assert metrics["actor/entropy"] == pytest.approx(float((ent * mask).sum()) / 14 * SHARE, rel=1e-5)


def test_one_valid_token_means():
    """A micro-batch with a single valid token: the entropy and vpred means are that token's
    value times the share (planted bug: the count clamped at 2 instead of 1 halves them)."""
    mask = torch.tensor([[0.0, 1.0, 0.0]])
    ids = torch.zeros(1, 5, dtype=torch.long)
    t = {"response_mask": mask, "old_logprob": torch.tensor([[0.0, -1.0, 0.0]]),
         "advantages": torch.tensor([[0.0, 0.5, 0.0]]), "values": torch.tensor([[0.0, 0.3, 0.0]]),
         "returns": torch.tensor([[0.0, 0.8, 0.0]])}
    mb = SequenceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_length=3,
                       tensors=t)
    out = SimpleNamespace(logprob=torch.tensor([[0.0, -0.9, 0.0]]), hidden=None,
                          entropy=torch.tensor([[5.0, 2.0, 7.0]]),
                          values=torch.tensor([[9.0, 0.4, 9.0]]))
    share = 1 / 40 * 2
    _, metrics = actor_loss_fn(_settings(), NORM)(out, mb)
    assert metrics["actor/entropy"] == pytest.approx(2.0 * share)
    _, metrics = critic_loss_fn(0.3, "token-mean", NORM)(out, mb)
    assert metrics["critic/vpred_mean"] == pytest.approx(0.4 * share)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_critic_clipped_value_loss_and_metrics(agg_mode):
    """0.5 * agg(max((v - R)^2, (clip(v, V - c, V + c) - R)^2)) with c = 0.3; metrics vf_loss,
    vf_clipfrac (token mean x share) and vpred_mean (token mean x share). Planted bugs:
    returns and old values swapped (token-mean loss 0.381 instead of 0.654); cliprange not
    passed (0.5 default: 0.636);
    the share missing; vpred_mean over padding too (mean x14/20)."""
    mb = _micro_batch(seed=9)
    g = torch.Generator().manual_seed(10)
    mask = _mask()
    mb.tensors["values"] = torch.randn(4, L, generator=g) * mask
    mb.tensors["returns"] = torch.randn(4, L, generator=g) * mask
    vp = ((mb.tensors["values"] + 0.5 * torch.randn(4, L, generator=g)) * mask + 9 * (1 - mask))
    out = SimpleNamespace(values=vp.requires_grad_())
    loss, metrics = critic_loss_fn(0.3, agg_mode, NORM)(out, mb)
    loss.backward()
    v64 = vp.detach().double().requires_grad_()
    V, R = mb.tensors["values"].double(), mb.tensors["returns"].double()
    rows, clipped = [], 0
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(L):
            vc = torch.clamp(v64[i, t], float(V[i, t]) - 0.3, float(V[i, t]) + 0.3)
            a, b = (v64[i, t] - R[i, t]) ** 2, (vc - R[i, t]) ** 2
            if t < n:
                clipped += int(float(b.detach()) > float(a.detach()))
            row.append(0.5 * torch.maximum(a, b))
        rows.append(row)
    want = _agg(rows, agg_mode)
    want.backward()
    assert clipped > 0
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(out.values.grad.double(), v64.grad, rtol=1e-5, atol=1e-7)
    vmean = sum(float(vp[i, t].detach()) for i, n in enumerate(LENGTHS) for t in range(n)) / 14
    assert metrics == pytest.approx({"critic/vf_loss": want.item(),
                                     "critic/vf_clipfrac": clipped / 14 * SHARE,
                                     "critic/vpred_mean": vmean * SHARE}, rel=1e-5)


def test_norm_share_and_kwargs():
    """token_share = tokens / batch_num_tokens x dp_size (0 tokens: 0; batch_num_tokens 0 is
    taken as 1); kwargs carries the four totals by name. Planted bugs: dp_size dropped from the
    share, the totals passed under swapped names."""
    assert NORM.token_share(_mask()) == pytest.approx(SHARE)
    assert Norm(1, 0, 1, 1.0).token_share(torch.ones(2, 3)) == 6.0
    assert NORM.kwargs() == {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 10,
                             "loss_scale_factor": 7.0}
    assert math.isclose(Norm(3, 12, 1, 1.0).token_share(torch.zeros(2, 2)), 0.0)


def test_a_policy_term_gets_a_float32_mask():
    """PolicyTerm's contract: the mask it receives is float32, whatever the micro-batch's
    response_mask (bool, int64) is. Planted bug: the mask handed over uncast."""
    seen = []

    class Term:
        regularized = True

        def __call__(self, logprob, old_logprob, mask, mb, norm):
            seen.append(mask)
            return (logprob * mask).sum(), {}

    for dtype in (torch.bool, torch.int64):
        mb = _micro_batch()
        mb.tensors["response_mask"] = _mask().to(dtype)
        out = _outputs(mb)
        actor_loss_fn(_settings(policy=Term()), NORM)(out, mb)
        assert seen[-1].dtype == torch.float32 and seen[-1].tolist() == _mask().tolist()


def test_token_counts_of_a_bf16_mask_are_exact():
    """A bf16 response_mask over 257 tokens (a bf16 sum rounds 257 to 256) weighs the token-mean
    metrics by 257 tokens: pg_clipfrac and vf_clipfrac are 1 (every token clipped) times the
    share 257 / 600 x 2. Planted bug: the mask not cast to float32 (counted in bf16: 256)."""
    B, Lw = 2, 150
    lengths = [150, 107]
    mask = torch.tensor([[1.0] * n + [0.0] * (Lw - n) for n in lengths])
    ids = torch.zeros(B, 2 + Lw, dtype=torch.long)
    t = {"response_mask": mask.to(torch.bfloat16), "old_logprob": torch.full((B, Lw), -1.0),
         "advantages": torch.ones(B, Lw), "values": torch.zeros(B, Lw),
         "returns": torch.full((B, Lw), 2.0)}
    mb = SequenceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_length=Lw,
                       tensors=t)
    norm = Norm(dp_size=2, batch_num_tokens=600, global_batch_size=4, loss_scale_factor=1.0)
    share = 257 / 600 * 2
    # log-ratio 0.5 > log(1.28) with A = 1: every token clipped; values 1 beyond V +- 0.3 with
    # R = 2: every token's clipped loss (1.7^2) exceeds the unclipped one (1^2)
    out = SimpleNamespace(logprob=torch.full((B, Lw), -0.5), entropy=None, hidden=None,
                          values=torch.ones(B, Lw))
    _, m = actor_loss_fn(_settings(), norm)(out, mb)
    assert m["actor/pg_clipfrac"] == pytest.approx(share, rel=1e-6)
    _, m = critic_loss_fn(0.3, "token-mean", norm)(out, mb)
    assert m["critic/vf_clipfrac"] == pytest.approx(share, rel=1e-6)
    assert m["critic/vpred_mean"] == pytest.approx(share, rel=1e-6)
