"""Brute-force references for the megarl.algos tests.

Plain python floats and loops over lists, written from the formulas of
notes/reference-algorithms.md, never from megarl's code: grouping by dict, statistics by explicit
sums, returns by nested loops. Slow and obvious on purpose.
"""

from __future__ import annotations

import math


def rows(t):
    """Tensor [B, L] -> list of lists of floats (or bools)."""
    return [list(r) for r in t.tolist()]


def groups_of(group_index):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group_index):
        out.setdefault(int(g), []).append(i)
    return out


def score(rewards, mask):
    return [sum(r for r, m in zip(rr, mm) if m) for rr, mm in zip(rewards, mask)]


def mean(xs):
    return sum(xs) / len(xs)


def std_unbiased(xs):
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def whiten_tokens(mat, mask):
    """Batch-wide token whitening: unbiased variance, +1e-8 inside the square root."""
    vals = [v for rr, mm in zip(mat, mask) for v, m in zip(rr, mm) if m]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / (n - 1)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [[(v - mu) * scale if m else 0.0 for v, m in zip(rr, mm)] for rr, mm in zip(mat, mask)]


def tile(per_row, mask):
    return [[a if m else 0.0 for m in mm] for a, mm in zip(per_row, mask)]


def grpo(rewards, mask, group_index, norm=True, eps=1e-6):
    s = score(rewards, mask)
    adv = [0.0] * len(s)
    for members in groups_of(group_index).values():
        vals = [s[i] for i in members]
        mu, sd = (mean(vals), std_unbiased(vals)) if len(vals) > 1 else (0.0, 1.0)
        for i in members:
            adv[i] = (s[i] - mu) / (sd + eps) if norm else s[i] - mu
    return tile(adv, mask)


def rloo(rewards, mask, group_index):
    s = score(rewards, mask)
    adv = [0.0] * len(s)
    for members in groups_of(group_index).values():
        for i in members:
            others = [s[j] for j in members if j != i]
            adv[i] = s[i] - mean(others) if others else 0.0
    return tile(adv, mask)


def opo(rewards, mask, group_index):
    s = score(rewards, mask)
    lengths = [sum(1 for m in mm if m) for mm in mask]
    adv = [0.0] * len(s)
    for members in groups_of(group_index).values():
        if len(members) == 1:
            b = 0.0
        else:
            b = sum(lengths[j] * s[j] for j in members) / sum(lengths[j] for j in members)
        for i in members:
            adv[i] = s[i] - b
    return tile(adv, mask)


def grpo_passk(rewards, mask, group_index, norm=True, eps=1e-6):
    s = score(rewards, mask)
    adv = [0.0] * len(s)
    for members in groups_of(group_index).values():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda i: (-s[i], i))
        best, second = ordered[0], ordered[1]
        gap = s[best] - s[second]
        if norm:
            gap /= std_unbiased([s[i] for i in members]) + eps
        adv[best] = gap
    return tile(adv, mask)


def rpp_baseline(rewards, mask, group_index):
    s = score(rewards, mask)
    a = [0.0] * len(s)
    for members in groups_of(group_index).values():
        mu = mean([s[i] for i in members]) if len(members) > 1 else 0.0
        for i in members:
            a[i] = s[i] - mu
    return whiten_tokens(tile(a, mask), mask)


def rpp_returns(rewards, mask, gamma):
    """G_t = sum over the contiguous valid run starting at t of gamma^k r_{t+k}."""
    out = []
    for rr, mm in zip(rewards, mask):
        row = []
        for t in range(len(rr)):
            if not mm[t]:
                row.append(0.0)
                continue
            g, k = 0.0, 0
            while t + k < len(rr) and mm[t + k]:
                g += gamma**k * rr[t + k]
                k += 1
            row.append(g)
        out.append(row)
    return out


def remax(rewards, mask, baselines):
    ret = [[sum(rr[j] for j in range(t, len(rr)) if mm[j]) if mm[t] else 0.0 for t in range(len(rr))]
           for rr, mm in zip(rewards, mask)]
    adv = [[r - b if m else 0.0 for r, m in zip(rr, mm)] for rr, mm, b in zip(ret, mask, baselines)]
    return adv, ret


def gae(rewards, values, mask, gamma, lam):
    """GAE on the compressed valid-token sequence: A_t = sum_l (gamma lam)^l delta_{t+l}."""
    raw = []
    for rr, vv, mm in zip(rewards, values, mask):
        pos = [t for t in range(len(rr)) if mm[t]]
        r = [rr[t] for t in pos]
        v = [vv[t] for t in pos] + [0.0]
        delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(pos))]
        adv_c = [sum((gamma * lam) ** j * delta[k + j] for j in range(len(pos) - k)) for k in range(len(pos))]
        row = [0.0] * len(rr)
        for k, t in enumerate(pos):
            row[t] = adv_c[k]
        raw.append(row)
    returns = [[a + v if m else 0.0 for a, v, m in zip(ar, vr, mm)] for ar, vr, mm in zip(raw, values, mask)]
    return whiten_tokens(raw, mask), returns


def softplus(x):
    return math.log1p(math.exp(-abs(x))) + max(x, 0.0)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def pacs(logp, old, mask, scores, group_index, beta, method, estimator, weight_mode, norm=True):
    """Returns (loss, psi list, dloss/dlogp [B][L]) computed by hand (chain rule written out)."""
    bsz = len(logp)
    lengths = [sum(1 for m in mm if m) for mm in mask]
    if method == "1":
        r = [beta * sum(a - b for a, b, m in zip(lr, orow, mm) if m) for lr, orow, mm in zip(logp, old, mask)]
    else:
        r = [beta * sum(a for a, m in zip(lr, mm) if m) / lengths[i] for i, (lr, mm) in enumerate(zip(logp, mask))]
    groups = groups_of(group_index)
    psi = [0.0] * bsz
    jac = [[0.0] * bsz for _ in range(bsz)]  # jac[k][i] = dpsi_k / dr_i
    for members in groups.values():
        n = len(members)
        vals = [r[i] for i in members]
        for k in members:
            if estimator == "naive":
                psi[k] = r[k]
                jac[k][k] = 1.0
            elif estimator == "rloo":
                if n == 1:
                    psi[k] = 0.0
                    continue
                psi[k] = r[k] - (sum(vals) - r[k]) / (n - 1)
                for i in members:
                    jac[k][i] = 1.0 if i == k else -1.0 / (n - 1)
            else:  # grpo
                if n == 1:
                    psi[k] = r[k] / (1.0 + 1e-6) if norm else r[k]
                    jac[k][k] = 1.0 / (1.0 + 1e-6) if norm else 1.0
                    continue
                mu, sd = mean(vals), std_unbiased(vals)
                if not norm:
                    psi[k] = r[k] - mu
                    for i in members:
                        jac[k][i] = (1.0 if i == k else 0.0) - 1.0 / n
                    continue
                psi[k] = (r[k] - mu) / (sd + 1e-6)
                for i in members:
                    dmu = 1.0 / n
                    dsd = (r[i] - mu) / ((n - 1) * sd)
                    num = (1.0 if i == k else 0.0) - dmu
                    jac[k][i] = num / (sd + 1e-6) - (r[k] - mu) * dsd / (sd + 1e-6) ** 2
    w = [1.0] * bsz
    if weight_mode == "question":
        for members in groups.values():
            pos = [i for i in members if scores[i] == 1]
            neg = [i for i in members if scores[i] == 0]
            if pos and neg:
                for i in pos:
                    w[i] = len(members) / (2 * len(pos))
                for i in neg:
                    w[i] = len(members) / (2 * len(neg))
    elif weight_mode == "only_positive":
        w = [1.0 if s == 1 else 0.0 for s in scores]
    elif weight_mode == "only_negative":
        w = [1.0 if s == 0 else 0.0 for s in scores]
    loss = sum(w[i] * (softplus(psi[i]) - scores[i] * psi[i]) for i in range(bsz)) / bsz
    dpsi = [w[i] * (sigmoid(psi[i]) - scores[i]) / bsz for i in range(bsz)]
    dr = [sum(dpsi[k] * jac[k][i] for k in range(bsz)) for i in range(bsz)]
    grad = []
    for i in range(bsz):
        scale = beta if method == "1" else beta / lengths[i]
        grad.append([dr[i] * scale if m else 0.0 for m in mask[i]])
    return loss, psi, grad


def pure_main(step_rewards, step_mask, mask, vr, group_index, mode, temperature, vr_coef, kl, kl_coef,
              mask_separator, normalize):
    """PURE main branch, one response at a time (credit assignment: approx min-form with T or
    None for the identity "sum")."""
    bsz, length = len(mask), len(mask[0])
    ends = [[t for t in range(length) if step_mask[i][t]] for i in range(bsz)]
    lengths = [sum(1 for m in mm if m) for mm in mask]
    eos = [max([t for t in range(length) if mask[i][t]], default=None) for i in range(bsz)]
    token_r = [[0.0] * length for _ in range(bsz)]
    if mode in ("prm", "prm_vr"):
        for i in range(bsz):
            rs = [step_rewards[i][t] for t in ends[i]]
            if temperature is None:
                ws = [1.0] * len(rs)
            else:
                ex = [math.exp(-(x - min(rs)) / temperature) for x in rs]
                ws = [e / sum(ex) for e in ex]
            for t, w, x in zip(ends[i], ws, rs):
                token_r[i][t] = w * x
    outcome = [sum(row) for row in token_r]
    groups = groups_of(group_index)
    reward = [row[:] for row in token_r]
    if mode in ("prm", "prm_vr"):
        for members in groups.values():
            for i in members:
                others = [j for j in members if j != i]
                tot_len = sum(lengths[j] for j in others)
                per_tok = sum(outcome[j] for j in others) / tot_len if others and tot_len else 0.0
                prev = -1
                for t in ends[i]:
                    ntok = sum(1 for u in range(prev + 1, t) if mask[i][u])
                    reward[i][t] -= per_tok * ntok
                    prev = t
    if mode in ("vr", "prm_vr"):
        v = [s - 1.0 for s in vr]
        for members in groups.values():
            for i in members:
                others = [v[j] for j in members if j != i]
                if others and eos[i] is not None:
                    reward[i][eos[i]] += vr_coef * (v[i] - mean(others))
    for i in range(bsz):
        for t in range(length):
            if mask[i][t] and kl is not None:
                reward[i][t] -= kl_coef * kl[i][t]
            if not mask[i][t]:
                reward[i][t] = 0.0
    returns = [[sum(reward[i][u] for u in range(t, length)) for t in range(length)] for i in range(bsz)]
    for i in range(bsz):
        for t in range(length):
            if not mask[i][t] or (mask_separator and (step_mask[i][t] or t == eos[i])):
                returns[i][t] = 0.0
    adv = [row[:] for row in returns]
    if normalize:
        vals = [adv[i][t] for i in range(bsz) for t in range(length) if mask[i][t]]
        n_zero = sum(1 for x in vals if x == 0.0) if mask_separator else 0
        count = len(vals) - n_zero
        if count == 0:
            return [[0.0] * length for _ in range(bsz)], returns
        mu = sum(vals) / count
        var = sum((x - mu) ** 2 for x in vals) / count
        scale = 1.0 / math.sqrt(max(var, 1e-8))
        adv = [[((adv[i][t] - mu) * scale if not (mask_separator and adv[i][t] == 0.0) else 0.0)
                if mask[i][t] else 0.0 for t in range(length)] for i in range(bsz)]
    return adv, returns
