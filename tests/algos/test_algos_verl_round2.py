"""GPG (estimator and loss), Optimal Token Baseline, SAPO's loss and rollout rejection sampling
against float64 brute-force loops over python floats, written from verl's definitions
(core_algos.compute_gpg_outcome_advantage / compute_optimal_token_baseline_advantage /
compute_policy_loss_sapo / compute_policy_loss_gpg, rollout_corr_helper.
compute_rollout_rejection_mask), not from the vectorised code.

Planted while writing (each made the named tests fail; values as printed):
- gpg estimator with `alpha = 1` (no batch-level factor): test_gpg_advantages_match_the_loop
  (greatest difference 0.75 at [1, 0]) and test_gpg_alpha_is_batch_level (0.5 vs 1.0);
- OTB with `w * rho` instead of `w * rho^2`: test_optimal_token_baseline_matches_the_loop with
  IS weights (greatest difference 0.22 at [0, 3]); its zero tail starting at the longest instead
  of the second-longest length: the zero_tail cases (1.06 at [1, 1]);
- SAPO aggregated with `token-mean` instead of the forced `seq-mean-token-mean`:
  test_sapo_matches_the_loop (loss -0.3205 vs the loop's -0.8877); gate `2/tau` instead of
  `4/tau`: the same test (-0.4438 vs -0.8877). (`tau_pos` also where A = 0 is an equivalent
  mutant: A = 0 makes the token's loss 0 whatever tau.)
- gpg loss on the log-ratio `-(logp - old) A` instead of `-logp A`:
  test_gpg_loss_matches_the_loop (0.1924 vs 0.4501);
- rejection with `k1 = +x` instead of verl's `-x`: test_rejection_mask_and_metrics_match_the_loop
  (token_k1_mean -0.879 vs 0.879, and other keep masks); seq_mean as the sum (57.39 vs 9.58
  for the max); no +-20 clamp before the statistics (1.356 vs 0.879); several options OR-ed
  instead of AND-ed: the two-option cases' keep masks differ.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl import algos

D = torch.float64
GEN = torch.Generator()


@pytest.fixture(autouse=True)
def _same_draws_in_any_order():
    """Each test draws the same data however it is selected, ordered or spread over workers."""
    GEN.manual_seed(7)


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, generator=GEN, dtype=D) * scale


MASK = torch.tensor([[1, 1, 1, 1, 0, 0],
                     [1, 1, 0, 0, 0, 0],
                     [1, 1, 1, 1, 1, 1],
                     [1, 0, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
GROUPS = torch.tensor([3, 1, 3, 1, 3, 9, 4])  # interleaved; 9 and 4 are singletons


def outcome(scores, mask):
    """Scores on each response's last valid token."""
    r = torch.zeros(mask.shape, dtype=D)
    for i, s in enumerate(scores):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        if toks:
            r[i, toks[-1]] = s
    return r


def close(got, want, atol):
    """assert_close with rtol 0 (its message names the greatest difference and where)."""
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def L(t):
    return t.tolist()


# ------------------------------------------------------------------------------ GPG estimator
def brute_gpg(rewards, mask, groups):
    B, T = len(rewards), len(rewards[0])
    score = [sum(rewards[i][t] for t in range(T) if mask[i][t]) for i in range(B)]
    nonzero = sum(1 for s in score if s != 0)
    alpha = B / max(nonzero, 1)
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        members = [score[j] for j in range(B) if groups[j] == groups[i]]
        base = sum(members) / len(members) if len(members) > 1 else 0.0
        for t in range(T):
            if mask[i][t]:
                out[i][t] = alpha * (score[i] - base)
    return out


@pytest.mark.parametrize("scores", [[1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.5],
                                    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                                    [0.3, -1.2, 2.0, 0.7, 1.1, 5.0, -0.4]])
def test_gpg_advantages_match_the_loop(scores):
    rewards = outcome(scores, MASK)
    adv, ret = algos.compute_advantages("gpg", token_rewards=rewards, response_mask=MASK,
                                        group_index=GROUPS)
    want = brute_gpg(L(rewards), L(MASK), L(GROUPS))
    assert adv.dtype == D
    close(adv, torch.tensor(want, dtype=D), 1e-12)
    assert torch.equal(adv, ret)


def test_gpg_alpha_is_batch_level():
    """verl's quirk: alpha = B / #nonzero over the whole batch, so adding a zero-score group
    elsewhere scales this group's advantages."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    r = outcome([1.0, 0.0], mask)
    a2, _ = algos.compute_advantages("gpg", token_rewards=r, response_mask=mask,
                                     group_index=torch.tensor([0, 0]))
    mask4 = torch.ones(4, 3, dtype=torch.bool)
    r4 = outcome([1.0, 0.0, 0.0, 0.0], mask4)
    a4, _ = algos.compute_advantages("gpg", token_rewards=r4, response_mask=mask4,
                                     group_index=torch.tensor([0, 0, 1, 1]))
    assert float(a2[0, 0]) == pytest.approx(2 * 0.5)  # alpha = 2/1
    assert float(a4[0, 0]) == pytest.approx(4 * 0.5)  # alpha = 4/1


# ----------------------------------------------------------------------- optimal token baseline
def brute_otb(rewards, mask, groups, old, spp, w_is=None, zero_tail=False, eps=1e-8):
    B, T = len(rewards), len(rewards[0])
    G = [[0.0] * T for _ in range(B)]
    W = [[0.0] * T for _ in range(B)]
    for i in range(B):
        acc = 0.0
        for t in reversed(range(T)):
            acc += rewards[i][t] if mask[i][t] else 0.0
            G[i][t] = acc if mask[i][t] else 0.0
        cum = 0.0
        for t in range(T):
            if mask[i][t]:
                w = 1.0 - 2.0 * math.exp(old[i][t]) + spp[i][t]
                if w_is is not None:
                    w *= w_is[i][t] ** 2
                cum += w
            W[i][t] = cum if mask[i][t] else 0.0
    base = [[0.0] * T for _ in range(B)]
    for i in range(B):
        members = [j for j in range(B) if groups[j] == groups[i]]
        if len(members) < 2:
            continue
        for t in range(T):
            num = sum(G[j][t] * W[j][t] for j in members if mask[j][t])
            den = sum(W[j][t] for j in members if mask[j][t])
            base[i][t] = num / (den + eps)
        if zero_tail:
            lens = sorted(sum(mask[j]) for j in members)
            mine = sum(mask[i])
            if mine == lens[-1] and lens[-1] > lens[-2]:
                for t in range(lens[-2], T):
                    base[i][t] = 0.0
    adv = [[(G[i][t] - base[i][t]) if mask[i][t] else 0.0 for t in range(T)] for i in range(B)]
    return adv, G


@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_optimal_token_baseline_matches_the_loop(with_is, zero_tail):
    B, T = MASK.shape
    rewards = rnd(B, T) * MASK  # dense (process-like) rewards
    old = -rnd(B, T).abs()  # log-probs <= 0
    spp = torch.rand(B, T, generator=GEN, dtype=D)
    w_is = torch.rand(B, T, generator=GEN, dtype=D) * 2 if with_is else None
    # padding garbage never counts
    old = torch.where(MASK, old, float("nan"))
    adv, ret = algos.optimal_token_baseline(rewards, MASK, GROUPS, old, spp,
                                            rollout_is_weights=w_is, handle_zero_tail=zero_tail)
    want_a, want_g = brute_otb(L(rewards), L(MASK), L(GROUPS), L(old), L(spp),
                               None if w_is is None else L(w_is), zero_tail)
    close(adv, torch.tensor(want_a, dtype=D), 1e-12)
    close(ret, torch.tensor(want_g, dtype=D), 1e-12)


def test_optimal_token_baseline_singleton_keeps_the_return():
    mask = torch.ones(1, 3, dtype=torch.bool)
    r = torch.tensor([[0.0, 1.0, 2.0]], dtype=D)
    adv, ret = algos.optimal_token_baseline(r, mask, torch.tensor([0]),
                                            torch.zeros(1, 3, dtype=D), torch.ones(1, 3, dtype=D))
    assert adv.tolist() == [[3.0, 3.0, 2.0]] and ret.tolist() == [[3.0, 3.0, 2.0]]


# ------------------------------------------------------------------------------- policy losses
def seq_mean_token_mean(mat, mask):
    total, n = 0.0, 0
    for i in range(len(mat)):
        toks = [t for t in range(len(mat[0])) if mask[i][t]]
        if toks:
            total += sum(mat[i][t] for t in toks) / (len(toks) + 1e-8)
            n += 1
    return total / n


def token_mean(mat, mask):
    vals = [mat[i][t] for i in range(len(mat)) for t in range(len(mat[0])) if mask[i][t]]
    return sum(vals) / len(vals)


def brute_sapo(logp, old, adv, mask, tau_pos, tau_neg, w=None):
    """(loss, d loss / d logp per token, ppo_kl)."""
    B, T = len(logp), len(logp[0])
    loss_mat = [[0.0] * T for _ in range(B)]
    grad_mat = [[0.0] * T for _ in range(B)]
    kls = []
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            d = min(max(logp[i][t] - old[i][t], -20.0), 20.0)
            rho = math.exp(d)
            tau = tau_pos if adv[i][t] > 0 else tau_neg
            s = 1.0 / (1.0 + math.exp(-tau * (rho - 1.0)))
            scale = w[i][t] if w is not None else 1.0
            loss_mat[i][t] = -s * 4.0 / tau * adv[i][t] * scale
            grad_mat[i][t] = -4.0 * s * (1.0 - s) * rho * adv[i][t] * scale
            kls.append(-d)
    loss = seq_mean_token_mean(loss_mat, mask)
    n_rows = sum(1 for i in range(B) if any(mask[i]))
    grads = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = sum(mask[i])
        for t in range(T):
            if mask[i][t]:
                grads[i][t] = grad_mat[i][t] / (n + 1e-8) / n_rows
    return loss, grads, sum(kls) / (len(kls) + 1e-8)  # verl's masked_mean


@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0)])
@pytest.mark.parametrize("with_is", [False, True])
def test_sapo_matches_the_loop(taus, with_is):
    B, T = MASK.shape
    old = -rnd(B, T).abs()
    logp = (old + rnd(B, T, scale=0.4)).requires_grad_(True)
    adv = rnd(B, T)
    adv[0, 1] = 0.0  # A = 0 takes tau_neg
    w = torch.rand(B, T, generator=GEN, dtype=D) + 0.5 if with_is else None
    options = None if taus == (1.0, 1.05) else {"tau_pos": taus[0], "tau_neg": taus[1]}
    loss, m = algos.policy_loss("sapo", logprob=logp, old_logprob=old, advantages=adv,
                                response_mask=MASK, agg_mode="token-mean",
                                rollout_is_weights=w, options=options)
    loss.backward()
    want, grads, kl = brute_sapo(L(logp.detach()), L(old), L(adv), L(MASK), *taus,
                                 None if w is None else L(w))
    assert float(loss.detach()) == pytest.approx(want, abs=1e-12)
    close(logp.grad, torch.tensor(grads, dtype=D), 1e-12)
    assert m["pg_clipfrac"] == 0.0 and m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(kl, abs=1e-12)


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """At rho = 1 the gate's slope is 1: the gradient is -A / n_i / rows (seq-mean-token-mean)."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=D)
    loss, _ = algos.policy_loss("sapo", logprob=lp, old_logprob=lp.detach(), advantages=adv,
                                response_mask=mask)
    loss.backward()
    close(lp.grad, -adv / 4, 1e-8)  # 1e-8: token-mean's n + 1e-8
    # loss value: -(2/tau) A averaged
    assert float(loss.detach()) == pytest.approx(-(2 / 1.0 * 1.0) / 2 - (2 / 1.05 * -2.0) / 2,
                                                 abs=1e-8)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gpg_loss_matches_the_loop(agg):
    B, T = MASK.shape
    logp = (-rnd(B, T).abs()).requires_grad_(True)
    old = -rnd(B, T).abs()
    adv = rnd(B, T)
    loss, m = algos.policy_loss("gpg", logprob=logp, old_logprob=old, advantages=adv,
                                response_mask=MASK, agg_mode=agg)
    loss.backward()
    lp, a, mk = L(logp.detach()), L(adv), L(MASK)
    mat = [[-lp[i][t] * a[i][t] for t in range(T)] for i in range(B)]
    agg_fn = token_mean if agg == "token-mean" else seq_mean_token_mean
    assert float(loss.detach()) == pytest.approx(agg_fn(mat, mk), abs=1e-12)
    # gradient: d/dlogp of the aggregated -logp A
    gmat = [[-a[i][t] for t in range(T)] for i in range(B)]
    n_tok = sum(sum(r) for r in mk)
    n_rows = sum(1 for r in mk if any(r))
    for i in range(B):
        for t in range(T):
            want = 0.0
            if mk[i][t]:
                want = gmat[i][t] / n_tok if agg == "token-mean" else \
                    gmat[i][t] / (sum(mk[i]) + 1e-8) / n_rows
            assert float(logp.grad[i, t]) == pytest.approx(want, abs=1e-12)
    assert m["pg_clipfrac"] == 0.0
    assert not algos.policy_loss_has_ratio("gpg")
    assert algos.policy_loss_has_ratio("sapo")


def test_options_go_only_to_the_loss_that_declares_them():
    assert algos.POLICY_LOSS_OPTIONS["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}
    lp = torch.zeros(1, 2, dtype=D)
    # vanilla has no **_ catching stray keywords: the options must not reach it
    algos.policy_loss("vanilla", logprob=lp, old_logprob=lp, advantages=lp + 1,
                      response_mask=torch.ones(1, 2), options={"tau_pos": 3.0})


# ---------------------------------------------------------------------- rejection sampling
def brute_rs(old, rollout, mask, specs):
    """keep mask and metrics by loops; specs: {option: (lower or None, upper)}."""
    B, T = len(old), len(old[0])
    keep = [[bool(mask[i][t]) for t in range(T)] for i in range(B)]
    rows = [i for i in range(B) if any(mask[i])]
    n = sum(sum(1 for t in range(T) if mask[i][t]) for i in range(B))
    met = {}
    P = "rollout_corr/rollout_rs_"
    for opt, (lo, hi) in specs.items():
        kind = opt[-2:]

        def k(x, kind=kind):
            x = min(max(x, -20.0), 20.0)
            return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[kind]
        toks = {i: [k(old[i][t] - rollout[i][t]) for t in range(T) if mask[i][t]] for i in range(B)}
        value = {}  # (i, t) -> statistic judged
        per_row = {}
        for i in rows:
            if opt.startswith("seq_sum"):
                per_row[i] = sum(toks[i])
            elif opt.startswith("seq_mean"):
                per_row[i] = sum(toks[i]) / (len(toks[i]) + 1e-8)
            elif opt.startswith("seq_max"):
                per_row[i] = max(toks[i])
            j = 0
            for t in range(T):
                if mask[i][t]:
                    value[i, t] = per_row[i] if per_row else toks[i][j]
                    j += 1

        def ok(v, lo=lo, hi=hi):
            if lo is None:
                return v <= hi
            return math.log(lo) <= v <= math.log(hi)
        rejected = {key for key, v in value.items() if not ok(v)}
        for i, t in rejected:
            keep[i][t] = False
        vals = list(value.values())
        met[P + opt + "_mean"] = sum(vals) / n
        src = list(per_row.values()) if per_row else vals
        met[P + opt + "_max"], met[P + opt + "_min"] = max(src), min(src)
        met[P + opt + "_masked_fraction"] = len(rejected) / n
        met[P + opt + "_seq_masked_fraction"] = len({i for i, _ in rejected}) / len(rows)
    dropped = [(i, t) for i in range(B) for t in range(T) if mask[i][t] and not keep[i][t]]
    met[P + "masked_fraction"] = len(dropped) / n
    met[P + "seq_masked_fraction"] = len({i for i, _ in dropped}) / B
    return [[1.0 if keep[i][t] else 0.0 for t in range(T)] for i in range(B)], met


RS_CASES = [
    ("token_k1", "0.8_1.25", {"token_k1": (0.8, 1.25)}),
    ("token_k1", 1.3, {"token_k1": (1 / 1.3, 1.3)}),
    ("token_k1", "0.5_1.1", {"token_k1": (0.5, 1.1)}),  # asymmetric: bounds on mu/pi
    ("token_k2", 0.05, {"token_k2": (None, 0.05)}),
    ("token_k3", "0.04", {"token_k3": (None, 0.04)}),
    ("seq_sum_k1", "0.5_2.0", {"seq_sum_k1": (0.5, 2.0)}),
    ("seq_sum_k2", 0.2, {"seq_sum_k2": (None, 0.2)}),
    ("seq_sum_k3", 0.2, {"seq_sum_k3": (None, 0.2)}),
    ("seq_mean_k1", "0.7_1.4", {"seq_mean_k1": (0.7, 1.4)}),
    ("seq_mean_k2", 0.03, {"seq_mean_k2": (None, 0.03)}),
    ("seq_mean_k3", 0.03, {"seq_mean_k3": (None, 0.03)}),
    ("seq_max_k2", 0.08, {"seq_max_k2": (None, 0.08)}),
    ("seq_max_k3", 0.08, {"seq_max_k3": (None, 0.08)}),
    ("token_k1, seq_max_k3,token_k1", "0.7_1.4,0.1",
     {"token_k1": (0.7, 1.4), "seq_max_k3": (None, 0.1)}),
    ("seq_mean_k1,token_k2", 1.2, {"seq_mean_k1": (1 / 1.2, 1.2), "token_k2": (None, 1.2)}),
]


@pytest.mark.parametrize("rs,threshold,specs", RS_CASES)
def test_rejection_mask_and_metrics_match_the_loop(rs, threshold, specs):
    B, T = MASK.shape
    old = -rnd(B, T).abs()
    rollout = old + rnd(B, T, scale=0.3)
    rollout[2, 3] = old[2, 3] + 30.0  # beyond the +-20 clamp
    old_nan = torch.where(MASK, old, float("nan"))
    keep, met = algos.compute_rollout_rejection_mask(old_nan, rollout, MASK, rollout_rs=rs,
                                                     threshold=threshold)
    want_keep, want_met = brute_rs(L(old), L(rollout), L(MASK), specs)
    assert keep.tolist() == want_keep
    assert 0 < sum(map(sum, want_keep)) < int(MASK.sum())  # the case rejects some, keeps some
    assert met.keys() == want_met.keys()
    for key, v in want_met.items():
        assert met[key] == pytest.approx(v, abs=1e-12), key


def test_rejection_threshold_parsing():
    assert algos.parse_rollout_rs("seq_sum_k1", 2.0) == {"seq_sum_k1": (0.5, 2.0)}
    assert algos.parse_rollout_rs("token_k3,token_k3", "0.1") == {"token_k3": (None, 0.1)}
    for rs, th in [("token_k1", None), ("token", 2.0), ("token_k2", "0.1_0.2"),
                   ("token_k1", "-1_2"), ("token_k1,token_k2", "1,2,3"), ("seq_max_k1", 2.0),
                   (" , ", 2.0), ("token_k1", True)]:
        with pytest.raises(ValueError):
            algos.parse_rollout_rs(rs, th)


def test_rejection_of_an_empty_batch_keeps_nothing():
    z = torch.zeros(2, 3)
    keep, met = algos.compute_rollout_rejection_mask(z, z, z, rollout_rs="token_k2", threshold=1)
    assert keep.sum() == 0 and met == {}


def test_zero_tail_after_a_singleton_group_and_not_on_a_tie():
    """A singleton group sorts first (the groups after it still get their tails zeroed); a
    group whose two longest responses tie keeps its baseline."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0],
                         [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    groups = torch.tensor([7, 7, 0, 5, 5, 5])
    rewards = rnd(6, 4) * mask
    old, spp = -rnd(6, 4).abs(), torch.rand(6, 4, generator=GEN, dtype=D)
    adv, _ = algos.optimal_token_baseline(rewards, mask, groups, old, spp, handle_zero_tail=True)
    want, ret = brute_otb(L(rewards), L(mask), L(groups), L(old), L(spp), zero_tail=True)
    close(adv, torch.tensor(want, dtype=D), 1e-12)
    assert adv[3, 2:].tolist() == ret[3][2:]  # row 3's baseline is 0 from length 2 on
    assert adv[0, 2] != ret[0][2]  # the tied rows keep theirs
