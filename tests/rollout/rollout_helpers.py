"""Shared helpers of tests/rollout (imported as a plain module: pytest puts this folder on
sys.path)."""

from __future__ import annotations

import numpy as np
import torch

from megarl.rollout.sampling import counter_uniforms


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 100) -> list[list[int]]:
    """Random prompts (ids 3..vocab-1, so no special token) starting with im_start (1)."""
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value of integer ``counts`` [K] against ``probs``
    [K] (float64, sums to 1 over the support). Bins with expected count < min_expected are
    merged into one; bins of probability 0 must have count 0 (asserted by the callers)."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    rest_e = expected[~big].sum()
    if rest_e > 0:
        obs.append(counts[~big].sum())
        exp.append(rest_e)
    obs, exp = np.array(obs), np.array(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    # survival function of chi2(dof) = regularised upper incomplete gamma Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def target_distribution(logits, temperature: float, top_k: int = -1, top_p: float = 1.0):
    """The sampling distribution of float64 ``logits`` [V] built independently in numpy: softmax
    of logits / T, keep the k largest, then keep tokens (descending) while the mass before
    them is < top_p, renormalise. Returns float64 [V] with zeros outside the kept set."""
    import numpy as np

    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    kk = len(p) if top_k is None or top_k <= 0 else min(top_k, len(p))
    ps = p[order][:kk] / p[order][:kk].sum()
    before = np.cumsum(ps) - ps
    sel = before < top_p if top_p < 1.0 else np.ones(kk, dtype=bool)
    keep[order[:kk][sel]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def assert_first_tokens_follow(completions, target, atol: float) -> None:
    """The first tokens of ``completions`` (one prompt's samples) follow the float64 ``target``
    distribution: none outside its support, chi-square p > 1e-3, and each reported logprob is
    log(target probability) within ``atol``."""
    import numpy as np

    tokens = np.array([c.token_ids[0] for c in completions])
    counts = np.bincount(tokens, minlength=len(target))
    assert counts[target == 0].sum() == 0, "sampled a token outside the kept set"
    assert chi2_pvalue(counts, target) > 1e-3
    lps = np.array([float(c.logprobs[0]) for c in completions])
    np.testing.assert_allclose(lps, np.log(target[tokens]), atol=atol)


def brute_force_generate(hf, prompts, sp, stop_ids: set[int],
                         keys: list[int] | None = None) -> list[tuple]:
    """(tokens, finish) per (prompt, sample), prompt-major, one sequence at a time, no cache:
    transformers' logits over the whole sequence at every step, the numpy-built target
    distribution's CDF inverted at the engine's documented uniform of (sp.seed, prompt key,
    sample, position); ``keys``: the prompts' keys (default their indices)."""
    out = []
    for r, prompt in enumerate(prompts):
        for s in range(sp.n):
            seq: list[int] = []
            finish = "length"
            while len(seq) < sp.max_new_tokens:
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + seq])).logits[0, -1].double().numpy()
                if sp.is_greedy:
                    tok = int(np.argmax(logits))
                else:
                    p = target_distribution(logits, sp.temperature, sp.top_k, sp.top_p)
                    filtered = sp.top_k > 0 or sp.top_p < 1.0
                    # documented CDF order: token ids unfiltered, descending prob when filtered
                    order = np.argsort(-p, kind="stable") if filtered else np.arange(len(p))
                    key = r if keys is None else keys[r]
                    u = counter_uniforms(sp.seed, torch.tensor([key]), torch.tensor([s]),
                                         torch.tensor([len(seq)])).item()
                    cdf = np.cumsum(p[order])
                    tok = int(order[min(np.searchsorted(cdf, u * cdf[-1], side="right"),
                                        len(p) - 1)])
                seq.append(tok)
                if tok in stop_ids:
                    finish = "stop"
                    break
            out.append((seq, finish))
    return out


def moved_folder(path, dest, scale: float = 0.3, seed: int = 11):
    """A copy of the model folder ``path`` at ``dest`` with every weight moved by ``scale`` of
    its spread (seeded noise): another policy of the same shape."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    g = torch.Generator().manual_seed(seed)
    state = load_file(str(path / "model.safetensors"))
    save_file({k: (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous()
               for k, v in state.items()}, str(dest / "model.safetensors"))
    return dest


def float64_model(path):
    """transformers' model of the folder ``path`` in float64 (eval): a reference of its own."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                             dtype=torch.float64).eval()


def switching_reference(hf_old, hf_new, switch: int, prompt, key: int, seed: int, sample: int,
                        sp) -> tuple[list[int], list[float]]:
    """(tokens, float64 logprobs) of one sample of a partial rollout drawn one token at a time
    without a cache: the tokens before position ``switch`` from float64 model ``hf_old``'s
    logits, the rest from ``hf_new``'s (each reads the whole prefix), the CDF inverted at the
    engine's uniform of (seed, key, sample, position). ``sp``: temperature sampling without
    stops (``ignore_eos``): every sample runs ``sp.max_new_tokens`` tokens."""
    assert sp.ignore_eos and not sp.stop_token_ids and sp.top_k <= 0 and sp.top_p >= 1.0
    seq: list[int] = []
    lps: list[float] = []
    while len(seq) < sp.max_new_tokens:
        hf = hf_old if len(seq) < switch else hf_new
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + seq])).logits[0, -1].numpy()
        p = target_distribution(logits, sp.temperature)
        u = counter_uniforms(seed, torch.tensor([key]), torch.tensor([sample]),
                             torch.tensor([len(seq)])).item()
        cdf = np.cumsum(p)
        tok = int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1))
        seq.append(tok)
        lps.append(float(np.log(p[tok])))
    return seq, lps
