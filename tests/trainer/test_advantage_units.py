"""megarl.trainer.advantage on small hand-built batches (no model, no trainer): reward placement,
PRM credit assignment, KL in reward, every estimator branch and the metrics; and the advantage
stages of the algorithms with their own (megarl.trainer.algorithm: PURE, PACS).

References are float64 loops written here (one response, one token at a time). PURE's pipeline
is long and already tested in tests/algos against OpenRLHF's formulas, so for ``pure_rloo`` the
check is the wiring: which tensor reaches which argument of ``megarl.algos.pure_rloo_advantages``
(mode, KL, coefficients, defaults when the PRM is off), plus one brute-force case.

Planted bugs each check was shown to catch are named in the docstrings.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl import algos
from megarl.trainer.advantage import (
    AdvantageSettings,
    compute_step_advantages,
    last_token_mask,
    place_rewards,
)
from megarl.trainer.algorithm import PureSettings, pacs_advantages, pure_advantages, pure_mode
from megarl.trainer.batch import RolloutBatch

LENGTHS = [5, 3, 4, 1, 2, 5]
GROUPS = [4, 9, 4, 9, 4, 9]  # two prompts of three responses, interleaved
VR = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
L = 5


def _mask(lengths=LENGTHS, width=L):
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])


def _batch(*, vr=VR, lengths=LENGTHS, groups=GROUPS, seed=0, prm=False, kl=False, values=False,
           baselines=False) -> RolloutBatch:
    B = len(lengths)
    mask = _mask(lengths)
    g = torch.Generator().manual_seed(seed)
    batch = RolloutBatch(
        prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.ones(B, L, dtype=torch.long), response_mask=mask,
        group_index=torch.tensor(groups), data_sources=["x"] * B, ground_truths=[None] * B,
        extra_infos=[{}] * B, finish_reasons=["stop"] * B)
    t = batch.tensors
    t["verifiable"] = torch.tensor(vr)
    if prm:  # step ends at tokens 1, 3 and the last token; scores in [-1, 1]
        steps = torch.zeros(B, L)
        for i, n in enumerate(lengths):
            for c in {1, 3, n - 1}:
                if c < n:
                    steps[i, c] = 1.0
        t["step_mask"] = steps
        t["step_rewards"] = (torch.rand(B, L, generator=g) * 2 - 1) * steps
    if kl:
        t["old_logprob"] = -torch.rand(B, L, generator=g) * 2 * mask
        t["ref_logprob"] = (t["old_logprob"] + 0.6 * torch.randn(B, L, generator=g)) * mask
    if values:
        t["values"] = torch.randn(B, L, generator=g) * mask
    if baselines:
        t["reward_baselines"] = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.0, 0.75])
    return batch


def _d(x) -> list[list[float]]:
    return x.double().tolist()


def _ref_scores(batch, coef=1.0, prm_tokens=None):
    """float64 [B][L]: verifiable reward * coef at each response's last token (+ PRM tokens)."""
    out = []
    for i, n in enumerate(LENGTHS):
        row = [0.0] * L
        row[n - 1] = VR[i] * coef
        if prm_tokens is not None:
            row = [a + b for a, b in zip(row, prm_tokens[i])]
        out.append(row)
    return out


def _ref_kl(batch, kind):
    old, ref = _d(batch.tensors["old_logprob"]), _d(batch.tensors["ref_logprob"])
    out = []
    for i, n in enumerate(LENGTHS):
        row = [0.0] * L
        for t in range(n):
            d = old[i][t] - ref[i][t]
            row[t] = d if kind == "kl" else math.exp(-d) + d - 1.0
        out.append(row)
    return out


def _close(got, want, tol=1e-5):
    got = got.double() if isinstance(got, torch.Tensor) else torch.tensor(got, dtype=torch.float64)
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _group_stats(scores):
    """{group: (mean, unbiased std, members)}."""
    out = {}
    for gid in set(GROUPS):
        idx = [i for i, g in enumerate(GROUPS) if g == gid]
        s = [scores[i] for i in idx]
        mean = sum(s) / len(s)
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1))
        out[gid] = (mean, std, idx)
    return out


def _tile(per_row):
    return [[per_row[i] if t < n else 0.0 for t in range(L)] for i, n in enumerate(LENGTHS)]


def _whiten(rows):
    flat = [rows[i][t] for i, n in enumerate(LENGTHS) for t in range(n)]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(rows[i][t] - mean) / math.sqrt(var + 1e-8) if t < n else 0.0 for t in range(L)]
            for i, n in enumerate(LENGTHS)]


def test_last_token_mask_and_pure_mode():
    """One-hot at the last valid token, all zero for an empty response (planted bug: `lengths`
    instead of `lengths - 1` puts it one to the right, an off-by-one in every reward; the
    result in the mask's dtype, a bool one-hot for a bool mask)."""
    got = last_token_mask(_mask([3, 0, 5, 1]))
    want = [[0, 0, 1, 0, 0], [0] * 5, [0, 0, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert got.dtype == torch.float32 and got.tolist() == want
    for dtype in (torch.bool, torch.int64):  # float32 whatever the mask's dtype
        got = last_token_mask(_mask([3, 0, 5, 1]).to(dtype))
        assert got.dtype == torch.float32 and got.tolist() == want
    assert pure_mode(AdvantageSettings(prm_enabled=True)) == "prm_vr"
    assert pure_mode(AdvantageSettings(prm_enabled=True, vr_enabled=False)) == "prm"
    assert pure_mode(AdvantageSettings(prm_enabled=False)) == "vr"
    assert pure_mode(AdvantageSettings(prm_enabled=False, vr_enabled=False)) == "vr"


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_outcome_reward_at_the_last_token(norm):
    """Default estimator: scores = vr at the last token, rewards = scores, GRPO per group.

    Planted bugs: vr placed at the first token (scores differ at 5 of 6 rows); the
    verifiable_reward_coef (5 here) applied without a PRM (scores x5); norm_adv_by_std ignored
    (advantages differ by up to 0.49); returns not the advantages."""
    batch = _batch()
    s = AdvantageSettings(norm_adv_by_std_in_grpo=norm, verifiable_reward_coef=5.0)
    metrics = compute_step_advantages(batch, s, kl_coef=0.3)
    t = batch.tensors
    assert metrics == {}
    _close(t["token_level_scores"], _ref_scores(batch))
    _close(t["token_level_rewards"], _ref_scores(batch))
    stats = _group_stats(VR)
    adv = []
    for i, gid in enumerate(GROUPS):
        mean, std, _ = stats[gid]
        adv.append((VR[i] - mean) / (std + 1e-6) if norm else VR[i] - mean)
    _close(t["advantages"], _tile(adv))
    _close(t["returns"], _tile(adv))
    assert "scores" not in t and "prm_token_rewards" not in t


def test_rloo_and_the_kl_penalty_in_the_reward():
    """RLOO on rewards that carry k1 KL: S_i = vr_i - coef * sum_t kl_t, A_i = S_i - mean of the
    others. Metrics: the mean over responses of each response's token-mean KL, and the coef.

    Planted bugs: KL not subtracted (advantages off by up to 0.54), subtracted with the wrong
    sign, the coef dropped, the metric renamed or taken as a token mean over the batch (-0.061
    instead of -0.249), `_kl_for_controller` missing (the adaptive controller would never
    move)."""
    batch = _batch(kl=True)
    s = AdvantageSettings(estimator="rloo", use_kl_in_reward=True, kl_penalty="kl")
    metrics = compute_step_advantages(batch, s, kl_coef=0.3)
    kl = _ref_kl(batch, "kl")
    want_r = [[sc - 0.3 * k for sc, k in zip(srow, krow)]
              for srow, krow in zip(_ref_scores(batch), kl)]
    t = batch.tensors
    _close(t["token_level_scores"], _ref_scores(batch))
    _close(t["token_level_rewards"], want_r)
    S = [sum(row) for row in want_r]
    adv = []
    for i, gid in enumerate(GROUPS):
        others = [S[j] for j, g in enumerate(GROUPS) if g == gid and j != i]
        adv.append(S[i] - sum(others) / len(others))
    _close(t["advantages"], _tile(adv))
    cur = sum(sum(kl[i][:n]) / n for i, n in enumerate(LENGTHS)) / len(LENGTHS)
    assert set(metrics) == {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff",
                            "_kl_for_controller"}
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(cur, rel=1e-5)
    assert metrics["_kl_for_controller"] == pytest.approx(cur, rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.3


def test_kl_kind_and_when_the_kl_is_left_out():
    """kl_penalty="low_var_kl" reaches the estimator (k3 = e^-d + d - 1, not d); without
    use_kl_in_reward, or without ref_logprob, rewards are the scores and no KL metric is set.
    Planted bugs: the kind not passed (k1 instead of k3: rewards differ by up to 1.04); the flag
    ignored (rewards penalised although use_kl_in_reward is False)."""
    batch = _batch(kl=True, seed=1)
    s = AdvantageSettings(use_kl_in_reward=True, kl_penalty="low_var_kl")
    compute_step_advantages(batch, s, kl_coef=0.5)
    k3 = _ref_kl(batch, "low_var_kl")
    _close(batch.tensors["token_level_rewards"],
           [[sc - 0.5 * k for sc, k in zip(srow, krow)] for srow, krow in zip(_ref_scores(batch), k3)])

    batch = _batch(kl=True, seed=1)
    assert compute_step_advantages(batch, AdvantageSettings(), kl_coef=0.5) == {}
    _close(batch.tensors["token_level_rewards"], _ref_scores(batch))
    batch = _batch(kl=True, seed=1)
    del batch.tensors["ref_logprob"]
    assert compute_step_advantages(batch, AdvantageSettings(use_kl_in_reward=True), 0.5) == {}
    _close(batch.tensors["token_level_rewards"], _ref_scores(batch))


def test_gae_with_critic_values():
    """GAE (gamma 0.9, lam 0.8) by the textbook recursion over each response's tokens, returns =
    A + V, advantages whitened over all valid tokens (unbiased variance). Planted bugs: gamma and
    lam swapped (returns differ by up to 0.27, advantages by 7% of their scale); the values not
    passed (ValueError)."""
    batch = _batch(values=True, seed=2)
    s = AdvantageSettings(estimator="gae", gamma=0.9, lam=0.8)
    compute_step_advantages(batch, s, kl_coef=0.0)
    r, v = _ref_scores(batch), _d(batch.tensors["values"])
    adv, ret = [], []
    for i, n in enumerate(LENGTHS):
        a, nxt, last = [0.0] * L, 0.0, 0.0
        for t in reversed(range(n)):
            delta = r[i][t] + 0.9 * nxt - v[i][t]
            last = delta + 0.9 * 0.8 * last
            a[t], nxt = last, v[i][t]
        adv.append(a)
        ret.append([a[t] + v[i][t] if t < n else 0.0 for t in range(L)])
    _close(batch.tensors["returns"], ret)
    _close(batch.tensors["advantages"], _whiten(adv))


def test_reinforce_plus_plus_and_remax():
    """REINFORCE++: G_t = r_t + gamma G_{t+1} on the KL-penalised rewards, advantages whitened.
    ReMax: returns-to-go minus the greedy baseline (reward_baselines) on each token.
    Planted bugs: gamma not passed (1 instead of 0.7: returns differ by up to 0.64);
    rewards without KL given to the estimator; baselines not passed (ValueError) or
    taken from another key."""
    batch = _batch(kl=True, seed=3)
    s = AdvantageSettings(estimator="reinforce_plus_plus", gamma=0.7, use_kl_in_reward=True)
    compute_step_advantages(batch, s, kl_coef=0.2)
    r = [[sc - 0.2 * k for sc, k in zip(srow, krow)]
         for srow, krow in zip(_ref_scores(batch), _ref_kl(batch, "kl"))]
    ret = []
    for i, n in enumerate(LENGTHS):
        row, g = [0.0] * L, 0.0
        for t in reversed(range(n)):
            g = r[i][t] + 0.7 * g
            row[t] = g
        ret.append(row)
    _close(batch.tensors["returns"], ret)
    _close(batch.tensors["advantages"], _whiten(ret))

    batch = _batch(baselines=True)
    compute_step_advantages(batch, AdvantageSettings(estimator="remax"), kl_coef=0.0)
    b = batch.tensors["reward_baselines"].tolist()
    ret = [[VR[i] if t < n else 0.0 for t in range(L)] for i, n in enumerate(LENGTHS)]
    _close(batch.tensors["returns"], ret)
    _close(batch.tensors["advantages"],
           [[ret[i][t] - b[i] if t < n else 0.0 for t in range(L)] for i, n in enumerate(LENGTHS)])


def _ref_credit(step_rewards, steps, mode):
    """float64 PURE credit assignment, one response at a time."""
    out = []
    for i in range(len(step_rewards)):
        ends = [t for t in range(L) if steps[i][t] > 0]
        r = [step_rewards[i][t] for t in ends]
        row = [0.0] * L
        if mode == "sum":
            vals = r
        elif mode == "min":
            m = [min(r[k:]) for k in range(len(r))] + [0.0]
            vals = [m[k] - m[k + 1] if k + 1 < len(r) else r[k] for k in range(len(r))]
        else:
            e = [math.exp(-x / mode) for x in r]
            vals = [w / sum(e) * x for w, x in zip(e, r)]
        for t, x in zip(ends, vals):
            row[t] = x
        out.append(row)
    return out


@pytest.mark.parametrize("mode", [0.1, "min", "sum"])
def test_prm_scores_credit_assignment_and_outcome_metric(mode):
    """PRM on (grpo estimator): scores = coef * vr at the last token + credit-assigned step
    rewards; `prm_token_rewards` kept; metric critic/outcome_reward/mean = mean over responses
    of their summed PRM rewards. Planted bugs: credit_assignment not passed (0.1 always: scores
    differ by up to 0.17 for "min", 0.89 for "sum"); coef 2.5 not applied with a PRM
    (last-token scores off by 1.5);
    the metric summed over the batch instead of averaged (x6)."""
    batch = _batch(prm=True, seed=4)
    s = AdvantageSettings(prm_enabled=True, credit_assignment=mode, verifiable_reward_coef=2.5)
    metrics = compute_step_advantages(batch, s, kl_coef=0.0)
    t = batch.tensors
    prm = _ref_credit(_d(t["step_rewards"]), _d(t["step_mask"]), mode)
    _close(t["prm_token_rewards"], prm)
    _close(t["token_level_scores"], _ref_scores(batch, 2.5, prm))
    assert set(metrics) == {"critic/outcome_reward/mean"}
    assert metrics["critic/outcome_reward/mean"] == pytest.approx(
        sum(sum(row) for row in prm) / len(prm), rel=1e-5)
    S = [sum(row) for row in _ref_scores(batch, 2.5, prm)]
    stats = _group_stats(S)
    _close(t["advantages"], _tile([(S[i] - stats[g][0]) / (stats[g][1] + 1e-6)
                                   for i, g in enumerate(GROUPS)]))


def test_pacs_stops_after_the_rewards():
    """PACS computes its own advantage in the loss: the step writes scores = vr [B] (float32) and
    the rewards, and no advantages / returns. Planted bugs: scores taken from the token-level
    rewards or left out (PACS would fail at the first update); advantages computed anyway."""
    batch = _batch(kl=True)
    batch.tensors["verifiable"] = torch.tensor(VR, dtype=torch.float64)
    s = AdvantageSettings(use_kl_in_reward=True)
    metrics = pacs_advantages(batch, s, kl_coef=0.1)
    t = batch.tensors
    assert t["scores"].dtype == torch.float32 and t["scores"].tolist() == VR
    assert "advantages" not in t and "returns" not in t
    assert "actor/reward_kl_penalty" in metrics
    _close(t["token_level_rewards"], [[sc - 0.1 * k for sc, k in zip(srow, krow)]
                                      for srow, krow in zip(_ref_scores(batch), _ref_kl(batch, "kl"))])


def test_pure_vr_only_brute_force():
    """PURE without a PRM, no normalisation, no KL: the only reward is
    c (v_i - mean_{j != i} v_j) at EOS (v = vr - 1); returns-to-go carry it to every earlier
    token, and the EOS return is zeroed (step_mask defaults to the last token). Planted bugs:
    the default step_mask not the EOS one-hot (EOS return kept: differs at 6 tokens); vr_coef
    not passed (c = 1 instead of 2: advantages halve); group_index not passed."""
    batch = _batch()
    s = AdvantageSettings(estimator="pure_rloo", verifiable_reward_coef=2.0)
    pure_advantages(batch, s, PureSettings(normalize=False), kl_coef=0.0)
    v = [x - 1.0 for x in VR]
    want = []
    for i, n in enumerate(LENGTHS):
        others = [v[j] for j, g in enumerate(GROUPS) if g == GROUPS[i] and j != i]
        a = 2.0 * (v[i] - sum(others) / len(others))
        want.append([a if t < n - 1 else 0.0 for t in range(L)])
    _close(batch.tensors["advantages"], want)
    _close(batch.tensors["returns"], want)


@pytest.mark.parametrize("prm, vr, kl", [(True, True, True), (True, False, False),
                                         (False, True, True)])
def test_pure_wiring(prm, vr, kl):
    """Every argument of algos.pure_rloo_advantages comes from the right place: step rewards /
    mask (zeros / EOS without a PRM), mode from (prm, vr), credit assignment "min", vr_coef 1.7,
    the raw verifiable rewards, KL = low_var_kl(old, ref) * mask with the step's kl_coef 0.4,
    mask_separator False, normalize True. Planted bugs: kl_coef passed as 0 (KL ignored:
    advantages differ by up to 0.19), k1 instead of the configured kind, the separator flag dropped
    (True: step-end advantages zeroed), mode fixed to "prm_vr" (a PRM-only run gets the
    verifiable term)."""
    batch = _batch(prm=prm, kl=kl, seed=5)
    s = AdvantageSettings(estimator="pure_rloo", prm_enabled=prm, vr_enabled=vr,
                          credit_assignment="min", verifiable_reward_coef=1.7,
                          use_kl_in_reward=kl, kl_penalty="low_var_kl")
    pure_advantages(batch, s, PureSettings(mask_separator=False), kl_coef=0.4)
    t = batch.tensors
    mask = batch.response_mask
    eos = last_token_mask(mask)
    want_adv, want_ret = algos.pure_rloo_advantages(
        step_rewards=t["step_rewards"] if prm else torch.zeros_like(mask),
        step_mask=t["step_mask"] if prm else eos, response_mask=mask,
        verifiable_rewards=torch.tensor(VR), group_index=torch.tensor(GROUPS),
        mode={(True, True): "prm_vr", (True, False): "prm", (False, True): "vr"}[(prm, vr)],
        credit_assignment="min", vr_coef=1.7,
        kl=torch.tensor(_ref_kl(batch, "low_var_kl"), dtype=torch.float32) if kl else None,
        kl_coef=0.4 if kl else 0.0, mask_separator=False, normalize=True)
    torch.testing.assert_close(t["advantages"], want_adv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(t["returns"], want_ret, rtol=1e-5, atol=1e-6)
    if kl:  # the KL changes the result: the check above saw it
        no_kl, _ = algos.pure_rloo_advantages(
            step_rewards=t["step_rewards"] if prm else torch.zeros_like(mask),
            step_mask=t["step_mask"] if prm else eos, response_mask=mask,
            verifiable_rewards=torch.tensor(VR), group_index=torch.tensor(GROUPS),
            mode="prm_vr" if prm else "vr", credit_assignment="min", vr_coef=1.7,
            mask_separator=False, normalize=True)
        assert float((no_kl - want_adv).abs().max()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool])
def test_rewards_are_float32_whatever_the_verifiable_dtype(dtype):
    """Verifiable rewards as float64 (numpy), int64 or bool 0 / 1 give float32 scores, rewards
    and advantages equal to the float32 ones; PURE (whose pipeline takes float rewards only)
    likewise. Planted bugs: the rewards not cast (float64 scores, or int ones refused by
    pure_rloo_advantages)."""
    batch = _batch(kl=True)
    batch.tensors["verifiable"] = torch.tensor(VR).to(dtype)
    s = AdvantageSettings(estimator="rloo", use_kl_in_reward=True)
    compute_step_advantages(batch, s, kl_coef=0.3)
    t = batch.tensors
    for key in ("token_level_scores", "token_level_rewards", "advantages"):
        assert t[key].dtype == torch.float32, key
    _close(t["token_level_scores"], _ref_scores(batch))
    batch = _batch()
    batch.tensors["verifiable"] = torch.tensor(VR).to(dtype)
    pure_advantages(batch, AdvantageSettings(estimator="pure_rloo"), PureSettings(normalize=False),
                    kl_coef=0.0)
    v = [x - 1.0 for x in VR]  # PURE's brute force as in test_pure_vr_only_brute_force, c = 1
    want = []
    for i, n in enumerate(LENGTHS):
        others = [v[j] for j, g in enumerate(GROUPS) if g == GROUPS[i] and j != i]
        want.append([v[i] - sum(others) / len(others) if t < n - 1 else 0.0 for t in range(L)])
    assert batch.tensors["advantages"].dtype == torch.float32
    _close(batch.tensors["advantages"], want)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_place_rewards_returns_the_masked_kl(kind):
    """place_rewards returns the KL of the reward, per token, masked: k1 / k3 of (old, ref) on
    response tokens and exactly 0 on padding (where old = ref = 0); None without the KL in the
    reward. Planted bug: the KL divided by the mask (0 / 0 = NaN on padding)."""
    batch = _batch(kl=True, seed=6)
    _, kl = place_rewards(batch, AdvantageSettings(use_kl_in_reward=True, kl_penalty=kind), 0.2)
    assert kl.dtype == torch.float32
    _close(kl, _ref_kl(batch, kind))
    assert bool((kl[batch.response_mask == 0] == 0).all())
    assert place_rewards(_batch(kl=True), AdvantageSettings(), 0.2)[1] is None
